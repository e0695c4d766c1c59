"""Timing one zero-argument call: warmup, repeats or a time budget, quantiles, peak memory.

On CUDA each call is bracketed by events, and the L2 cache is flushed before it by writing a
buffer larger than L2; the flush sits outside the events. All events are read after a single
synchronize so the host never stalls the GPU between repeats. On CPU ``perf_counter`` is used;
those numbers describe the interpreter, not a kernel.

The time budget caps how many repeats run, never below ``MIN_REPEATS``. On CUDA the host
enqueues calls far faster than a slow kernel finishes them, so a host clock alone would let
every repeat through (20 calls of an 0.8 s backward took 16 s per row, not the 2 s budget);
the plan is made from the GPU time of the last warmup call instead.

With ``Timing.cuda_graph`` the call is captured once into a ``torch.cuda.CUDAGraph`` and each
timed repeat is one replay of it, bracketed by events as above, the flush outside them: the
host's time per call (Python, autograd, launches) drops out, for every backend alike. The
warmup calls (at least one, so that kernels are compiled and plans made before the capture)
run eagerly, then the capture, then one untimed replay (the first launch of a graph uploads
it), then one timed replay that plans the repeats. The peak memory is the eager call's, as
in eager timing; the graph's private memory pool is not counted. All of it runs on the
stream ``point_stream`` makes current, a side stream, as torch requires of a capture: the
runner builds the point's call inside it too, because autograd runs a backward on the stream
its forward ran on. A call that cannot be captured (it reads a result back to the host, or
an op refuses capture) raises ``CaptureError``, after ``capture`` has put the caching
allocator back in order.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

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


def _gpu_ms(fn: Callable[[], object]) -> float:
    """One call of ``fn`` on the clock of the current stream: its GPU milliseconds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _warm_up_cuda(fn: Callable[[], object], warmup: int) -> float | None:
    """Run the warmup calls; the GPU milliseconds of the last one, or None without warmup."""
    for _ in range(warmup - 1):
        fn()
    if warmup < 1:
        return None
    return _gpu_ms(fn)


def measure(fn: Callable[[], object], timing: Timing, device: torch.device) -> Measurement:
    if device.type == "cuda":
        if timing.cuda_graph:
            return _measure_graph(fn, timing, device)
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
    samples = _timed_repeats(fn, repeats, timing, device)
    return Measurement(samples, _peak_mib(fn, device))


def _measure_graph(fn: Callable[[], object], timing: Timing,
                   device: torch.device) -> Measurement:
    """The module docstring's graph mode; call inside ``point_stream``."""
    for _ in range(max(timing.warmup, 1)):
        fn()
    graph = capture(fn, device)
    graph.replay()  # the first launch uploads the graph
    repeats = planned_repeats(_gpu_ms(graph.replay), timing)
    samples = _timed_repeats(graph.replay, repeats, timing, device)
    del graph
    return Measurement(samples, _peak_mib(fn, device))


def _timed_repeats(fn: Callable[[], object], repeats: int, timing: Timing,
                   device: torch.device) -> tuple[float, ...]:
    """Up to ``repeats`` calls of ``fn``, each bracketed by events with the L2 flush before
    them, stopped by the budget once ``MIN_REPEATS`` ran: their GPU milliseconds."""
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
    del flush
    return tuple(s.elapsed_time(e) for s, e in events)


class CaptureError(Exception):
    """A point's call could not be captured into a CUDA graph. The message is one line that
    starts with ``cuda graph capture:``; ``oom`` says whether the capture ran out of memory."""

    def __init__(self, message: str, oom: bool = False):
        super().__init__(message)
        self.oom = oom


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for the whole run: the caching allocator keeps a freed
    block for the stream it was allocated on, so a stream per point would strand the cache of
    every point before it."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


@contextmanager
def point_stream(device: torch.device, timing: Timing) -> Iterator[None]:
    """Where a point's call is built and timed: with ``timing.cuda_graph`` on a CUDA device, a
    side stream (a capture cannot run on the default stream) that waits for the work queued
    before it, and that the current stream waits for after it; otherwise nothing changes."""
    if device.type != "cuda" or not timing.cuda_graph:
        yield
        return
    side, current = _side_stream(device), torch.cuda.current_stream(device)
    side.wait_stream(current)
    try:
        with torch.cuda.stream(side):
            yield
    finally:
        current.wait_stream(side)


