"""Bool masks whose every key is kept by one run of query rows, found so that they can be read
as ``KeyIntervals``.

A key's kept rows form one run under many masks: causal, sliding windows, packed documents,
and flash-dmattn's top-W mask of a per-key bias with causality (once W keys with a larger
bias are visible to a row, they stay visible to every later row, so a key that leaves never
returns). Such a mask is exactly KeyIntervals (start, end) per key, O(Lk) where the mask is
O(Lq x Lk), and the intervals can carry a key order (``KeyIntervals.with_key_order``) that
makes the work of a top-W mask follow its kept pairs.

``key_runs`` reads the mask once, in chunks of query rows (no mask-sized temporary), with the
call's causality applied: the runs are those of the pairs the call keeps.
``order_that_pays`` gives the intervals a key order where it gathers blocks of keys whose rows
spread far beyond their kept pairs.
"""

from __future__ import annotations

import torch

from .grouping import grouping_order

# Query rows per chunk of the scan: a (Bm, Hm, ROWS, Lk) bool temporary at most.
ROWS = 1024
# Keys per block of ``block_spans``' count (the kernels' key tiles).
BLOCK_KEYS = 128


def key_runs(mask: torch.Tensor, seqlen_q: int, seqlen_k: int, is_causal: bool
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """int32 (start, end) of shape (Bm, Hm, Lk) such that row r keeps key j iff start <= r <
    end (and, with ``is_causal``, j <= r + Lk - Lq), for a 4-D bool ``mask`` (Bm, Hm, Lqm,
    Lk) with Lqm 1 or ``seqlen_q``; None where some key's kept rows are not one run. Keys
    kept by no row get start = end = 0. One read of the mask, byte-wide temporaries only, and
    a read-back per chunk of ``ROWS`` rows (the test), so a mask that is not runs is refused
    at its first chunk with a key that starts two. CPU, B1 H4 L4096 causal, against int64
    row temporaries and one test at the end: a top-W512 mask 1.5x faster, a block top-8 mask
    (refused in its first chunk) 10x."""
    batch, heads, rows, keys = mask.shape
    if keys != seqlen_k or rows not in (1, seqlen_q):
        raise ValueError(f"key_runs: expected a mask of (Bm, Hm, 1 or {seqlen_q}, {seqlen_k}), "
                         f"got {tuple(mask.shape)}")
    device = mask.device
    key = torch.arange(seqlen_k, device=device)
    # the first row that sees key j: j - (Lk - Lq) with causality, else 0
    visible_from = (key - (seqlen_k - seqlen_q)).clamp(min=0) if is_causal else torch.zeros_like(key)
    if rows == 1:  # every row keeps the same keys: a run from the first row that sees it
        kept = mask[:, :, 0, :] & (visible_from < seqlen_q)
        start = torch.where(kept, visible_from, 0)
        end = torch.where(kept, seqlen_q, 0)
        return start.to(torch.int32), end.to(torch.int32)
    # One pass in chunks of rows, on the mask's bytes: per key its kept rows, the rows where a
    # run of them starts (kept below a row that is not), and the first kept row. The keys are
    # runs where no key starts two; a chunk that shows one refuses the mask there.
    count = torch.zeros((batch, heads, seqlen_k), dtype=torch.int64, device=device)
    starts = torch.zeros_like(count)
    first = torch.full_like(count, seqlen_q)
    above = torch.zeros((batch, heads, seqlen_k), dtype=torch.bool, device=device)
    for lo in range(0, seqlen_q, ROWS):
        row = torch.arange(lo, min(lo + ROWS, seqlen_q), device=device)[:, None]
        kept = mask[:, :, lo:lo + row.shape[0], :]
        if is_causal:
            kept = kept & (row >= visible_from)
        starts += (kept[:, :, 0] & ~above).long()
        starts += (kept[:, :, 1:] & ~kept[:, :, :-1]).sum(2)
        if bool((starts > 1).any()):
            return None
        here = kept.sum(2)
        # argmax gives the first of equal maxima: the chunk's first kept row where it has one
        at = kept.view(torch.uint8).argmax(2) + lo
        first = torch.where((count == 0) & (here > 0), at, first)
        count += here
        above = kept[:, :, -1]
    seen = count > 0
    start = torch.where(seen, first, 0).to(torch.int32)
    end = torch.where(seen, first + count, 0).to(torch.int32)
    return start, end


def block_spans(start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """The query rows that blocks of ``BLOCK_KEYS`` consecutive keys of (.., Lk) intervals
    span, summed (the latest end less the earliest start of a block's kept keys): the rows
    a kernel walks per key block in the keys' own order, a long int tensor."""
    keys = start.shape[-1]
    pad = -keys % BLOCK_KEYS
    seen = end > start
    never = torch.iinfo(torch.int32).max
    first = torch.where(seen, start, never)
    last = torch.where(seen, end, 0)
    if pad:
        first = torch.nn.functional.pad(first, (0, pad), value=never)
        last = torch.nn.functional.pad(last, (0, pad), value=0)
    first = first.unflatten(-1, (-1, BLOCK_KEYS)).amin(-1).long()
    last = last.unflatten(-1, (-1, BLOCK_KEYS)).amax(-1).long()
    return (last - first).clamp(min=0).sum()


def order_that_pays(start: torch.Tensor, end: torch.Tensor, least_gain: float,
                    least_saved_rows: float = 0.0) -> torch.Tensor | None:
    """``grouping_order``'s key order of these intervals where it cuts the rows their key
    blocks span (``block_spans``) to at most 1 / ``least_gain`` of the keys' own order's, and
    by at least ``least_saved_rows`` rows, else None. A sliding window's blocks span about
    W + 128 rows in either order; a top-W mask's, in key order, from their first key to the
    last row keeping any of them. One read-back."""
    order = grouping_order(start, end)
    ordered = block_spans(torch.gather(start, -1, order), torch.gather(end, -1, order))
    unordered = block_spans(start, end)
    pays = bool((unordered >= least_gain * ordered) & (unordered - ordered >= least_saved_rows))
    return order if pays else None
