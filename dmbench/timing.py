"""Timing one zero-argument call: warmup, repeats or a time budget, quantiles, peak memory.

On CUDA each call is bracketed by events, and the L2 cache is flushed before it by writing a
buffer larger than L2; the flush sits outside the events. All events are read after a single
synchronize so the host never stalls the GPU between repeats. On CPU ``perf_counter`` is used;
those numbers describe the interpreter, not a kernel.

The time budget caps how many repeats run, never below ``MIN_REPEATS``. On CUDA the host
enqueues calls far faster than a slow kernel finishes them, so a host clock alone would let
every repeat through (20 calls of an 0.8 s backward took 16 s per row, not the 2 s budget);
the plan is made from the GPU time of the last warmup call instead.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from .sweep import Timing

MIN_REPEATS = 3
# Used when the device does not report its L2 size; larger than any current GPU's L2.
FALLBACK_L2_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Measurement:
    samples_ms: tuple[float, ...]
    peak_mib: float | None

    def quantile(self, q: float) -> float:
        """Linear-interpolated quantile, the same definition as numpy's default."""
        data = sorted(self.samples_ms)
        pos = q * (len(data) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return data[lo] + (data[hi] - data[lo]) * (pos - lo)

    @property
    def p20(self) -> float:
        return self.quantile(0.2)

    @property
    def p50(self) -> float:
        return self.quantile(0.5)

    @property
    def p80(self) -> float:
        return self.quantile(0.8)


def pooled(rounds: list[Measurement]) -> Measurement:
    """One point's measurement from its rounds: every sample, and the highest peak."""
    peaks = [m.peak_mib for m in rounds if m.peak_mib is not None]
    return Measurement(tuple(s for m in rounds for s in m.samples_ms), max(peaks) if peaks else None)


def _flush_buffer(device: torch.device) -> torch.Tensor:
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 0) or FALLBACK_L2_BYTES
    return torch.empty(2 * l2 // 4, dtype=torch.int32, device=device)


def _peak_mib(fn: Callable[[], object], device: torch.device) -> float:
    """Memory the call allocates above what is live before it, at its peak."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def planned_repeats(call_ms: float | None, timing: Timing) -> int:
    """Repeats that fit the budget at ``call_ms`` each (unknown: all of them)."""
    if call_ms is None or call_ms <= 0:
        return timing.repeats
    fit = int(timing.budget_s * 1e3 // call_ms)
    return max(MIN_REPEATS, min(timing.repeats, fit))


def _warm_up_cuda(fn: Callable[[], object], warmup: int) -> float | None:
    """Run the warmup calls; the GPU milliseconds of the last one, or None without warmup."""
    for _ in range(warmup - 1):
        fn()
    if warmup < 1:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def measure(fn: Callable[[], object], timing: Timing, device: torch.device) -> Measurement:
    if device.type == "cuda":
        return _measure_cuda(fn, timing, device)
    return _measure_host(fn, timing)


def _measure_host(fn: Callable[[], object], timing: Timing) -> Measurement:
    for _ in range(timing.warmup):
        fn()
    samples = []
    start_all = time.perf_counter()
    while len(samples) < timing.repeats:
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
        if len(samples) >= MIN_REPEATS and time.perf_counter() - start_all > timing.budget_s:
            break
    return Measurement(tuple(samples), None)


def _measure_cuda(fn: Callable[[], object], timing: Timing, device: torch.device) -> Measurement:
    repeats = planned_repeats(_warm_up_cuda(fn, timing.warmup), timing)
    flush = _flush_buffer(device) if timing.flush_l2 else None
    events = []
    torch.cuda.synchronize(device)
    start_all = time.perf_counter()
    for i in range(repeats):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
        if i + 1 >= MIN_REPEATS and time.perf_counter() - start_all > timing.budget_s:
            break
    torch.cuda.synchronize(device)
    samples = tuple(s.elapsed_time(e) for s, e in events)
    del flush
    return Measurement(samples, _peak_mib(fn, device))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class BuildStep(NamedTuple):
    """One timed step of a mask's build: what it made, and its wall time in ms."""

    name: str
    ms: float


def timed_build(build: Callable[[], object], device: torch.device,
                name: str) -> tuple[object, BuildStep]:
    """Run ``build`` once to compile and warm up, then again on the clock (synchronized):
    the second result and its ``BuildStep``, which the CSV reports in ``build_ms``."""
    build()
    synchronize(device)
    start = time.perf_counter()
    result = build()
    synchronize(device)
    return result, BuildStep(name, (time.perf_counter() - start) * 1e3)


def build_total(steps: list[BuildStep]) -> tuple[float | None, str]:
    """(the steps' total ms or None without steps, a line naming each: "build: topk_intervals
    1.2 ms + create_block_mask 3.4 ms")."""
    if not steps:
        return None, ""
    parts = " + ".join(f"{s.name} {s.ms:.3g} ms" for s in steps)
    return sum(s.ms for s in steps), f"build: {parts}"
