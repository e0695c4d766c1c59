"""Scratch buffers that live within one call: split-K partials and their arrival counters, the
backward's delta, and an LSE that nobody asked for.

A plan keeps its scratch per CUDA stream and hands the same buffers to its next call on that
stream. Stream order makes that safe: every kernel that reads the buffers in one call is
enqueued before any kernel of the next call writes them. On the H100 benchmark host each
``torch.empty`` costs ~9-10 us of host time (cProfile, torch 2.11), so the four allocations of
a split-K decode forward were ~40 of its ~105 us per call.

Buffers are allocated per call instead when keeping them is not clearly safe or cheap:
off CUDA (the interpreter), while a CUDA graph is being captured (the graph owns its
allocations), within the custom ops that ``torch.compile`` calls (``allocated_per_call``), and
above ``MAX_KEPT_BYTES``, where the call's GPU work dwarfs one allocation.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager

import torch

# Per plan and stream. Scratch is O(B·H·Lq) or O(B·Hk·Lk) at most (never O(Lq·Lk)): a decode
# split-K forward keeps ~0.3 MiB, a B1 H16 L32768 no-grad forward's LSE 2 MiB, dkdv's head-share
# partials at most ~17 MiB (grids under two waves, B1 H16/4 L1024: 16 MiB, whose backward takes
# ~100 us on the GPU). The gather route's kept-key lists of a bool mask read per call hold an
# int32 per key and list row, 1/64 of a D128 bf16 K/V cache: 33 MiB at B8 Hk8 Lk131072, for a
# decode step of ~60 us, so they are kept too.
MAX_KEPT_BYTES = 64 * 2**20

# The stream's raw handle without building a torch.cuda.Stream object (Triton's launcher reads
# it the same way); the public call is the fallback.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def graph_capturing(device: torch.device) -> bool:
    """A CUDA graph is being captured on the current stream: allocations belong to the graph,
    and reading device memory back to the host is forbidden."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_calls = threading.local()


@contextmanager
def allocated_per_call():
    """Within this, every ``Scratch`` allocates its buffers per call and keeps none.

    The custom ops run in it. Under ``torch.compile(mode="reduce-overhead")`` Inductor's CUDA
    graph trees run an op's first calls eagerly with every allocation routed to the graph's
    memory pool, then require each live tensor in that pool to be one of the graph's outputs: a
    kept buffer is not, and the step failed ("tensor(s) in the cudagraph pool not tracked as
    outputs"). Nothing tells a call that its allocations go to such a pool, so compiled calls
    keep nothing; the replays that follow allocate nothing either way."""
    depth = getattr(_calls, "per_call", 0)
    _calls.per_call = depth + 1
    try:
        yield
    finally:
        _calls.per_call = depth


def _current_stream(index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


WRITTEN_FIRST = False  # a spec's third element: an integer buffer its kernels write before reading


class Scratch:
    """Buffers of fixed shapes and dtypes on one device, for one plan's calls. A spec is
    (shape, dtype) or (shape, dtype, zeroed): integer buffers start at zero unless ``zeroed``
    is ``WRITTEN_FIRST``; float buffers are never zeroed."""

    def __init__(self, device: torch.device, *specs: tuple):
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.specs = tuple((spec[0], spec[1],
                            spec[2] if len(spec) > 2 else not spec[1].is_floating_point)
                           for spec in specs)
        nbytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype, _ in self.specs)
        self.keep = device.type == "cuda" and nbytes <= MAX_KEPT_BYTES
        self._by_stream: dict[int, tuple[torch.Tensor, ...]] = {}

    def _allocate(self) -> tuple[torch.Tensor, ...]:
        # Zeroed integer buffers are split programs' arrival counters (``_partials``): they
        # must start at zero, and the kernels leave them at zero for the next call.
        return tuple((torch.zeros if zeroed else torch.empty)(shape, dtype=dtype,
                                                              device=self.device)
                     for shape, dtype, zeroed in self.specs)

    def keeps(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` is one this scratch keeps for a stream's later calls."""
        return any(buffer is kept for buffers in self._by_stream.values() for kept in buffers)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The buffers for a call enqueued now, on the current stream."""
        if not self.specs:
            return ()
        if not self.keep or graph_capturing(self.device) or getattr(_calls, "per_call", 0):
            return self._allocate()
        key = _current_stream(self.device.index)
        kept = self._by_stream.get(key)
        if kept is None:
            kept = self._by_stream[key] = self._allocate()
        return kept


def tensor_version(t: torch.Tensor) -> int | None:
    if not isinstance(t, torch.Tensor):  # KeyIntervals: immutable by contract
        return None
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors keep no version counter
        return None
