"""The top-W keys of per-key bias rows where every query row keeps the same W (one query row,
or no causality): ``masks.topk``'s decode selection.

Given each row's threshold (the W-th largest bias, NaN ranked as -inf), a key is kept when
its bias is above the threshold, or equal to it and among the first ``W - above`` such keys
in key order (equal biases rank the smaller index first). ``_top_window_kernel`` makes both
passes in one program per row: the keys above the threshold, then each key's verdict with a
running count of the ties before it, written as the interval [0, Lq) or [0, 0).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ranked(bias_row, offs, n):
    """The biases at ``offs`` as float32, NaN (and keys past ``n``) as -inf."""
    x = tl.load(bias_row + offs, mask=offs < n, other=float("-inf")).to(tl.float32)
    return tl.where(x != x, float("-inf"), x)


@triton.jit
def _top_window_kernel(bias_ptr, threshold_ptr, start_ptr, end_ptr, n, stride_row, window,
                       seqlen_q, BLOCK: tl.constexpr):
    """Grid (rows,): row r of the (rows, n) bias (unit key stride, ``stride_row`` apart) with
    its threshold ``threshold_ptr[r]``: int32 start (0) and end (Lq where kept, else 0) of
    its n keys, rows n apart."""
    row = tl.program_id(0)
    bias_row = bias_ptr + row.to(tl.int64) * stride_row
    out_row = row.to(tl.int64) * n
    threshold = tl.load(threshold_ptr + row).to(tl.float32)
    above = 0
    for first in range(0, n, BLOCK):
        x = _ranked(bias_row, first + tl.arange(0, BLOCK), n)
        above += tl.sum((x > threshold).to(tl.int32), 0)
    room = window - above
    tied_before = 0
    for first in range(0, n, BLOCK):
        offs = first + tl.arange(0, BLOCK)
        in_range = offs < n
        x = _ranked(bias_row, offs, n)
        tie = (x == threshold) & in_range
        ties = tie.to(tl.int32)
        kept = (x > threshold) | (tie & (tied_before + tl.cumsum(ties, 0) <= room))
        tl.store(start_ptr + out_row + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=in_range)
        tl.store(end_ptr + out_row + offs, kept.to(tl.int32) * seqlen_q, mask=in_range)
        tied_before += tl.sum(ties, 0)
