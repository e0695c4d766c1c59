"""The calls a warm-up form makes (``warmup``, ``dmbench compile-cost``): the inputs of one
call of a form at a length (``form_inputs``) and the call itself (``form_call``, made
``form_calls`` times per length): ``dmattn_func`` with no mask, a bool mask, key intervals or a
top-W selection, or ``dmattn_varlen_func`` over packed documents."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .interface import dmattn_func
from .masks.intervals import KeyIntervals
from .topk_ops import topk_intervals
from .varlen import dmattn_varlen_func

MASK_FORMS = ("none", "bool", "intervals", "documents")
BIAS_FORMS = ("none", "kv_row", "full")


@dataclass(frozen=True)
class PackedDocuments:
    """A "documents" form's call: ``dmattn_varlen_func`` over these offsets (int32, each of
    ``batch`` rows of the length split into two documents of 2/3 and 1/3 of it)."""

    cu_seqlens: torch.Tensor
    max_seqlen: int


def form_calls(mask: str) -> int:
    """Calls per length of a form: a "documents" form makes two with the same offsets, as a
    model's first two layers do (the first builds the packed mask; from the second on it is
    prepared, which takes other kernels)."""
    return 2 if mask == "documents" else 1


def form_call(q, k, v, attn_mask, attn_bias, is_causal: bool):
    """One call of a form from ``form_inputs``' tensors: ``dmattn_varlen_func`` for packed
    documents, else ``dmattn_func``."""
    if isinstance(attn_mask, PackedDocuments):
        offsets, longest = attn_mask.cu_seqlens, attn_mask.max_seqlen
        return dmattn_varlen_func(q, k, v, offsets, offsets, longest, longest,
                                  attn_bias=attn_bias, is_causal=is_causal)
    return dmattn_func(q, k, v, attn_mask=attn_mask, attn_bias=attn_bias, is_causal=is_causal)


def form_inputs(batch, seqlen, heads_q, heads_kv, head_dim, dtype, device, mask, bias,
                backward, scattered, *, window=None, selection_heads=None, is_causal=False,
                query_rows=None):
    """(q, k, v, attn_mask, attn_bias) of one call of the form on random data: ``mask`` and
    ``bias`` as ``warmup`` takes them; a scattered mask keeps half the pairs (bool) or half the
    length per key (intervals), an unscattered one every pair. With a ``window`` (mask
    "intervals") the mask is ``topk_intervals`` of a random per-key bias of
    ``selection_heads`` heads (default ``heads_kv``) with this causality, whatever
    ``scattered`` says: ordered or not as a model's at this length. ``query_rows``: the
    call's query rows (default ``seqlen``; fewer: a decode step against a cache of
    ``seqlen`` keys)."""
    def tensor(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=backward)

    if mask == "documents":
        return _documents_inputs(tensor, batch, seqlen, heads_q, heads_kv, head_dim, device,
                                 bias)
    rows = seqlen if query_rows is None else query_rows
    q = tensor(batch, rows, heads_q, head_dim)
    k, v = tensor(batch, seqlen, heads_kv, head_dim), tensor(batch, seqlen, heads_kv, head_dim)
    attn_bias = None
    if bias == "kv_row":
        attn_bias = tensor(batch, heads_kv, 1, seqlen)
    elif bias == "full":
        attn_bias = tensor(batch, heads_kv, rows, seqlen)
    attn_mask = None
    # A mask with every pair visible and a scattered one: the schedule reads the share of
    # partial tiles (dkdv's pipeline stages), so each kind compiles its own kernels.
    if mask == "bool":
        shape = (batch, heads_kv, rows, seqlen)
        attn_mask = (torch.rand(shape, device=device) < 0.5 if scattered
                     else torch.ones(shape, dtype=torch.bool, device=device))
    elif mask == "intervals" and window is not None:
        heads = heads_kv if selection_heads is None else selection_heads
        selection = torch.randn(batch, heads, 1, seqlen, device=device, dtype=dtype)
        attn_mask = topk_intervals(selection, window, seqlen_q=rows, is_causal=is_causal)
    elif mask == "intervals":
        shape = (batch, heads_kv, seqlen)
        start = (torch.randint(0, rows, shape, dtype=torch.int32, device=device) if scattered
                 else torch.zeros(shape, dtype=torch.int32, device=device))
        attn_mask = KeyIntervals(start, start + (rows // 2 if scattered else rows))
    return q, k, v, attn_mask, attn_bias


def _documents_inputs(tensor, batch, seqlen, heads_q, heads_kv, head_dim, device, bias):
    """``form_inputs`` of a "documents" form: ``batch`` x ``seqlen`` tokens packed, each
    ``seqlen`` of them two documents (2/3 and 1/3 of it), with a per-key bias (Hk, tokens)
    for "kv_row"."""
    total = batch * seqlen
    first = seqlen - seqlen // 3
    ends = [row * seqlen + end for row in range(batch) for end in (first, seqlen)]
    offsets = torch.tensor([0] + sorted(set(ends)), dtype=torch.int32, device=device)
    q = tensor(total, heads_q, head_dim)
    k, v = tensor(total, heads_kv, head_dim), tensor(total, heads_kv, head_dim)
    attn_bias = tensor(heads_kv, total) if bias == "kv_row" else None
    return q, k, v, PackedDocuments(offsets, first), attn_bias
