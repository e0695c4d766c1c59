"""The top-W keys of per-key bias rows where every query row keeps the same W (one query row,
or no causality): ``masks.topk``'s decode selection, in one launch.

``_top_window_kernel``, one program per row:
1. Each bias becomes an unsigned 32-bit key that sorts as the value does (float32 bits, the
   sign bit flipped for positives, every bit for negatives; NaN as -inf, -0.0 as +0.0).
2. A radix select finds the W-th largest key T, 8 bits per walk along the row, from the
   highest: a 256-bin histogram of the next 8 bits among the keys that share the bits found
   so far, then the bin where the count from the top reaches W. A bfloat16 bias's keys differ
   only in their top 16 bits (2 walks), float16's in 19 (3), float32's in 32 (4). The walks
   also count the keys above T.
3. A last walk writes each key's verdict: kept when above T, or equal to T and among the first
   ``W - above`` such keys in key order (equal biases rank the smaller index first), as the
   interval [0, Lq) or [0, 0).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ordered_keys(bias_row, offs, n, DIGITS: tl.constexpr):
    """uint32 keys of the biases at ``offs`` that sort as the values do (NaN as -inf, -0.0
    as +0.0), their bits below the top ``DIGITS`` bytes cleared (a negative value's low bits
    are set by the flip, a positive's clear); keys past ``n`` are 0, below every bias's
    key."""
    x = tl.load(bias_row + offs, mask=offs < n, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.uint32, bitcast=True)
    negative = (bits >> 31) != 0
    keys = tl.where(negative, ~bits, bits | 0x80000000)
    low: tl.constexpr = 32 - 8 * DIGITS
    return tl.where(offs < n, (keys >> low) << low, 0)


@triton.jit
def _top_window_kernel(bias_ptr, start_ptr, end_ptr, n, stride_row, window, seqlen_q,
                       DIGITS: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (rows,): row r of the (rows, n) bias (unit key stride, ``stride_row`` apart), with
    1 <= ``window`` < n: int32 start (0) and end (Lq where kept, else 0) of its n keys, rows n
    apart. ``DIGITS``: the 8-bit digits from the top that tell this dtype's keys apart."""
    row = tl.program_id(0)
    bias_row = bias_ptr + row.to(tl.int64) * stride_row
    out_row = row.to(tl.int64) * n
    bins = tl.arange(0, 256)
    found = tl.zeros([], dtype=tl.uint32)  # T's digits found so far, in place
    above = 0  # keys above every prefix of T found so far
    for digit in tl.static_range(DIGITS):
        shift: tl.constexpr = 24 - 8 * digit
        counts = tl.zeros([256], dtype=tl.int32)
        for first in range(0, n, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            keys = _ordered_keys(bias_row, offs, n, DIGITS)
            if digit == 0:
                same = offs < n
            else:
                same = (offs < n) & ((keys >> (shift + 8)) == (found >> (shift + 8)))
            counts += tl.histogram(((keys >> shift) & 0xFF).to(tl.int32), 256, mask=same)
        # from the top: keys in this bin or above, and the highest bin where they reach W
        at_or_above = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts
        bin = tl.max(tl.where(above + at_or_above >= window, bins, -1), 0)
        above += tl.sum(tl.where(bins == bin, at_or_above - counts, 0), 0)
        found = found | (bin.to(tl.uint32) << shift)
    room = window - above
    tied_before = 0
    for first in range(0, n, BLOCK):
        offs = first + tl.arange(0, BLOCK)
        in_range = offs < n
        keys = _ordered_keys(bias_row, offs, n, DIGITS)
        tie = (keys == found) & in_range
        ties = tie.to(tl.int32)
        kept = (keys > found) | (tie & (tied_before + tl.cumsum(ties, 0) <= room))
        tl.store(start_ptr + out_row + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=in_range)
        tl.store(end_ptr + out_row + offs, kept.to(tl.int32) * seqlen_q, mask=in_range)
        tied_before += tl.sum(ties, 0)
