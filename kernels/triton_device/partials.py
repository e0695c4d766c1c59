"""Split programs' fp32 partials: storing them, merging them inside the launch that wrote them,
and storing the finished gradient rows.

Where a grid is too small to fill the GPU, several programs share work that ends in one output
tile: the forward's and dq's key axis (split-K, decode), dkdv's GQA group of query heads, and
the packed backward's key blocks. Each share stores an fp32 partial, counts itself in on a
per-tile counter (``last_share_arrived``), and the last share of a tile to arrive reads every
share's partial in share order and stores the result. The order is fixed whichever program
arrives last, so results are bitwise reproducible, and no merge launch follows (one launch of
host time less per call, on the H100 host).

The counters are int32 scratch that starts at zero; the last program of each tile resets its
counter, so a plan's kept scratch is ready for its next call.
"""

import triton
import triton.language as tl

from .score import operand_base, tile_offsets


@triton.jit
def split_rows(split, bh, num_bh, seqlen_q):
    """First row of (batch x head) row ``bh``'s key share ``split`` in a split-K partial buffer
    laid out (splits, num_bh, seqlen_q, ...): what the attention kernels write and the merge
    kernels read."""
    return (split * num_bh + bh).to(tl.int64) * seqlen_q


@triton.jit
def last_share_arrived(counter_ptr, num_shares):
    """Count this program's share of a split tile in; True in the last of the ``num_shares``
    programs to arrive, which then reads every share's partial and stores the tile (the
    arrival counters start at zero, and the last program leaves its counter at zero).

    The barrier orders every warp's partial stores before the one thread that does the atomic
    add; its release (acq_rel, GPU scope) publishes them, and its acquire in the last program
    makes the other shares' stores visible there. Partials are read back with ``.cg`` loads
    (L2, never a stale L1 line)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == num_shares - 1
    if last:
        tl.store(counter_ptr, 0)
    return last


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
def merge_shares(part_ptr, count_ptr, values, offs_m, m_ok, split, num_splits, bh, num_bh,
                 seqlen, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """(values, last) for share ``split`` of a split tile: store this share's partial rows and
    count it in on ``count_ptr``; in the last share to arrive (``last``), ``values`` becomes
    the sum of every share's partial in share order, which the caller then stores. Partials are
    laid out (splits, num_bh, seqlen, BLOCK_D) as ``split_rows`` says."""
    store_partial(part_ptr, values, offs_m, m_ok, split, bh, num_bh, seqlen, BLOCK_D)
    last = last_share_arrived(count_ptr, num_splits)
    if last:
        values = sum_partials(part_ptr, offs_m, m_ok, bh, num_bh, seqlen, num_splits, BLOCK_M,
                              BLOCK_D)
    return values, last


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
