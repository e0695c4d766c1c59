"""The eager reference: the ground truth for the tests and for ``dmbench equiv``.

Same signature and semantics as :func:`kernels.dmattn_func`. It materializes the full score
matrix, so it is for checking, never for speed. With ``upcast=True`` it computes in float64 and
returns float64 tensors (the ground truth is not rounded back). With ``upcast=False`` it computes
in the inputs' dtype, which is the "eager low-precision run" of the accuracy rule.
"""

from __future__ import annotations

import torch

from .masks.intervals import KeyIntervals
from .planning.inputs import check_inputs


def _per_query_head(view: torch.Tensor, head_div: int, heads_q: int) -> torch.Tensor:
    """(B, Hm, Lq, Lk) view -> (B, Hq, Lq, Lk), query head h reading head h // head_div."""
    index = torch.arange(heads_q, device=view.device) // head_div
    return view.index_select(1, index)


def causal_keep(seqlen_q: int, seqlen_k: int, device) -> torch.Tensor:
    """Bottom-right aligned causal pattern: row i sees key j iff j <= i + (Lk - Lq)."""
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


def _dense_intervals(query, key, value, intervals: KeyIntervals, attn_bias, softmax_scale):
    """The bool mask (Bm, Hm, Lq, Lk) of ``intervals``, after checking them against the call
    as the kernels do (``check_inputs``)."""
    shape = check_inputs(query, key, value, intervals, attn_bias, softmax_scale).shape
    return intervals.to_dense(shape.seqlen_q)


def attention_reference(
    query,
    key,
    value,
    attn_mask=None,
    attn_bias=None,
    is_causal=False,
    softmax_scale=None,
    return_lse=False,
    upcast=True,
):
    """Eager dynamic-mask attention in (batch, seqlen, heads, head_dim) layout.

    ``attn_mask`` is a bool mask or a :class:`KeyIntervals` (expanded here to its dense mask).
    Returns ``out`` (B, Lq, Hq, D) and, with ``return_lse``, the natural-log LSE (B, Hq, Lq) in
    float32 (float64 when upcast). Rows that see no key give output 0 and LSE -inf, and their
    gradients are 0. Differentiable with respect to query, key, value and attn_bias.
    """
    if isinstance(attn_mask, KeyIntervals):
        attn_mask = _dense_intervals(query, key, value, attn_mask, attn_bias, softmax_scale)
    checked = check_inputs(query, key, value, attn_mask, attn_bias, softmax_scale)
    shape = checked.shape
    compute = torch.float64 if upcast else query.dtype
    q = query.to(compute).transpose(1, 2)  # (B, Hq, Lq, D)
    group = shape.group_size
    k = key.to(compute).transpose(1, 2).repeat_interleave(group, dim=1)
    v = value.to(compute).transpose(1, 2).repeat_interleave(group, dim=1)

    scores = torch.matmul(q, k.transpose(-1, -2)) * checked.softmax_scale
    if checked.bias is not None:
        # Bias is added after scaling. attn_bias itself stays in the graph so it gets a gradient.
        bias = attn_bias.to(compute).expand_as(checked.bias.view)
        scores = scores + _per_query_head(bias, checked.bias.head_div, shape.heads_q)
    keep = torch.ones(shape.seqlen_q, shape.seqlen_k, dtype=torch.bool, device=query.device)
    if is_causal:
        keep = causal_keep(shape.seqlen_q, shape.seqlen_k, query.device)
    keep = keep.expand(shape.batch, shape.heads_q, shape.seqlen_q, shape.seqlen_k)
    if checked.mask is not None:
        keep = keep & _per_query_head(checked.mask.view, checked.mask.head_div, shape.heads_q)

    scores = scores.masked_fill(~keep, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    # -inf guard: an empty row would give (-inf) - (-inf) = NaN; shifting by 0 keeps exp() at 0.
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True)
    probs = probs / torch.where(denom > 0, denom, torch.ones_like(denom))
    out = torch.matmul(probs.to(v.dtype), v).transpose(1, 2)
    if not return_lse:
        return out
    lse_dtype = torch.float64 if upcast else torch.float32
    lse = torch.logsumexp(scores.detach().to(lse_dtype), dim=-1)
    return out, lse


def attention_varlen_reference(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    attn_mask=None,
    attn_bias=None,
    is_causal=False,
    softmax_scale=None,
    return_lse=False,
    upcast=True,
):
    """Packed (varlen) attention as one :func:`attention_reference` call per sequence.

    Same layout and semantics as ``kernels.dmattn_varlen_func``: query (total_q, Hq, D), key
    and value (total_k, Hk, D), attn_mask ``KeyIntervals`` (1, Hm, total_k) in each sequence's
    own rows, attn_bias (Hb, total_k). A sequence with no keys gives output 0 and LSE -inf. Reads
    the offsets on the host.
    """
    compute = torch.float64 if upcast else query.dtype
    lse_dtype = torch.float64 if upcast else torch.float32
    heads_q, head_dim = query.shape[1], query.shape[2]
    outs, lses = [], []
    bounds = zip(cu_seqlens_q.tolist(), cu_seqlens_q.tolist()[1:],
                 cu_seqlens_k.tolist(), cu_seqlens_k.tolist()[1:])
    for q0, q1, k0, k1 in bounds:
        if q1 == q0:
            continue
        if k1 == k0:
            outs.append(query.new_zeros(q1 - q0, heads_q, head_dim, dtype=compute))
            lses.append(query.new_full((heads_q, q1 - q0), float("-inf"), dtype=lse_dtype))
            continue
        mask = None
        if attn_mask is not None:
            mask = KeyIntervals(attn_mask.start[..., k0:k1], attn_mask.end[..., k0:k1])
        bias = None if attn_bias is None else attn_bias[None, :, None, k0:k1]
        out, lse = attention_reference(
            query[None, q0:q1], key[None, k0:k1], value[None, k0:k1], attn_mask=mask,
            attn_bias=bias, is_causal=is_causal, softmax_scale=softmax_scale, return_lse=True,
            upcast=upcast)
        outs.append(out[0])
        lses.append(lse[0])
    out = torch.cat(outs) if outs else query.new_zeros(0, heads_q, head_dim, dtype=compute)
    if not return_lse:
        return out
    lse = torch.cat(lses, dim=1) if lses else query.new_zeros(heads_q, 0, dtype=lse_dtype)
    return out, lse
