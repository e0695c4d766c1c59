"""``topk_intervals``: the top-W selection of ``masks.topk`` as callers reach it, with its
argument checks, the eager dense selection replayed as a CUDA graph on a GPU, and the
``torch.library`` custom ops that compiled calls take.

Under ``torch.compile`` the selection runs as the custom ops ``dmattn::topk_intervals`` and
``dmattn::topk_intervals_packed``, opaque to the compiler: it has no gradient to trace, and
Inductor in torch 2.11 failed to lower its slice writes (``NotImplementedError: SliceView``)
when a Doge model was compiled at a context above its keep window. Eager calls run the same
function directly.

Importing ``kernels`` registers both ops in torch's process-wide operator registry, beside
``ops``' ``dmattn::fwd`` and ``dmattn::bwd``: an op must exist before ``torch.compile`` traces a
call to it. ``masks.topk``, the selection itself, imports nothing of this module.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
from torch import Tensor

from .masks.intervals import KeyIntervals
from .masks.topk import (_check_packed, _few_rows, _few_rows_form, _one_window, _one_window_form,
                         _packed, _rows_direct, kept_union, orders_keys)
from .planning.tuning import GATHER_MAX_ROWS


def topk_intervals(bias, window, seqlen_q=None, is_causal=True, cu_seqlens_q=None,
                   cu_seqlens_k=None, *, order_keys=None) -> KeyIntervals:
    """The key intervals whose mask equals flash-dmattn's dynamic top-``window`` mask.

    Args:
        bias: a per-key bias (B, H, 1, Lk), or packed (H, total_k) with ``cu_seqlens_k``.
            Floating point; only its order is read (no gradient flows through the choice).
        window: W >= 1. At row i the W visible keys with the largest bias are kept, all of
            them when at most W are visible. Equal biases rank the smaller key index first;
            NaN ranks as -inf.
        seqlen_q: Lq, the number of query rows (default Lk). Not used with cu_seqlens.
        is_causal: bottom-right causality, row i sees key j iff j <= i + Lk - Lq.
        cu_seqlens_q, cu_seqlens_k: int32 (n + 1,) offsets of packed sequences (the query
            offsets default to the key offsets); each sequence is masked on its own.
        order_keys: give the intervals a key order (``KeyIntervals.with_key_order``), so
            that ``dmattn_func`` reads the keys grouped by the rows that keep them and its
            work follows the W * Lq kept pairs instead of Lq * Lk. None (the default) decides
            by shape (``masks.topk.orders_keys``: at least 256 query rows, Lk at least 4 W
            causal, 2 W otherwise, and an estimated saving above the order's host cost,
            ``saved_tiles``). Packed input never gets one.

    Returns:
        int32 ``KeyIntervals`` of shape (B, H, Lk), or (1, H, total_k) for packed input in
        each sequence's own row coordinates (row 0 is the sequence's first query). Built on
        the bias's device in O(L log L) work, by Triton kernels on a GPU and by torch ops
        on the CPU; nothing of size Lq * Lk is made.
    """
    window = _check_window(window)
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor, got {type(bias).__name__}")
    if not bias.dtype.is_floating_point:
        raise TypeError(f"bias must be a floating-point tensor, got {bias.dtype}")
    if bias.numel() == 0 and cu_seqlens_k is None:
        raise ValueError(f"bias must not be empty, got shape {tuple(bias.shape)}")
    bias = bias.detach()
    if cu_seqlens_k is None:
        if cu_seqlens_q is not None:
            raise ValueError("cu_seqlens_q needs cu_seqlens_k (the packed keys' offsets)")
        seqlen_q = _check_dense(bias, seqlen_q)
        if order_keys is None:
            order_keys = orders_keys(seqlen_q, bias.shape[-1], window, is_causal,
                                     rows=bias.shape[0] * bias.shape[1])
        elif not isinstance(order_keys, bool):  # torch 2.11's Dynamo misreads __class__ here
            raise TypeError(f"order_keys must be a bool or None, got "
                            f"{type(order_keys).__name__} {order_keys!r}")
        if torch.compiler.is_compiling():
            intervals = KeyIntervals(*torch.ops.dmattn.topk_intervals(bias, window, seqlen_q,
                                                                      bool(is_causal)),
                                     max_kept=kept_union(window, seqlen_q, bias.shape[-1],
                                                         bool(is_causal)),
                                     _row_kept=min(window, bias.shape[-1]))
            return intervals.with_key_order() if order_keys else intervals
        return _dense(bias, window, seqlen_q, bool(is_causal), order_keys)
    if order_keys:
        raise ValueError("order_keys must be None or False with cu_seqlens: packed sequences "
                         "keep their keys in place")
    if seqlen_q is not None:
        raise ValueError("seqlen_q must be None with cu_seqlens (each sequence's query length "
                         "comes from cu_seqlens_q)")
    if torch.compiler.is_compiling():
        _check_packed(bias)
        return KeyIntervals(*torch.ops.dmattn.topk_intervals_packed(
            bias, window, bool(is_causal), cu_seqlens_q, cu_seqlens_k))
    return _packed(bias, window, bool(is_causal), cu_seqlens_q, cu_seqlens_k)


def _check_window(window) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    return window


def _check_dense(bias, seqlen_q) -> int:
    """The query length of a dense call, after checking the bias's shape and ``seqlen_q``."""
    if bias.dim() != 4 or bias.shape[2] != 1:
        raise ValueError(f"bias must be per key, (B, H, 1, Lk), got shape {tuple(bias.shape)}")
    if seqlen_q is None:
        return bias.shape[-1]
    if isinstance(seqlen_q, bool) or not isinstance(seqlen_q, int) or seqlen_q < 1:
        raise ValueError(f"seqlen_q must be a positive int or None, got {seqlen_q!r}")
    return seqlen_q


