"""Reading a KeyIntervals mask's keys in an order that groups keys seen by similar rows.

Softmax attention is a sum over keys, so it does not change when the keys (with their values,
bias and mask) are permuted. Tile skipping does: a key block is skipped for a tile of query
rows only when none of its keys is visible there. Flash-dmattn's top-W mask keeps, at row i,
the W keys with the largest bias among the visible ones, so its kept keys scatter over all of
0..i and, in the keys' own order, nearly every tile holds a kept pair: the work grows with
Lq * Lk, not with the W * Lq kept pairs.

``grouping_order`` sorts the keys by (bucket of their end, start), keys never seen last: a key
block then holds keys whose runs of rows start and end near each other, and tile skipping
leaves close to the kept pairs. The buckets widen with the end. A key block's work is about
(its latest end - its earliest start) rows. Under a top-W mask over L keys, about L * W / E**2
keys per row end near row E, with starts spread over [0, E): a bucket of fixed width is too
narrow at late ends (few keys, so a block spans a wide range of starts) and too wide at early
ones. Balancing the two gives buckets of about sqrt(64 E**3 / (L W)) rows, which is a bucket
index of floor(sqrt(L W / E) / 8), W estimated per (batch, head) as the kept pairs over the
query rows (the latest end). Counted on the CPU (``IntervalBlockBounds.tiles``) for the
top-2048 mask of a normal random bias, causal, tiles of 128 rows by 64 keys:

    L        key order   end // 1024   widening buckets   the kept pairs / 8192
    16384      16512         5077           4803               3840
    65536     247924        24141          20761              16128
    131072    818016        48753          41175              32512

On an H100 (B1 H16/4 D128 bf16, one process) the widening buckets took the forward from
2.00 / 5.82 / 11.4 ms to 1.43 / 4.63 / 9.76 ms at 16k / 64k / 128k, and fwd+bwd from 6.69 /
28.5 / 58.5 to 6.39 / 26.2 / 54.3 ms.

``reorder_keys`` applies an order to one call: it folds causality into the intervals (a
permuted key no longer sits at its position), gathers K, V, the bias and the intervals along
the key axis, and widens each to the heads the order needs (an order per query head gives K
and V a head per query head). Eager calls on CUDA tensors copy K and V's rows in one launch
(``masks.key_copies``), whose gradient reads each key's rows back through the
inverse order and sums the heads it was widened to; traced calls, and the bias and intervals
always, use ``torch.gather``, whose gradient autograd makes (a scatter of each key to one
place, then the widening's sum), except a bias read with no widening in an eager call: its
gradient is a gather through the inverse order (``_BiasInOrder``). An eager call with
gradients makes the row copies and the bias's gather, and their gradients' way back, inside
the attention's own autograd node instead (``KeyOrderReads``): the two nodes this saves (K
and V's, the bias's) cost the H200 host 60-110 us each a direction, against a fwd+bwd of
0.49 ms of kernels (top-W, B1 H16/4 L4096 D80). There a bias of one row per (batch, head of
the copies) rides in the row copies both ways, and needs no gather; an eager call without
gradients reads its keys the same way, with no node. On the H200
``torch.gather`` of K and V (an int64 index read per element) ran at 0.8-1.0 TB/s (B2 H16/4
L8192 D128 bf16: ~70 us of a 0.61 ms top-W call).

The reordered intervals depend only on the intervals, the order, causality and the lengths,
not on K, V or the heads they are widened to, so ``reordered_intervals`` keeps them on the
ordered object per call form: a later call with the same object (a model's layers share one
mask) gets the same reordered object, whose preparation (``prepared.prepared_intervals``)
then serves it as a plain object's serves its own calls.
"""

from __future__ import annotations

import torch

from ..runtime.launch import is_interpreted
from ..runtime.scratch import graph_capturing, tensor_version
from ..triton_device.key_order_kernels import _keys_in_order_kernel
from .intervals import KeyIntervals
from .key_copies import KeysInOrder, copy_back, copy_in_order


# Call forms whose reordered intervals one ordered KeyIntervals keeps (a model calls with one
# or two).
MAX_REORDERED = 4


