"""The timing loop's repeat budget, on the host clock and on CUDA events.

The CUDA path is driven here by a fake clock standing in for torch.cuda events: what matters is
that the budget is judged from the time a call takes on the device, not from how fast the host
enqueues it (the host runs ahead of a slow kernel, so a host clock never runs out).
"""

import time

import pytest
import torch

from dmbench import timing
from dmbench.sweep import Timing


@pytest.mark.parametrize("call_ms,expected", [
    (None, 20),      # no warmup call to judge from: every repeat
    (0.05, 20),      # fast calls: the repeat count binds, not the budget
    (400.0, 5),      # 2 s / 400 ms
    (800.0, 3),      # 2 s / 800 ms = 2, raised to the floor of MIN_REPEATS
    (5000.0, 3),     # one call longer than the whole budget
])
def test_planned_repeats(call_ms, expected):
    assert timing.MIN_REPEATS == 3
    assert timing.planned_repeats(call_ms, Timing(warmup=3, repeats=20, budget_s=2.0)) == expected


def test_host_clock_budget_stops_after_min_repeats():
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.04)

    result = timing.measure(slow, Timing(warmup=1, repeats=20, budget_s=0.05), torch.device("cpu"))
    assert len(result.samples_ms) == timing.MIN_REPEATS
    assert len(calls) == 1 + timing.MIN_REPEATS
    assert all(s >= 40.0 for s in result.samples_ms)


class _FakeDeviceClock:
    """Stands in for torch.cuda events: each call of the timed function takes ``call_ms`` of
    device time, while the host returns at once."""

    def __init__(self, call_ms: float):
        self.now = 0.0
        self.call_ms = call_ms
        self.calls = 0

    def run(self):
        self.calls += 1
        self.now += self.call_ms

    def event_class(self):
        clock = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                self.at = clock.now

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return end.at - self.at

        return Event


@pytest.mark.parametrize("call_ms,warmup,expected", [
    (800.0, 3, 3),    # a slow backward: 3 repeats, not 20
    (250.0, 2, 8),    # 2 s / 250 ms
    (0.5, 3, 20),     # fast: all repeats
    (800.0, 0, 20),   # nothing to judge from without warmup; the host-clock guard remains
])
def test_cuda_budget_counts_device_time(monkeypatch, call_ms, warmup, expected):
    clock = _FakeDeviceClock(call_ms)
    monkeypatch.setattr(torch.cuda, "Event", clock.event_class())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(timing, "_flush_buffer", lambda device: torch.zeros(4))
    monkeypatch.setattr(timing, "_peak_mib", lambda fn, device: 0.0)

    result = timing.measure(clock.run, Timing(warmup=warmup, repeats=20, budget_s=2.0),
                            torch.device("cuda"))
    assert len(result.samples_ms) == expected
    assert clock.calls == warmup + expected
    assert result.samples_ms == (call_ms,) * expected
