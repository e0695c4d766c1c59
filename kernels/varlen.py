"""Variable-length attention in flash-attn's packed layout, as one call of ``dmattn_func``.

Sequences are packed end to end: query (total_q, Hq, D), key and value (total_k, Hk, D), and
int32 offsets ``cu_seqlens_q`` / ``cu_seqlens_k`` of n + 1 ascending entries starting at 0
(sequence s holds rows [cu_q[s], cu_q[s + 1]) and keys [cu_k[s], cu_k[s + 1])).

The whole packed batch is one (1, total_q, Hq, D) by (1, total_k, Hk, D) problem whose mask is
a :class:`KeyIntervals` in packed row coordinates: key j of sequence s, its jl-th key, is seen by
packed rows ``[cu_q[s] + lo, cu_q[s + 1])`` with ``lo = 0``, or ``max(0, jl - (Lk_s - Lq_s))``
with (bottom-right, per sequence) causality, intersected with the caller's intervals shifted by
``cu_q[s]``. So no query sees another sequence's keys, and the intervals cost O(total_k).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

from .interface import dmattn_func
from .masks.intervals import KeyIntervals
from .runtime.arith import INT32_MAX
from .masks.packed_seqlens import PackedKeys, check_cu_seqlens
from .runtime.scratch import graph_capturing


def _check_packed_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{name} must be 3-D (total, heads, head_dim), got shape "
                         f"{tuple(t.shape)}")


def _check_max_seqlen(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _check_bias(attn_bias, heads_q: int, heads_kv: int, total_k: int) -> None:
    if attn_bias is None:
        return
    if not isinstance(attn_bias, torch.Tensor):
        raise TypeError(f"attn_bias must be a torch.Tensor or None, got "
                        f"{type(attn_bias).__name__}")
    heads = sorted({1, heads_kv, heads_q})
    if attn_bias.dim() != 2 or attn_bias.shape[0] not in heads or attn_bias.shape[1] != total_k:
        raise ValueError(f"attn_bias must be per key, (heads, total_k) with heads in {heads} "
                         f"and total_k = {total_k}, got shape {tuple(attn_bias.shape)}")


def packed_intervals(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_k: int,
                     is_causal: bool, attn_mask: KeyIntervals | None = None) -> KeyIntervals:
    """The mask of the packed problem, int32 (1, Hm or 1, total_k), in packed row coordinates.

    ``attn_mask``: the caller's intervals (1, Hm, total_k) in each sequence's own row
    coordinates, or None. The offsets must already be checked (:func:`check_cu_seqlens`).
    Built with O(Hm * total_k) torch ops on the offsets' device.
    """
    keys = PackedKeys.build(cu_seqlens_q, cu_seqlens_k, total_k)
    lo = torch.zeros_like(keys.local)
    if is_causal:
        lo = (keys.local - (keys.seqlen_k - keys.seqlen_q)).clamp(min=0)
    hi = keys.seqlen_q
    if attn_mask is not None:
        # Both bounds are brought into [0, Lq_s] first, so no shift can overflow.
        lo = torch.maximum(lo, torch.minimum(attn_mask.start.to(torch.int64), hi))
        hi = torch.minimum(hi, attn_mask.end.to(torch.int64).clamp(min=0))
    else:
        lo, hi = lo[None, None], hi[None, None]
    start = (keys.query_start + lo).to(torch.int32)
    end = (keys.query_start + hi).to(torch.int32)
    documents = None if attn_mask is not None else (cu_seqlens_q, cu_seqlens_k, is_causal)
    return KeyIntervals(start, end, _documents=documents)


def _check_offsets(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k,
                   device) -> None:
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, device,
                     _check_max_seqlen("max_seqlen_q", max_seqlen_q))
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, device,
                     _check_max_seqlen("max_seqlen_k", max_seqlen_k))
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences, got shapes {tuple(cu_seqlens_q.shape)} and "
                         f"{tuple(cu_seqlens_k.shape)}")


def causal_within(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int,
                  total_k: int) -> bool:
    """Whether every sequence's bottom-right causality implies the packed problem's own (row i
    sees key j only if j <= i + total_k - total_q), so that the packed call may pass
    ``is_causal=True`` and change nothing it computes. Row ``cu_q[s] + i`` of sequence s sees
    its key ``cu_k[s] + j`` only if j <= i + Lk_s - Lq_s, that is if the packed key lies at most
    ``cu_k[s + 1] - cu_q[s + 1]`` past the packed row; so it holds where that is at most
    total_k - total_q for every s. True without a read for one offsets tensor given as both
    (self-attention over packed documents); otherwise one read-back, or False while
    torch.compile traces or a CUDA graph captures. The offsets must already be checked."""
    if cu_seqlens_q is cu_seqlens_k:
        return True
    if torch.compiler.is_compiling() or graph_capturing(cu_seqlens_q.device):
        return False
    lead = cu_seqlens_k[1:].to(torch.int64) - cu_seqlens_q[1:].to(torch.int64)
    return bool((lead <= total_k - total_q).all())


# The packed masks of recent offsets, so that the layers of a model (one call each, with the
# same cu_seqlens) check the offsets and build the mask once: each later call skips that
# read-back and ~25 torch ops (H100, 16k packed tokens: 0.85 ms a call before, against
# 0.27 ms for the same mask given as intervals), and the mask's tile lists are kept with it
# (``prepared.prepared_intervals``). Keyed by the offsets tensors (identity and version
# counter, so writing into them makes a new entry) and everything else the mask follows from.
MAX_PACKED_MASKS = 8
_packed_masks: OrderedDict = OrderedDict()


def _cached_packed_intervals(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q,
                             max_seqlen_k, is_causal, device) -> tuple[KeyIntervals, bool]:
    """``packed_intervals`` of offsets checked here, and with ``is_causal`` whether the packed
    call may be causal (``causal_within``), from ``_packed_masks`` when these offsets tensors,
    unchanged, were seen with the same sizes. Not kept while torch.compile traces or a CUDA
    graph captures (nothing is read back then, and tensor identity means nothing)."""
    keep = isinstance(cu_seqlens_q, torch.Tensor) and isinstance(cu_seqlens_k, torch.Tensor) \
        and not torch.compiler.is_compiling() and not graph_capturing(device)
    signature = None
    if keep:
        signature = (id(cu_seqlens_q), cu_seqlens_q._version, id(cu_seqlens_k),
                     cu_seqlens_k._version, total_q, total_k, max_seqlen_q, max_seqlen_k,
                     is_causal, device)
        kept = _packed_masks.get(signature)
        if kept is not None and kept[0]() is cu_seqlens_q and kept[1]() is cu_seqlens_k:
            _packed_masks.move_to_end(signature)
            return kept[2], kept[3]
    _check_offsets(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k,
                   device)
    intervals = packed_intervals(cu_seqlens_q, cu_seqlens_k, total_k, is_causal)
    causal = is_causal and causal_within(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    if signature is not None:
        _packed_masks[signature] = (weakref.ref(cu_seqlens_q), weakref.ref(cu_seqlens_k),
                                    intervals, causal)
        while len(_packed_masks) > MAX_PACKED_MASKS:
            del _packed_masks[next(iter(_packed_masks))]
    return intervals, causal


def varlen_call(attention, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k, attn_mask=None, attn_bias=None, is_causal=False,
                softmax_scale=None, return_lse=False, **options):
    """Check the packed inputs and run ``attention`` (``dmattn_func`` or the eager reference,
    which take the same arguments) once over the whole packed batch; ``options`` go to it as
    they are. Returns out (total_q, Hq, D) and, with ``return_lse``, the LSE (Hq, total_q)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_packed_tensor(name, t)
    for name, t in (("key", key), ("value", value), ("cu_seqlens_q", cu_seqlens_q),
                    ("cu_seqlens_k", cu_seqlens_k)):
        if isinstance(t, torch.Tensor) and t.device != query.device:
            raise ValueError(f"{name} must be on query's device {query.device}, got {t.device}")
    total_q, heads_q, _ = query.shape
    total_k, heads_kv, _ = key.shape
    if total_q == 0 or total_k == 0:
        raise ValueError(f"query and key must each hold at least one packed row, got total_q = "
                         f"{total_q} and total_k = {total_k}")
    if max(total_q, total_k) > INT32_MAX:
        raise ValueError(f"query and key must hold fewer than 2**31 packed rows, got "
                         f"{total_q} and {total_k}")
    if attn_mask is not None:
        if not isinstance(attn_mask, KeyIntervals):
            raise TypeError(f"attn_mask must be KeyIntervals or None, got "
                            f"{type(attn_mask).__name__}")
        attn_mask.check_against(batch=1, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=total_q,
                                seqlen_k=total_k, device=query.device)
    _check_bias(attn_bias, heads_q, heads_kv, total_k)
    # The intervals hold each sequence's causality; the packed call is causal too where that
    # implies it (``causal_within``), which lets the kernels skip and order tiles by it.
    if attn_mask is None:
        intervals, causal = _cached_packed_intervals(
            cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k,
            bool(is_causal), query.device)
    else:
        _check_offsets(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q,
                       max_seqlen_k, query.device)
        intervals = packed_intervals(cu_seqlens_q, cu_seqlens_k, total_k, bool(is_causal),
                                     attn_mask)
        causal = bool(is_causal) and causal_within(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    result = attention(
        query[None], key[None], value[None], attn_mask=intervals,
        attn_bias=None if attn_bias is None else attn_bias[None, :, None, :],
        is_causal=causal, softmax_scale=softmax_scale, return_lse=return_lse, **options,
    )
    # squeeze, not [0]: the gradient of a select is a zero-filled copy of the whole packed
    # tensor, that of a squeeze a view.
    if not return_lse:
        return result.squeeze(0)
    out, lse = result
    return out.squeeze(0), lse.squeeze(0)


def dmattn_varlen_func(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k, attn_mask=None, attn_bias=None, is_causal=False,
                       softmax_scale=None, return_lse=False, deterministic=False,
                       kernel_options=None):
    """Flash dynamic-mask attention over sequences packed end to end (flash-attn's varlen).

    Args:
        query: (total_q, heads_q, head_dim); key, value: (total_k, heads_kv, head_dim).
        cu_seqlens_q, cu_seqlens_k: int32 (n + 1,) offsets, starting at 0, non-decreasing,
            ending at total_q / total_k (both at least 1); sequences of length 0 are allowed.
        max_seqlen_q, max_seqlen_k: upper bounds on the sequence lengths (checked).
        attn_mask: None, or ``KeyIntervals`` of shape (1, Hm, total_k), Hm in {1, heads_kv,
            heads_q}, in each sequence's own row coordinates (row 0 = its first query).
        attn_bias: None, or a per-key bias (Hb, total_k), Hb in {1, heads_kv, heads_q}, in the
            query's dtype; trainable (its gradient has its shape).
        is_causal: bottom-right per sequence: its row i sees its key j iff j <= i + Lk_s - Lq_s.
        softmax_scale, deterministic, kernel_options: as in ``dmattn_func``
            (on a Hopper GPU the forward and backward walk each sequence's own tiles, their
            tables kept with the packed mask from the second call with these offsets, made
            per call before and in compiled or captured calls; ``forward_documents`` and
            ``backward_documents`` True or False force that either way).
        return_lse: also return the float32 LSE of shape (heads_q, total_q).

    Each sequence attends only to its own keys; a row that sees no key gives output 0 and LSE
    -inf. Checking the offsets' values reads one bool tensor per offsets tensor back from the
    device (a synchronization).
    """
    return varlen_call(dmattn_func, query, key, value, cu_seqlens_q, cu_seqlens_k,
                       max_seqlen_q, max_seqlen_k, attn_mask=attn_mask, attn_bias=attn_bias,
                       is_causal=is_causal, softmax_scale=softmax_scale,
                       return_lse=return_lse, deterministic=deterministic,
                       kernel_options=kernel_options)