def _heads_of_order(order: torch.Tensor, heads: int) -> torch.Tensor:
    """``order`` (Bm, Hm, Lk) with Hm widened to ``heads`` (Hm is 1 or divides it)."""
    hm = order.shape[1]
    if hm == heads:
        return order
    return order.repeat_interleave(heads // hm, dim=1)


def _kv_index(order: torch.Tensor, batch: int, own: int, head_dim: int) -> torch.Tensor:
    """The gather index of K or V (B, Lk, ``own`` heads, D) read in ``order`` (Bm, H, Lk), H a
    multiple of ``own``: a stride-0 view of the order, (B, Lk, own, D) where H is ``own``,
    else (B, Lk, own, H // own, D) for K or V widened to H heads (``_gather_kv``)."""
    bm, heads, seqlen_k = order.shape
    index = order.view(bm, own, heads // own, seqlen_k).permute(0, 3, 1, 2).unsqueeze(-1)
    if heads == own:
        return index.squeeze(3).expand(batch, seqlen_k, own, head_dim)
    return index.expand(batch, seqlen_k, own, heads // own, head_dim)


def _bias_index(order: torch.Tensor, batch: int, own: int, rows: int) -> torch.Tensor:
    """The gather index of a bias (batch, ``own`` heads, ``rows``, Lk) read in ``order``
    (Bm, H, Lk), H a multiple of ``own``: (batch, own, rows, Lk) where H is ``own``, else
    (batch, own, H // own, rows, Lk) for the bias widened to H heads (``_gather_bias``)."""
    bm, heads, seqlen_k = order.shape
    index = order.view(bm, own, heads // own, 1, seqlen_k)
    if heads == own:
        return index.squeeze(2).expand(batch, own, rows, seqlen_k)
    return index.expand(batch, own, heads // own, rows, seqlen_k)


def _gather_kv(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """K or V (B, Lk, Hk, D) with its keys read by ``index`` (``_kv_index``): (B, Lk, H, D).
    A widening to H heads is a stride-0 view of K or V, so one gather makes the result; its
    gradient sums over the copies."""
    if index.dim() == 4:
        return torch.gather(t, 1, index)
    batch, seqlen_k, own, share, head_dim = index.shape
    out = torch.gather(t.unsqueeze(3).expand(index.shape), 1, index)
    return out.reshape(batch, seqlen_k, own * share, head_dim)


def _inverse_order(order: torch.Tensor) -> torch.Tensor:
    """int32 ``inverse`` of the permutations ``order`` (Bm, Hm, Lk): inverse[..., order[..., j]]
    = j, contiguous."""
    positions = torch.arange(order.shape[-1], dtype=torch.int32, device=order.device)
    return torch.empty(order.shape, dtype=torch.int32, device=order.device).scatter_(
        -1, order, positions.expand(order.shape))


def _keys_in_order(key, value, intervals: KeyIntervals, heads: int):
    """(K, V) read in ``intervals.key_order`` and widened to ``heads``, as ``_gather_kv`` of
    ``_gather_index`` gives them, by ``KeysInOrder``. The order is made contiguous and its
    inverse (for the gradient) kept on ``intervals`` per version, as the gather indices."""
    order = intervals.key_order
    if order.stride(-1) != 1:
        order = order.contiguous()
    if not (torch.is_grad_enabled() and (key.requires_grad or value.requires_grad)):
        return copy_in_order(key, value, order, heads)[:2]  # no graph: no autograd.Function
    return KeysInOrder.apply(key, value, order, _kept_inverse(intervals), heads)


def _kept_inverse(intervals: KeyIntervals) -> torch.Tensor:
    """``_inverse_order`` of ``intervals.key_order``, kept on ``intervals`` per version."""
    order = intervals.key_order
    return _kept_per_form(intervals, intervals._gather_indices,
                          ("inverse", tensor_version(order)), MAX_GATHER_INDICES,
                          lambda: _inverse_order(order))


class _BiasInOrder(torch.autograd.Function):
    """A bias (batch, H, Lqb, Lk) with its keys read by ``index`` (``_bias_index``, no
    widening: a permutation per row); its gradient reads the output's back by ``inverse``
    (the inverse order's index): one gather, where ``torch.gather``'s gradient zeroes the
    bias's shape and scatter-adds into it (two launches, ~50 us of the H200 host's time)."""

    @staticmethod
    def forward(ctx, bias, index, inverse):
        ctx.save_for_backward(inverse)
        return torch.gather(bias, 3, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return torch.gather(grad, 3, inverse), None, None


def _gather_bias(bias: torch.Tensor, index: torch.Tensor,
                 inverse: torch.Tensor | None = None) -> torch.Tensor:
    """A bias (Bb, Hb, Lqb, Lk), Bb 1 or the index's batch, with its keys read by ``index``
    (``_bias_index``): (batch, H, Lqb, Lk), widened like ``_gather_kv``. ``inverse``: the
    inverse order's index, for ``_BiasInOrder``'s gradient (no widening only)."""
    if index.dim() == 4:
        widened = bias.expand(index.shape[0], -1, -1, -1)
        if inverse is not None:
            return _BiasInOrder.apply(widened, index, inverse)
        return torch.gather(widened, 3, index)
    batch, own, share, rows, seqlen_k = index.shape
    out = torch.gather(bias.unsqueeze(2).expand(index.shape), 4, index)
    return out.reshape(batch, own * share, rows, seqlen_k)


# Gather indices one ordered KeyIntervals keeps, per form (a model's calls need K and V's and
# perhaps the bias's). On an H100 host an ordered call spent 85 us of its ~180 us of host time
# in the view ops and gathers of K and V: the views are made once per form.
MAX_GATHER_INDICES = 8


def _gather_index(intervals: KeyIntervals, kind: str, order_heads: int, batch: int, own: int,
                  last: int) -> torch.Tensor:
    """``_kv_index`` (``kind`` "kv", ``last`` the head dim) or ``_bias_index`` ("bias", ``last``
    the bias's rows) of ``intervals.key_order`` (of its inverse: "bias-inverse") widened to
    ``order_heads`` heads, kept on ``intervals`` per form and the order's version counter, at
    most ``MAX_GATHER_INDICES``.
    Made afresh, and not kept, while ``torch.compile`` traces or a CUDA graph captures (as
    ``reordered_intervals``)."""
    order = intervals.key_order

    def make():
        read = _kept_inverse(intervals).long() if kind == "bias-inverse" else order
        widened = _heads_of_order(read, order_heads)
        if kind == "kv":
            return _kv_index(widened, batch, own, last)
        return _bias_index(widened, batch, own, last)

    form = (kind, tensor_version(order), order_heads, batch, own, last)
    return _kept_per_form(intervals, intervals._gather_indices, form, MAX_GATHER_INDICES, make)


def _kept_per_form(intervals: KeyIntervals, kept: dict, form, bound: int, make):
    """``make()``, kept in ``kept`` (a store on ``intervals``) under ``form``, at most
    ``bound`` forms, the oldest dropped first; made afresh, and not kept, while
    ``torch.compile`` traces or a CUDA graph captures."""
    if torch.compiler.is_compiling() or graph_capturing(intervals.device):
        return make()
    found = kept.get(form)
    if found is None:
        found = kept[form] = make()
        while len(kept) > bound:
            kept.pop(next(iter(kept)), None)  # the oldest
    return found


def _reorder(intervals: KeyIntervals, seqlen_q: int, is_causal: bool) -> KeyIntervals:
    """``intervals`` with causality folded into start and their keys in their order."""
    order = intervals.key_order
    start, end = intervals.start, intervals.end
    if is_causal:  # bottom-right: key j is first visible at row j + Lq - Lk
        seqlen_k = start.shape[-1]
        first_row = torch.arange(seqlen_k, device=start.device) + (seqlen_q - seqlen_k)
        start = torch.maximum(start.long(), first_row)
    # the order has the intervals' own shape
    return KeyIntervals(torch.gather(start, -1, order), torch.gather(end, -1, order),
                        _row_kept=intervals._row_kept)


def reordered_intervals(intervals: KeyIntervals, seqlen_q: int,
                        is_causal: bool) -> KeyIntervals:
    """The intervals, with no order, that a call with ``seqlen_q`` query rows and
    ``is_causal`` runs for ordered ``intervals``. Kept on ``intervals`` per form (causality,
    the query length where causal, the version counters of start, end and the order: a write
    into one makes a new form, as for ``prepared.prepared_intervals``), at most
    ``MAX_REORDERED`` forms, the oldest dropped first. Made afresh, and not kept, while
    ``torch.compile`` traces (the trace must hold the gathers, not a constant) and during a
    CUDA graph capture (the graph must gather what start and end hold at each replay)."""
    is_causal = bool(is_causal)
    form = (is_causal, seqlen_q if is_causal else None, tensor_version(intervals.start),
            tensor_version(intervals.end), tensor_version(intervals.key_order))
    return _kept_per_form(intervals, intervals._reordered, form, MAX_REORDERED,
                          lambda: _reorder(intervals, seqlen_q, is_causal))


# Row copies of CPU tensors under Triton's interpreter: off, as its cost is per program and
# operation (a fwd+bwd of Lk 300 to 1024, 2 KV heads: 0.35-1.4 s, against 12-17 ms for the
# gathers); the copies' own tests turn it on.
INTERPRETED_COPIES = False


def _copies_rows(key: torch.Tensor, value: torch.Tensor) -> bool:
    """K and V are read in key order by ``KeysInOrder``'s row copies on CUDA tensors (on CPU
    ones under Triton's interpreter where ``INTERPRETED_COPIES``); not while
    ``torch.compile`` traces (the graph holds ``torch.gather``s, which Inductor compiles),
    nor for empty tensors or a head dim with a stride other than 1."""
    return ((key.is_cuda or (INTERPRETED_COPIES and is_interpreted(_keys_in_order_kernel)))
            and not torch.compiler.is_compiling() and key.numel() > 0 and value.numel() > 0
            and key.stride(3) == 1 and value.stride(3) == 1)


def _bias_rows(attn_bias):
    """``attn_bias`` with each broadcast (stride-0) axis of batch, heads and rows narrowed to
    one slice, so that a gather reads it once, not as a copy per slice."""
    for axis in (0, 1, 2):
        if attn_bias.shape[axis] > 1 and attn_bias.stride(axis) == 0:
            attn_bias = attn_bias.narrow(axis, 0, 1)
    return attn_bias


def _bias_form(attn_bias, intervals: KeyIntervals):
    """The ``_gather_index`` form (heads, batch, own heads, rows) of ``attn_bias`` read in
    ``intervals.key_order``."""
    bm, hm, _ = intervals.shape
    own, rows = attn_bias.shape[1], attn_bias.shape[2]
    return max(own, hm), max(attn_bias.shape[0], bm), own, rows


class KeyOrderReads:
    """One eager call's reads of ordered intervals' keys, made inside the attention's own
    autograd node (``interface._KeyOrderedFunction``) with their gradients' way back, where
    ``reorder_keys`` would add a node for K and V and one for the bias: each node costs the
    H200 host 60-110 us a direction. K and V are copied in order by rows and widened to
    ``heads``; their gradients are copied back through the inverse order, summing the widened
    heads (``_keys_in_order_grad_kernel``). A bias of one row per (batch, head of the copies)
    rides in the same launches (``fold_bias``): each torch op on the H200 host costs 20-50 us,
    and the bias's gather and its gradient's were two of them. Another bias is gathered in
    order, and its gradient gathered back through the inverse order, summed over a batch it
    was widened to. An eager call without gradients makes the same reads with no node
    (``read`` alone). ``key_order_reads`` says which calls this serves."""

    __slots__ = ("reordered", "order", "inverse", "heads", "fold_bias", "bias_index",
                 "bias_inverse")

    def __init__(self, reordered, order, inverse, heads, fold_bias, bias_index, bias_inverse):
        self.reordered = reordered  # the call's intervals, in key order, causality folded in
        self.order = order  # contiguous on keys
        self.inverse = inverse  # None: no gradient goes back to K or V
        self.heads = heads  # K and V's heads in order
        self.fold_bias = fold_bias  # the bias rides in the row copies, both ways
        self.bias_index = bias_index  # None: the bias (if any) is not gathered
        self.bias_inverse = bias_inverse  # None: no bias gradient is gathered back

    def read(self, key, value, attn_bias):
        """(K, V, bias) in key order, as ``reorder_keys`` makes them (no graph)."""
        if self.fold_bias:
            return copy_in_order(key, value, self.order, self.heads, _bias_rows(attn_bias))
        key, value, _ = copy_in_order(key, value, self.order, self.heads)
        if self.bias_index is not None:
            attn_bias = _gather_bias(_bias_rows(attn_bias), self.bias_index)
        return key, value, attn_bias

    def back(self, grad_key, grad_value, grad_bias, key_shape, value_shape, bias_shape):
        """(dK, dV, dbias) from the gradients of the reads in order; dK and dV None where K
        and V need none, dbias None where ``grad_bias`` is."""
        dk = dv = None
        if self.inverse is not None:
            folded = grad_bias if self.fold_bias else None
            dk, dv, dbias = copy_back(grad_key, grad_value, folded, key_shape, value_shape,
                                       bias_shape, self.inverse, self.heads)
            if folded is not None:
                return dk, dv, dbias
        if grad_bias is not None and self.bias_index is not None:
            grad_bias = torch.gather(grad_bias, 3, self.bias_inverse)
            if grad_bias.shape[0] != bias_shape[0]:
                grad_bias = grad_bias.sum(0, keepdim=True)
        return dk, dv, grad_bias


# Reads one ordered KeyIntervals keeps, per call form (a model's layers call with one or two:
# with and without gradients). One lookup stands for the five kept objects a call's reads are
# made of (the reordered intervals, the inverse order, the bias's gather indices) and their
# version counters.
MAX_READS = 8
_NO_READS = object()  # kept for a form whose calls keep ``reorder_keys``'s graph


def key_order_reads(query, key, value, intervals: KeyIntervals, attn_bias, is_causal: bool,
                    grads: bool = True) -> KeyOrderReads | None:
    """The ``KeyOrderReads`` of an eager call whose K and V ``reorder_keys`` copies by rows
    (``_copies_rows``); None where its bias needs what ``reorder_keys``'s graph does: a
    gradient through a widening to the order's heads, or to a broadcast (stride-0) axis.
    ``grads`` False: the call records no graph, whatever its inputs' ``requires_grad``.
    Kept on ``intervals`` per call form (the query rows, causality, which gradients, K's
    batch and heads, the bias's layout, and the version counters of start, end and the
    order), at most ``MAX_READS``; made afresh, and not kept, during a CUDA graph capture."""
    if not _copies_rows(key, value):
        return None
    kv_grad = grads and (key.requires_grad or value.requires_grad)
    bias_layout = None
    if attn_bias is not None:
        bias_layout = (attn_bias.shape, attn_bias.stride(), grads and attn_bias.requires_grad)
    form = (query.shape[1], bool(is_causal), kv_grad, key.shape[0], key.shape[2], bias_layout,
            tensor_version(intervals.start), tensor_version(intervals.end),
            tensor_version(intervals.key_order))
    reads = _kept_per_form(intervals, intervals._reads, form, MAX_READS,
                           lambda: _make_reads(query, key, intervals, attn_bias, is_causal,
                                               grads, kv_grad))
    return None if reads is _NO_READS else reads


def _make_reads(query, key, intervals: KeyIntervals, attn_bias, is_causal: bool, grads: bool,
                kv_grad: bool):
    """``key_order_reads``' object for a new call form, ``_NO_READS`` where it has none."""
    heads = max(key.shape[2], intervals.shape[1])
    fold_bias = False
    bias_index = bias_inverse = None
    if attn_bias is not None and attn_bias.shape[-1] != 1:
        needs_grad = grads and attn_bias.requires_grad
        rows = _bias_rows(attn_bias)
        form = _bias_form(rows, intervals)
        if needs_grad and (rows is not attn_bias or form[0] != rows.shape[1]):
            return _NO_READS
        fold_bias = (rows.shape[:3] == (key.shape[0], heads, 1) and (kv_grad or not needs_grad))
        if not fold_bias:
            bias_index = _gather_index(intervals, "bias", *form)
            if needs_grad:
                bias_inverse = _gather_index(intervals, "bias-inverse", *form)
    order = intervals.key_order
    if order.stride(-1) != 1:
        order = order.contiguous()
    return KeyOrderReads(reordered_intervals(intervals, query.shape[1], is_causal), order,
                         _kept_inverse(intervals) if kv_grad else None, heads, fold_bias,
                         bias_index, bias_inverse)


def reorder_keys(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 intervals: KeyIntervals, attn_bias, is_causal: bool):
    """(key, value, intervals, attn_bias) of ``intervals.key_order`` for one call, whose
    attention equals the call's with ``is_causal`` False (causality is folded into the
    intervals). The returned intervals carry no order (``reordered_intervals``)."""
    batch, heads_kv = key.shape[0], key.shape[2]
    reordered = reordered_intervals(intervals, query.shape[1], is_causal)
    kv_heads = max(heads_kv, intervals.shape[1])
    if _copies_rows(key, value):
        key, value = _keys_in_order(key, value, intervals, kv_heads)
    else:
        index = _gather_index(intervals, "kv", kv_heads, batch, heads_kv, key.shape[3])
        if value.shape[3] != key.shape[3]:  # else V is read by K's index
            value_index = _gather_index(intervals, "kv", kv_heads, batch, heads_kv,
                                        value.shape[3])
        else:
            value_index = index
        key, value = _gather_kv(key, index), _gather_kv(value, value_index)
    if attn_bias is not None and attn_bias.shape[-1] != 1:
        attn_bias = _bias_rows(attn_bias)
        form = _bias_form(attn_bias, intervals)
        inverse = None
        if (form[0] == attn_bias.shape[1] and attn_bias.requires_grad
                and torch.is_grad_enabled()
                and not torch.compiler.is_compiling()):  # no widening: a gather back
            inverse = _gather_index(intervals, "bias-inverse", *form)
        attn_bias = _gather_bias(attn_bias, _gather_index(intervals, "bias", *form), inverse)
    return key, value, reordered, attn_bias