def capture(fn: Callable[[], object], device: torch.device) -> torch.cuda.CUDAGraph:
    """``fn``'s work captured into a CUDA graph on the current stream (a side stream), into a
    private memory pool of its own. A failure raises ``CaptureError`` naming the first error
    (the call's own, not the end of capture that it invalidated), after ``_recover``."""
    graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    first = None  # the call's own error, as text: no reference to its frames and tensors
    try:
        with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.current_stream(device)):
            try:
                fn()
            except Exception as exc:
                first = _capture_failure(exc)
                raise
    except Exception as exc:
        first = first or _capture_failure(exc)
    if first is None:
        return graph
    del graph
    _recover(device, pool)
    raise CaptureError(f"cuda graph capture: {first[0]}"[:300], oom=first[1])


def _capture_failure(exc: BaseException) -> tuple[str, bool]:
    """(the exception's type and first line, whether it is an out-of-memory error)."""
    lines = str(exc).strip().splitlines()
    oom = isinstance(exc, torch.cuda.OutOfMemoryError)
    return f"{type(exc).__name__}: {lines[0] if lines else ''}", oom


def _recover(device: torch.device, pool: tuple[int, int]) -> None:
    """Put the caching allocator back in order after a failed capture, then free what the
    capture held. torch without pytorch#180395 (2.11 among them) leaves a capture whose end
    failed registered in the allocator, and every later ``empty_cache`` (the next capture's
    start calls one) then fails an internal assert; without pytorch#190348, which came later,
    it never releases the failed capture's pool either. Ending the registration raises where
    torch ended it itself; the pool is released here only where it did not."""
    gc.collect()  # the failed graph and what the call's frames held
    index = device.index if device.index is not None else torch.cuda.current_device()
    end = (getattr(torch._C, "_cuda_endAllocateToPool", None)  # its name since torch 2.8
           or getattr(torch._C, "_cuda_endAllocateCurrentStreamToPool", None))
    release = getattr(torch._C, "_cuda_releasePool", None)
    if end is not None and release is not None:
        try:
            end(index, pool)
        except RuntimeError:
            pass  # not registered: torch ended it when the capture ended
        else:
            release(index, pool)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    _end_generator_capture(device)


def _end_generator_capture(device: torch.device) -> None:
    """The CUDA random generators stay in capture mode after a capture whose end failed: the
    next random op outside a capture then fails ("Offset increment outside graph capture",
    torch 2.11 on the H200: a ``bwd`` point's upstream gradient after its failed capture). A
    capture that ends cleanly takes them out of it; this one records one tiny fill."""
    scrap = torch.empty(1, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.current_stream(device)):
        scrap.zero_()
    del graph, scrap
    torch.cuda.synchronize(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class BuildStep(NamedTuple):
    """One timed step of a mask's build: what it made, and its wall time in ms."""

    name: str
    ms: float


# Timed builds per mask after the warm-up build, and the wall time after which no further one
# starts: one build of a few hundred microseconds is host time that a busy host stretches
# twofold (topk_intervals at 16k on the H100 host read 1.27 ms once, 0.53 ms as a median of
# 50), while the slowest builds (create_block_mask at 128k, 0.55 s) get fewer samples.
BUILD_REPEATS = 5
BUILD_BUDGET_S = 2.0


def timed_build(build: Callable[[], object], device: torch.device,
                name: str) -> tuple[object, BuildStep]:
    """Run ``build`` once to compile and warm up, then on the clock (synchronized) up to
    ``BUILD_REPEATS`` times within ``BUILD_BUDGET_S``: the last result and a ``BuildStep`` of
    the median wall time, which the CSV reports in ``build_ms``."""
    build()
    synchronize(device)
    times, spent = [], 0.0
    while len(times) < BUILD_REPEATS and (not times or spent < BUILD_BUDGET_S):
        start = time.perf_counter()
        result = build()
        synchronize(device)
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return result, BuildStep(name, statistics.median(times) * 1e3)


def build_total(steps: list[BuildStep]) -> tuple[float | None, str]:
    """(the steps' total ms or None without steps, a line naming each: "build: topk_intervals
    1.2 ms + create_block_mask 3.4 ms")."""
    if not steps:
        return None, ""
    parts = " + ".join(f"{s.name} {s.ms:.3g} ms" for s in steps)
    return sum(s.ms for s in steps), f"build: {parts}"