def _dense(bias, window, seqlen_q, is_causal, ordered=False) -> KeyIntervals:
    b, h, _, lk = bias.shape
    flat = bias.reshape(b * h, lk)
    lists = None
    if _one_window_form(is_causal, seqlen_q, ordered):  # never a graph (see below)
        # At decode sizes the selection lists the kept keys for the gather route too.
        start, end, lists = _one_window(flat, window, seqlen_q,
                                        with_lists=seqlen_q <= GATHER_MAX_ROWS)
        rows = (start, end)
    elif _lists_few_rows(flat, window, seqlen_q, is_causal, ordered):
        start, end, lists = _few_rows(flat, window, seqlen_q, with_lists=True)
        rows = (start, end)
    else:
        rows = _select_rows(flat, window, seqlen_q, is_causal, ordered)
    return KeyIntervals(*(t.reshape(b, h, lk) for t in rows),
                        max_kept=kept_union(window, seqlen_q, lk, is_causal),
                        _row_kept=min(window, lk), _kept_lists=lists)


def _lists_few_rows(rows, window, seqlen_q, is_causal, ordered) -> bool:
    """Whether a causal selection of a few query rows (``masks.topk._few_rows``) runs directly
    and lists the kept keys for the gather route too: at decode sizes, on a form that is not
    captured as a CUDA graph (``_graph_sized``)."""
    return (seqlen_q <= GATHER_MAX_ROWS and _few_rows_form(rows, window, seqlen_q, is_causal,
                                                           ordered)
            and not _graph_sized(rows))


# -- host time on a GPU: the selection as a CUDA graph
# With the torch ops one selection is ~440 small ops at Lk = 8192 (~15 per bit of the
# position, plus the sort); with the kernels (``masks.wavelet``) a causal one is still the
# sort's launches and bits + 3 more. On a GPU each costs host time to launch, more than its device
# time at short lengths, and a Doge model makes one per layer. The first call of a form (rows,
# length, dtype, device, window, query length, causality, key order) captures it as a CUDA
# graph (with the key order's sort: ~0.35 ms of host time at 16k outside it), and
# every call replays it: a copy in, the replay, a copy out of each output. A graph keeps its
# intermediates (with the torch ops a few tens of 8-byte buffers of the bias's size; with the
# kernels the sort's and about six of 4 or 8 bytes), so only forms up to GRAPH_MAX_ELEMENTS
# bias elements are captured (Doge at 32k, 4 KV heads: 2**17), where the launches dominate,
# and at most MAX_GRAPHS are kept, the least recently used dropped first. A form whose capture
# fails runs the ops directly from then on. The one-window form (``masks.topk._one_window``:
# one query row, or no causality) is never captured: its three to five launches (by dtype) cost
# less than a replay's copy in and copies out. A graph is made on a thread of its own
# (``_made_apart``).
GRAPH_MAX_ELEMENTS = 1 << 20
MAX_GRAPHS = 4
_graphs: OrderedDict = OrderedDict()  # form -> _SelectionGraph, or None: not capturable


