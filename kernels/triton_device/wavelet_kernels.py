"""The wavelet matrix of ``topk._kth_smallest`` as Triton kernels: bits + 2 launches.

``topk_intervals`` needs, for rows of a permutation of [0, n), the k-th smallest value of many
ranges. The torch version builds the wavelet matrix one bit level at a time and steps every
query through a level before it builds the next, in ~15-28 small torch ops per level. Here a
level is one launch, and the queries one launch for all levels:

* ``_first_level_kernel``: one program per block of ``BLOCK`` positions (and ``ROWS`` rows).
  Copies the values to int32, counts the block's zero bits of the top level, and, when asked,
  writes the inverse permutation (``rank[values[i]] = i``).
* ``_level_kernel``: one launch per level, one program per block. Each program sums the zero
  counts of the blocks before its own (records of the previous launch, four per block), which
  with a cumulative sum inside the block gives every position's count of zero bits before it.
  It writes the level's rank table (below) and the row's zero count, partitions the block
  stably into the next level's array (zero bits first), and counts the next level's zero bits
  by the block they land in: a block's zero-bit values land in one run of positions and its
  one-bit values in another, each spanning at most two blocks, hence four (block, count)
  records per block.
* ``_answer_kernel`` / ``_intervals_kernel``: one program per block of queries, which walks
  every query down all levels (``_descend``) in registers. ``_intervals_kernel`` also computes
  ``topk._intervals``'s causal (start, end) from the answer, as int32.

The rank table of a level has one int64 per 32 positions: the count of zero bits before the
word's first position in the high 32 bits, the word's zero bits (position 32 w + j at bit j) in
the low 32, so the count of zero bits before any position p <= n is one load and a popcount. A
level's table costs n / 4 bytes; every level is kept, so the queries run after the levels.

Positions and counts are int32 (n < 2**31); the queries' k and the epilogue are int64, as in
the torch version, so both give the same bits, out-of-range k included.

A program takes ``ROWS`` rows: 1 on a GPU, all of them (up to 16) under Triton's interpreter,
whose cost is per operation and per program, not per element.
"""

from __future__ import annotations

import triton
import triton.language as tl



# ``nblocks`` (n // BLOCK + 1) is 1 below BLOCK positions and ``words`` (n // 32 + 1) below 32:
# neither is specialized, so that rows on either side share one compile (a warm-up at one
# length covers the other).
@triton.jit(do_not_specialize=("nblocks", "shift"))
def _first_level_kernel(values_ptr, current_ptr, records_ptr, rank_ptr, rows, n, nblocks, shift,
                        BLOCK: tl.constexpr, ROWS: tl.constexpr, WRITE_RANK: tl.constexpr):
    """Block ``program_id(0)`` of rows ``program_id(1)`` * ROWS + [0, ROWS): current =
    int32(values); the block's records of the zeros of bit ``shift`` (this block, zeros) and
    three empty ones; rank[values[i]] = i if WRITE_RANK. A record is one int64, (destination
    block) << 32 | (zero count)."""
    b = tl.program_id(0)
    row = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    row_ok = (row < rows)[:, None]
    row = row.to(tl.int64)[:, None]
    i = b * BLOCK + tl.arange(0, BLOCK)[None, :]
    valid = (i < n) & row_ok
    v = tl.load(values_ptr + row * n + i, mask=valid, other=0).to(tl.int32)
    tl.store(current_ptr + row * n + i, v, mask=valid)
    zeros = tl.sum(tl.where(valid, 1 - ((v >> shift) & 1), 0), 1)[:, None]
    slot = tl.arange(0, 4)[None, :]
    record = (b.to(tl.int64) << 32) + tl.where(slot == 0, zeros, 0).to(tl.int64)
    tl.store(records_ptr + (row * nblocks + b) * 4 + slot, record, mask=row_ok)
    if WRITE_RANK:
        tl.store(rank_ptr + row * n + v, i, mask=valid)


