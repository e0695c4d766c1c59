"""Merging a split backward's fp32 partials inside the launch that wrote them.

Where a backward grid is too small to fill the GPU it splits work that writes one gradient
tile: dq's key axis (split-K, decode) and dkdv's GQA group of query heads. Each share writes an
fp32 partial, counts itself in on a per-tile counter, and the last share of a tile to arrive
sums the partials in share order and stores the gradient. The sum's order is fixed whichever
program arrives last, so the result is bitwise reproducible, and no merge launch follows (one
launch of host time less per backward; results/notes.md, change 30).

The counters are int32 scratch that starts at zero; the last program of each tile resets its
counter (``_score.last_share_arrived``), so a plan's kept scratch is ready for its next call.
The forward's split-K combines its partials the same way.
"""

import triton
import triton.language as tl

from ._score import operand_base, split_rows, tile_offsets


@triton.jit
def sum_partials(part_ptr, offs_m, m_ok, bh, num_bh, seqlen, num_splits,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The fp32 sum, in split order, of row block ``offs_m`` of (batch x head) row ``bh`` over
    a partial buffer laid out (splits, num_bh, seqlen, BLOCK_D)."""
    offs_d = tl.arange(0, BLOCK_D)
    total = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for split in range(num_splits):
        part_rows = split_rows(split, bh, num_bh, seqlen) + offs_m
        total += tl.load(part_ptr + tile_offsets(part_rows[:, None], offs_d[None, :], BLOCK_D, 1),
                         mask=m_ok[:, None], other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def store_partial(part_ptr, values, offs_m, m_ok, split, bh, num_bh, seqlen,
                  BLOCK_D: tl.constexpr):
    """Store a share's fp32 partial rows (padded columns too, as zeros: ``sum_partials`` reads
    only written elements)."""
    offs_d = tl.arange(0, BLOCK_D)
    part_rows = split_rows(split, bh, num_bh, seqlen) + offs_m
    tl.store(part_ptr + tile_offsets(part_rows[:, None], offs_d[None, :], BLOCK_D, 1), values,
             mask=m_ok[:, None])


@triton.jit
def sum_group_rows(rows_ptr, sum_ptr, pair, group_size, offs_n, n_ok, seqlen_k,
                   BLOCK_N: tl.constexpr):
    """Row ``pair`` (a (batch, kv head) pair) of a (B * Hk, Lk) one-row bias gradient: the sum,
    in head order, of the group's fp32 rows in (B * Hq, Lk) ``rows_ptr``."""
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in range(group_size):
        total += tl.load(rows_ptr + (pair * group_size + g).to(tl.int64) * seqlen_k + offs_n,
                         mask=n_ok, other=0.0, cache_modifier=".cg")
    tl.store(sum_ptr + pair.to(tl.int64) * seqlen_k + offs_n,
             total.to(sum_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def store_gradient_rows(ptr, b, h, offs_m, values, in_range, stride_b, stride_m, stride_h,
                        BLOCK_D: tl.constexpr):
    """Rows ``offs_m`` of head ``h`` of batch ``b`` of a (B, L, H, D) gradient."""
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(operand_base(ptr, b, h, 1, stride_b, stride_h)
             + tile_offsets(offs_m[:, None], offs_d[None, :], stride_m, 1),
             values.to(ptr.dtype.element_ty), mask=in_range)
