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
and V a head per query head). Every step is a differentiable torch op, so autograd carries the
gradients back: a gather's gradient is a scatter of each key to one place (exact, any order of
execution), a widening's is a sum over the heads it copied to.

The reordered intervals depend only on the intervals, the order, causality and the lengths,
not on K, V or the heads they are widened to, so ``reordered_intervals`` keeps them on the
ordered object per call form: a later call with the same object (a model's layers share one
mask) gets the same reordered object, whose preparation (``prepared.prepared_intervals``)
then serves it as a plain object's serves its own calls.
"""

from __future__ import annotations

import torch

from .intervals import INT32_MAX


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
