"""Reading a case's mask in either format (a bool tensor or ``kernels.KeyIntervals``): the rows
a check reads, the dense mask for backends that take only dense masks, and the kept-pair count
behind active TFLOP/s. Intervals are read in O(rows · Lk) and counted in O(Lk)."""

from __future__ import annotations

import torch

from .case import Case
from .masks import causal_rows, row_chunk


def is_intervals(mask) -> bool:
    from kernels import KeyIntervals

    return isinstance(mask, KeyIntervals)


def mask_rows(mask, rows: torch.Tensor) -> torch.Tensor:
    """bool (Bm, Hm, R or 1, Lk): the mask at query ``rows`` (a mask without a query axis
    keeps its size-1 axis). Causality is not applied."""
    if is_intervals(mask):
        r = rows[:, None]
        return (mask.start[..., None, :] <= r) & (r < mask.end[..., None, :])
    return mask if mask.shape[2] == 1 else mask.index_select(2, rows)


def visible_rows(case: Case, mask, rows: torch.Tensor) -> torch.Tensor:
    """bool (Bm or 1, Hm or 1, R, Lk): which keys each of ``rows`` sees, mask and causality."""
    visible = causal_rows(rows, case)
    return visible[None, None] if mask is None else mask_rows(mask, rows) & visible


def dense_mask(case: Case, mask) -> torch.Tensor | None:
    """The mask as a bool tensor: itself, or intervals expanded to (Bm, Hm, Lq, Lk) in row
    chunks (never more than one chunk of temporaries)."""
    if mask is None or not is_intervals(mask):
        return mask
    bm, hm, lk = mask.shape
    dense = torch.empty(bm, hm, case.seqlen_q, lk, dtype=torch.bool, device=mask.device)
    step = row_chunk(case, hm)
    for r0 in range(0, case.seqlen_q, step):
        rows = torch.arange(r0, min(case.seqlen_q, r0 + step), device=mask.device)
        dense[:, :, r0:r0 + len(rows)] = mask_rows(mask, rows)
    return dense


def kept_pairs(case: Case, mask) -> int:
    """Kept (batch, query head, i, j) entries after the mask and causality."""
    from .flops import visible_pairs

    if mask is None:
        return case.batch * case.heads_q * visible_pairs(case)
    heads = mask.shape[1]
    if is_intervals(mask):
        lo = mask.start.to(torch.int64).clamp(min=0)
        if case.causal:
            first_row = torch.arange(case.seqlen_k, device=mask.device) - (case.seqlen_k - case.seqlen_q)
            lo = torch.maximum(lo, first_row)
        hi = mask.end.to(torch.int64).clamp(max=case.seqlen_q)
        per_key = (hi - lo).clamp(min=0).expand(case.batch, heads, case.seqlen_k)
        return int(per_key.sum()) * (case.heads_q // heads)
    view = mask.expand(case.batch, heads, case.seqlen_q, case.seqlen_k)
    total = 0
    step = row_chunk(case, heads)
    for r0 in range(0, case.seqlen_q, step):
        rows = torch.arange(r0, min(case.seqlen_q, r0 + step), device=mask.device)
        total += int((view[:, :, r0:r0 + len(rows)] & causal_rows(rows, case)).sum())
    return total * (case.heads_q // heads)
