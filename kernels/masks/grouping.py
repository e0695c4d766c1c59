"""The key order of ``KeyIntervals.with_key_order``: keys sorted by (bucket of their end, start).

Why an order pays, and what the buckets are, is in ``key_order``, which reads the keys of a call
in this order.
"""

from __future__ import annotations

import torch

from ..runtime.arith import INT32_MAX


# A key's end bucket is floor(END_BUCKET_SCALE * sqrt(Lk * W / end)) (see above); 1/8 makes
# buckets of sqrt(64 E**3 / (L W)) rows.
END_BUCKET_SCALE = 0.125


def end_buckets(start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """Each key's end bucket, int64 of start's shape: -floor(sqrt(Lk * W / end) / 8), with W
    the kept pairs of its (batch, head) over its latest end. Negated, so that the buckets sort
    in the order of their ends."""
    return _end_buckets(*_rows_clamped(start, end))


def _rows_clamped(start: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 (start, end) clamped to the rows a call can have, [0, INT32_MAX]."""
    return start.long().clamp(0, INT32_MAX), end.long().clamp(0, INT32_MAX)


def _end_buckets(start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """``end_buckets`` of intervals already clamped by ``_rows_clamped``."""
    lengths = (end - start).clamp(min=0).double()
    rows = end.amax(-1, keepdim=True).clamp(min=1).double()
    window = lengths.sum(-1, keepdim=True) / rows
    spread = torch.sqrt(start.shape[-1] * window / end.clamp(min=1).double())
    return -torch.floor(spread * END_BUCKET_SCALE).long()


def grouping_order(start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """A permutation of the keys per (batch, head), int64 of start's shape (Bm, Hm, Lk):
    keys sorted by (``end_buckets``, start), keys with an empty interval last."""
    start, end = _rows_clamped(start, end)
    bucket = _end_buckets(start, end)
    empty = start >= end
    sort_key = torch.where(empty, torch.full_like(start, 1 << 62), bucket * (1 << 32) + start)
    return torch.argsort(sort_key, dim=-1, stable=True)