class _SelectionGraph:
    def __init__(self, bias: torch.Tensor, window: int, seqlen_q: int, is_causal: bool,
                 ordered: bool):
        self.bias = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device)
        self.bias.copy_(bias)
        side = torch.cuda.Stream(bias.device)  # warm-up off the capturing stream, as required
        side.wait_stream(torch.cuda.current_stream(bias.device))
        with torch.cuda.stream(side):
            _rows_direct(self.bias, window, seqlen_q, is_causal, ordered)
        torch.cuda.current_stream(bias.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: work other threads do meanwhile (autograd, data loading) is not ours
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.outputs = _rows_direct(self.bias, window, seqlen_q, is_causal, ordered)

    def __call__(self, bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.bias.copy_(bias)
        self.graph.replay()
        return tuple(t.clone() for t in self.outputs)


def _made_apart(bias, window, seqlen_q, is_causal, ordered) -> _SelectionGraph:
    """A ``_SelectionGraph`` made on a thread of its own, on the caller's stream.

    The graph's buffers outlive the call. Inductor's CUDA graph trees
    (``torch.compile(mode="reduce-overhead")``) route every allocation of the calling thread
    to their pool while they warm a step up, then fail the step if a tensor there is not one
    of its outputs; allocations of another thread are not routed."""
    stream = torch.cuda.current_stream(bias.device)
    made = {}

    def make():
        try:
            with torch.cuda.device(bias.device), torch.cuda.stream(stream):
                made["graph"] = _SelectionGraph(bias, window, seqlen_q, is_causal, ordered)
        except BaseException as error:  # raised again by the caller
            made["error"] = error

    worker = threading.Thread(target=make, name="topk_intervals graph")
    worker.start()
    worker.join()
    if "error" in made:
        raise made["error"]
    return made["graph"]


def _graph_sized(rows) -> bool:
    """Whether a selection of these bias rows is small enough to capture: on a GPU, at most
    ``GRAPH_MAX_ELEMENTS``."""
    return rows.device.type == "cuda" and rows.numel() <= GRAPH_MAX_ELEMENTS


def _select_rows(bias, window, seqlen_q, is_causal, ordered=False) -> tuple[torch.Tensor, ...]:
    if (not _graph_sized(bias) or _one_window_form(is_causal, seqlen_q, ordered)
            or torch.cuda.is_current_stream_capturing()):
        return _rows_direct(bias, window, seqlen_q, is_causal, ordered)
    form = (tuple(bias.shape), window, seqlen_q, is_causal, ordered, bias.dtype, bias.device)
    if form in _graphs:
        _graphs.move_to_end(form)
        graph = _graphs[form]
    else:
        try:
            graph = _made_apart(bias, window, seqlen_q, is_causal, ordered)
        except RuntimeError:  # not capturable here: the ops, directly, for this form
            graph = None
        _graphs[form] = graph
        while len(_graphs) > MAX_GRAPHS:
            _graphs.popitem(last=False)
    if graph is None:
        return _rows_direct(bias, window, seqlen_q, is_causal, ordered)
    return graph(bias)


# -- the custom ops that compiled calls take (see the module docstring)

@torch.library.custom_op("dmattn::topk_intervals", mutates_args=())
def _topk_intervals_op(bias: Tensor, window: int, seqlen_q: int,
                       is_causal: bool) -> tuple[Tensor, Tensor]:
    chosen = _dense(bias, window, seqlen_q, is_causal)
    # Contiguous, as the fake says: Inductor checks the real outputs' strides against it.
    return chosen.start.contiguous(), chosen.end.contiguous()


@_topk_intervals_op.register_fake
def _topk_intervals_fake(bias, window, seqlen_q, is_causal):
    b, h, _, lk = bias.shape
    return (bias.new_empty((b, h, lk), dtype=torch.int32),
            bias.new_empty((b, h, lk), dtype=torch.int32))


@torch.library.custom_op("dmattn::topk_intervals_packed", mutates_args=())
def _topk_intervals_packed_op(bias: Tensor, window: int, is_causal: bool,
                              cu_seqlens_q: Tensor | None,
                              cu_seqlens_k: Tensor) -> tuple[Tensor, Tensor]:
    chosen = _packed(bias, window, is_causal, cu_seqlens_q, cu_seqlens_k)
    return chosen.start.contiguous(), chosen.end.contiguous()


@_topk_intervals_packed_op.register_fake
def _topk_intervals_packed_fake(bias, window, is_causal, cu_seqlens_q, cu_seqlens_k):
    heads, total_k = bias.shape
    return (bias.new_empty((1, heads, total_k), dtype=torch.int32),
            bias.new_empty((1, heads, total_k), dtype=torch.int32))