@triton.jit(do_not_specialize=("nblocks", "words", "level", "shift"))
def _level_kernel(current_ptr, next_ptr, records_ptr, next_records_ptr, table_ptr, totals_ptr,
                  rows, n, nblocks, words, level, shift,
                  BLOCK: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr):
    """Level ``level`` (bit ``shift`` of the values in ``current``), block ``program_id(0)``
    of rows ``program_id(1)`` * ROWS + [0, ROWS): the block's words of the level's rank table
    (``table``: (bits, rows, words)), the row's zero count (``totals``: (bits, rows)) and, if
    shift > 0, the block's values stably partitioned into ``next`` (zero bits first) with its
    records of the zero counts of bit shift - 1 by destination block. ``records``: this
    level's records, (rows, nblocks, 4). Blocks cover positions [0, n], so that the word of
    position n has one."""
    b = tl.program_id(0)
    row = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    row_ok = row < rows
    row = row.to(tl.int64)
    # -- zeros of this level before the block, and in the row, from the records
    before_acc = tl.zeros([ROWS, CHUNK], dtype=tl.int32)
    total_acc = tl.zeros([ROWS, CHUNK], dtype=tl.int32)
    for start in range(0, nblocks * 4, CHUNK):
        idx = start + tl.arange(0, CHUNK)[None, :]
        record = tl.load(records_ptr + row[:, None] * nblocks * 4 + idx,
                         mask=row_ok[:, None] & (idx < nblocks * 4), other=0)
        dest = (record >> 32).to(tl.int32)
        count = (record - (dest.to(tl.int64) << 32)).to(tl.int32)
        before_acc += tl.where(dest < b, count, 0)
        total_acc += count
    offset = tl.sum(before_acc, 1)
    total = tl.sum(total_acc, 1)
    level_row = level * rows + row
    tl.store(totals_ptr + level_row, total, mask=row_ok & (b + tl.zeros_like(total) == 0))
    # -- this level's bits and the zero counts before each position
    i = b * BLOCK + tl.arange(0, BLOCK)[None, :]
    valid = (i < n) & row_ok[:, None]
    v = tl.load(current_ptr + row[:, None] * n + i, mask=valid, other=0)
    zero = tl.where(valid, 1 - ((v >> shift) & 1), 0)
    before = offset[:, None] + tl.cumsum(zero, 1) - zero
    # -- the rank table: (zeros before the word) << 32 | the word's zero bits
    lanes = tl.arange(0, 32)[None, None, :]
    word = tl.sum(tl.reshape(zero, [ROWS, BLOCK // 32, 32]).to(tl.int64) << lanes, 2)
    first = tl.min(tl.reshape(before, [ROWS, BLOCK // 32, 32]), 2)  # counts never fall
    w = b * (BLOCK // 32) + tl.arange(0, BLOCK // 32)[None, :]
    tl.store(table_ptr + level_row[:, None] * words + w, (first.to(tl.int64) << 32) + word,
             mask=(w < words) & row_ok[:, None])
    if shift > 0:
        # -- stable partition, and the next level's zero counts by destination block
        is_zero = zero == 1
        place = tl.where(is_zero, before, total[:, None] + i - before)
        tl.store(next_ptr + row[:, None] * n + place, v, mask=valid)
        next_zero = tl.where(valid, 1 - ((v >> (shift - 1)) & 1), 0)
        # The block's zero-bit values land from position offset on, its one-bit values from
        # total + (ones before the block) on.
        zeros_to = (offset // BLOCK)[:, None]
        ones_to = ((total + b * BLOCK - offset) // BLOCK)[:, None]
        slot = (tl.where(is_zero, 0, 2)
                + (place // BLOCK != tl.where(is_zero, zeros_to, ones_to)).to(tl.int32))
        slots = tl.arange(0, 4)[None, :]
        counts = tl.sum(tl.where(slot[:, :, None] == slots[:, None, :], next_zero[:, :, None], 0),
                        1)
        dests = tl.where(slots < 2, zeros_to, ones_to) + slots % 2
        tl.store(next_records_ptr + (row[:, None] * nblocks + b) * 4 + slots,
                 (dests.to(tl.int64) << 32) + counts.to(tl.int64), mask=row_ok[:, None])


@triton.jit
def _descend(table_ptr, totals_ptr, row, row_ok, rows, words, lo, hi, k, bits):
    """The k-th smallest of values[row, lo:hi] (int32 lo, hi; int64 k; (ROWS, 1) rows)
    through every level's table: the steps of ``_kth_smallest``. The count of zero bits before
    p at a level is the count before its word plus the popcount of the word's bits below p
    (p & 31 < 32 bits, so the masked word is in [0, 2**31))."""
    answer = tl.zeros_like(lo)
    for level in range(bits):
        shift = bits - 1 - level
        level_row = level * rows + row
        zeros_total = tl.load(totals_ptr + level_row, mask=row_ok, other=0)
        entry_lo = tl.load(table_ptr + level_row * words + (lo >> 5), mask=row_ok, other=0)
        entry_hi = tl.load(table_ptr + level_row * words + (hi >> 5), mask=row_ok, other=0)
        x_lo = entry_lo & ((1 << (lo & 31).to(tl.int64)) - 1)
        x_hi = entry_hi & ((1 << (hi & 31).to(tl.int64)) - 1)
        x_lo = x_lo - ((x_lo >> 1) & 0x55555555)
        x_hi = x_hi - ((x_hi >> 1) & 0x55555555)
        x_lo = (x_lo & 0x33333333) + ((x_lo >> 2) & 0x33333333)
        x_hi = (x_hi & 0x33333333) + ((x_hi >> 2) & 0x33333333)
        x_lo = (x_lo + (x_lo >> 4)) & 0x0F0F0F0F
        x_hi = (x_hi + (x_hi >> 4)) & 0x0F0F0F0F
        x_lo = x_lo + (x_lo >> 8)
        x_hi = x_hi + (x_hi >> 8)
        zeros_lo = ((entry_lo >> 32) + ((x_lo + (x_lo >> 16)) & 63)).to(tl.int32)
        zeros_hi = ((entry_hi >> 32) + ((x_hi + (x_hi >> 16)) & 63)).to(tl.int32)
        zeros_in = zeros_hi - zeros_lo
        left = k < zeros_in
        answer = answer | (tl.where(left, 0, 1) << shift)
        k = tl.where(left, k, k - zeros_in)
        lo = tl.where(left, zeros_lo, zeros_total + lo - zeros_lo)
        hi = tl.where(left, zeros_hi, zeros_total + hi - zeros_hi)
    return answer


@triton.jit(do_not_specialize=("words", "bits"))
def _answer_kernel(table_ptr, totals_ptr, lo_ptr, hi_ptr, k_ptr, answer_ptr, rows, m, words,
                   bits, QUERIES: tl.constexpr, ROWS: tl.constexpr):
    """answer[r, q] = k[r, q]-th smallest of values[r, lo[r, q]:hi[r, q]] for the queries
    (rows, m) int64, contiguous; block ``program_id(0)`` of rows ``program_id(1)`` * ROWS +
    [0, ROWS)."""
    row = tl.program_id(1) * ROWS + tl.arange(0, ROWS)[:, None]
    row_ok = row < rows
    q = tl.program_id(0) * QUERIES + tl.arange(0, QUERIES)[None, :]
    valid = (q < m) & row_ok
    at = row.to(tl.int64) * m + q
    lo = tl.load(lo_ptr + at, mask=valid, other=0).to(tl.int32)
    hi = tl.load(hi_ptr + at, mask=valid, other=0).to(tl.int32)
    k = tl.load(k_ptr + at, mask=valid, other=0)
    answer = _descend(table_ptr, totals_ptr, row, row_ok, rows, words, lo, hi, k, bits)
    tl.store(answer_ptr + at, answer.to(tl.int64), mask=valid)


@triton.jit(do_not_specialize=("words", "bits", "window", "seqlen_q"))
def _intervals_kernel(table_ptr, totals_ptr, rank_ptr, local_ptr, key_start_ptr, seqlen_k_ptr,
                      seqlen_q_ptr, start_ptr, end_ptr, rows, n, words, bits, window, seqlen_q,
                      QUERIES: tl.constexpr, ROWS: tl.constexpr, PACKED: tl.constexpr):
    """Causal (start, end), int32, of keys p (block ``program_id(0)``) of rows
    ``program_id(1)`` * ROWS + [0, ROWS), as ``topk._intervals`` computes them: the
    query of key p asks for the (window - 1)-th smallest position among ranks key_start[p] ..
    rank[p] - 1. Packed keys read their sequence's local index, key start and lengths from
    the (n,) int64 arrays; one sequence has local index p, key start 0, n keys and
    ``seqlen_q`` queries."""
    row = tl.program_id(1) * ROWS + tl.arange(0, ROWS)[:, None]
    row_ok = row < rows
    p = tl.program_id(0) * QUERIES + tl.arange(0, QUERIES)[None, :]
    key_ok = p < n
    valid = key_ok & row_ok
    at = row.to(tl.int64) * n + p
    rank = tl.load(rank_ptr + at, mask=valid, other=0)
    if PACKED:
        local = tl.load(local_ptr + p, mask=key_ok, other=0)
        key_start = tl.load(key_start_ptr + p, mask=key_ok, other=0)
        keys = tl.load(seqlen_k_ptr + p, mask=key_ok, other=0)
        queries = tl.load(seqlen_q_ptr + p, mask=key_ok, other=0)
    else:
        local = p.to(tl.int64)
        key_start = tl.zeros([1, QUERIES], dtype=tl.int64)
        keys = key_start + n
        queries = key_start + seqlen_q
    lo = key_start.to(tl.int32) + tl.zeros([ROWS, QUERIES], dtype=tl.int32)
    k = tl.zeros([ROWS, QUERIES], dtype=tl.int64) + (window - 1)
    answer = _descend(table_ptr, totals_ptr, row, row_ok, rows, words, lo, rank, k, bits)
    offset = keys - queries
    # The window-th beating key becomes visible at row wth - offset: the first row without p.
    wth = answer.to(tl.int64) - key_start
    end = tl.minimum(tl.maximum(wth - offset, 0), queries)
    end = tl.where((rank - lo).to(tl.int64) < window, queries, end)
    start = tl.maximum(local - offset, 0) + tl.zeros([ROWS, QUERIES], dtype=tl.int64)
    tl.store(start_ptr + at, start.to(tl.int32), mask=valid)
    tl.store(end_ptr + at, end.to(tl.int32), mask=valid)
