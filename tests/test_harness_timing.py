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


class _FakeGraph:
    """Stands in for a captured CUDAGraph: each replay takes the clock's ``call_ms``."""

    def __init__(self, clock: _FakeDeviceClock, log: list):
        self.clock, self.log = clock, log

    def replay(self):
        self.log.append("replay")
        self.clock.run()


@pytest.mark.parametrize("warmup,eager_calls", [(3, 3), (0, 1)])
def test_cuda_graph_timing_replays_the_capture_and_plans_from_a_replay(monkeypatch, warmup,
                                                                       eager_calls):
    """Eager warmup calls (at least one), one capture, an untimed replay that uploads the graph,
    a timed replay that plans the repeats, then each repeat a replay after the flush; the peak
    memory comes from an eager call."""
    clock, log = _FakeDeviceClock(250.0), []
    events = clock.event_class()

    class LoggedEvent(events):
        def record(self):
            log.append("event")
            super().record()

    class Flush:
        def zero_(self):
            log.append("flush")

    def eager():  # 1 s a call on the device: a plan made from it would allow 3 repeats
        log.append("eager")
        clock.now += 1000.0

    captured = []

    def capture(fn, device):
        captured.append(fn)
        log.append("capture")
        return _FakeGraph(clock, log)

    def peak(fn, device):
        assert fn is eager
        return 12.5

    monkeypatch.setattr(torch.cuda, "Event", LoggedEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(timing, "_flush_buffer", lambda device: Flush())
    monkeypatch.setattr(timing, "_peak_mib", peak)
    monkeypatch.setattr(timing, "capture", capture)

    result = timing.measure(eager, Timing(warmup=warmup, repeats=20, budget_s=2.0,
                                          cuda_graph=True), torch.device("cuda"))
    assert captured == [eager]
    assert result.samples_ms == (250.0,) * 8  # 2 s / 250 ms, planned from the timed replay
    assert result.peak_mib == 12.5
    assert log[:eager_calls + 2] == ["eager"] * eager_calls + ["capture", "replay"]
    assert log[eager_calls + 2:eager_calls + 5] == ["event", "replay", "event"]  # the plan
    assert log[eager_calls + 5:] == ["flush", "event", "replay", "event"] * 8


def test_eager_timing_never_captures(monkeypatch):
    clock = _FakeDeviceClock(1.0)
    monkeypatch.setattr(torch.cuda, "Event", clock.event_class())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(timing, "_flush_buffer", lambda device: torch.zeros(4))
    monkeypatch.setattr(timing, "_peak_mib", lambda fn, device: 0.0)
    monkeypatch.setattr(timing, "capture", lambda fn, device: pytest.fail("captured"))
    timing.measure(clock.run, Timing(warmup=1, repeats=3), torch.device("cuda"))
    assert clock.calls == 1 + 3


class _FakeCapture:
    """Stands in for ``torch.cuda.graph``: the body runs, and where it raised, ending the
    capture raises too, as cudaStreamEndCapture does for a capture the body invalidated."""

    def __init__(self, graph, pool=None, stream=None):
        self.pool = pool

    def __enter__(self):
        return None

    def __exit__(self, kind, value, traceback):
        if value is not None:
            raise RuntimeError("CUDA error: operation failed due to a previous error during "
                               "capture\nmore lines")
        return False


@pytest.mark.parametrize("left_registered", [True, False],
                         ids=["torch-left-the-capture-registered", "torch-ended-it"])
@pytest.mark.parametrize("error,oom", [
    (RuntimeError("CUDA error: operation not permitted when stream is capturing\nhint"), False),
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB\nmore"), True),
])
def test_a_failed_capture_names_the_calls_error_and_puts_the_allocator_back(
        monkeypatch, left_registered, error, oom):
    """The message is the call's own first error line; the allocator's registration of the
    capture is ended where torch left it (torch 2.11 does), and then the pool released; the
    device is synchronized and the cache emptied, and last the random generators are taken out
    of capture mode (by a clean capture, which the GPU tests run for real)."""
    calls = []
    pool = (0, 7)

    def end(device, mempool):
        calls.append(("end", device, mempool))
        if not left_registered:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: pool)
    monkeypatch.setattr(torch.cuda, "graph", _FakeCapture)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "side")
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool",
                        lambda device, mempool: calls.append(("release", device, mempool)),
                        raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(timing, "_end_generator_capture",
                        lambda device: calls.append(("generators", device)))

    def call():
        raise error

    with pytest.raises(timing.CaptureError) as info:
        timing.capture(call, torch.device("cuda", 0))
    message = str(info.value)
    assert message == f"cuda graph capture: {type(error).__name__}: {str(error).splitlines()[0]}"
    assert info.value.oom is oom
    released = [("release", 0, pool)] if left_registered else []
    assert calls == [("end", 0, pool), *released, "sync", "empty",
                     ("generators", torch.device("cuda", 0))]


def test_a_capture_that_ends_cleanly_returns_its_graph(monkeypatch):
    graph = object()
    ran = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 1))
    monkeypatch.setattr(torch.cuda, "graph", _FakeCapture)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "side")
    assert timing.capture(lambda: ran.append(1), torch.device("cuda", 0)) is graph
    assert ran == [1]


def test_timed_build_is_the_median_of_warm_builds(monkeypatch):
    """One warm-up build, then BUILD_REPEATS on the clock: the median, not the first; a build
    slower than the budget is timed once."""
    delays = iter([0.0, 0.030, 0.001, 0.002, 0.001, 0.002])
    calls = []

    def build():
        calls.append(1)
        time.sleep(next(delays))
        return len(calls)

    result, step = timing.timed_build(build, torch.device("cpu"), "steps")
    assert len(calls) == 1 + timing.BUILD_REPEATS and result == len(calls)
    assert step.name == "steps" and 1.0 < step.ms < 10.0  # the 30 ms outlier is not the median
    monkeypatch.setattr(timing, "BUILD_BUDGET_S", 0.0)
    calls.clear()
    _, step = timing.timed_build(lambda: calls.append(1), torch.device("cpu"), "once")
    assert len(calls) == 2 and step.ms >= 0.0
