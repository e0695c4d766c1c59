"""The backward's merge kernels: each sums, in a fixed order, the fp32 partials that a split
backward launch wrote, and stores the gradient. dq's come from the dq kernel's key shares
(split-K, decode); dk's and dv's, and a one-row bias gradient's group rows, from dkdv's shares
of its GQA group's query heads. ``backward`` plans and launches them after the producing
kernels."""

import triton
import triton.language as tl

from ._score import operand_base, split_rows, tile_offsets


@triton.jit
def _sum_partials(part_ptr, offs_m, m_ok, bh, num_bh, seqlen, num_splits,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The fp32 sum, in split order, of row block ``offs_m`` of (batch x head) row ``bh`` over
    a partial buffer laid out (splits, num_bh, seqlen, BLOCK_D)."""
    offs_d = tl.arange(0, BLOCK_D)
    total = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for split in range(num_splits):
        part_rows = split_rows(split, bh, num_bh, seqlen) + offs_m
        total += tl.load(part_ptr + tile_offsets(part_rows[:, None], offs_d[None, :], BLOCK_D, 1),
                         mask=m_ok[:, None], other=0.0)
    return total


@triton.jit
def _store_rows(ptr, bh, heads, offs_m, m_ok, values, stride_b, stride_m, stride_h,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store rows ``offs_m`` of (batch x head) row ``bh`` into a (B, L, H, D) gradient."""
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(operand_base(ptr, bh // heads, bh % heads, 1, stride_b, stride_h)
             + tile_offsets(offs_m[:, None], offs_d[None, :], stride_m, 1),
             values.to(ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def attn_bwd_dq_merge_kernel(
    dq_ptr, dq_part_ptr,
    stride_dq_b, stride_dq_m, stride_dq_h,
    heads_q, seqlen_q, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """dq = the sum of the key shares' fp32 partials (split-K dq), in split order."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1)
    m_ok = offs_m < seqlen_q
    dq = _sum_partials(dq_part_ptr, offs_m, m_ok, bh, tl.num_programs(1), seqlen_q, num_splits,
                       BLOCK_M, BLOCK_D)
    _store_rows(dq_ptr, bh, heads_q, offs_m, m_ok, dq, stride_dq_b, stride_dq_m, stride_dq_h,
                HEAD_DIM, BLOCK_D)


@triton.jit
def attn_bwd_dkdv_merge_kernel(
    dk_ptr, dv_ptr, dk_part_ptr, dv_part_ptr, dbias_ptr, dbias_rows_ptr,
    stride_dk_b, stride_dk_n, stride_dk_h,
    stride_dv_b, stride_dv_n, stride_dv_h,
    heads_kv, group_size, seqlen_k, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """dk and dv = the sums of the head shares' fp32 partials, in share order; axis 2 picks
    dk (0) or dv (1), so that both take one launch. A third slice (axis 2 = 2), where the grid
    has one, sums each GQA group's one-row bias gradients: fp32 rows (B * Hq, Lk), one per
    query head, into rows (B * Hk, Lk) of ``dbias_ptr``, in head order."""
    offs_n = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1)
    n_ok = offs_n < seqlen_k
    if tl.program_id(2) == 2:
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        for g in range(group_size):
            total += tl.load(dbias_rows_ptr + (bh * group_size + g).to(tl.int64) * seqlen_k
                             + offs_n, mask=n_ok, other=0.0)
        tl.store(dbias_ptr + bh.to(tl.int64) * seqlen_k + offs_n,
                 total.to(dbias_ptr.dtype.element_ty), mask=n_ok)
    elif tl.program_id(2) == 0:
        dk = _sum_partials(dk_part_ptr, offs_n, n_ok, bh, tl.num_programs(1), seqlen_k,
                           num_splits, BLOCK_M, BLOCK_D)
        _store_rows(dk_ptr, bh, heads_kv, offs_n, n_ok, dk, stride_dk_b, stride_dk_n,
                    stride_dk_h, HEAD_DIM, BLOCK_D)
    else:
        dv = _sum_partials(dv_part_ptr, offs_n, n_ok, bh, tl.num_programs(1), seqlen_k,
                           num_splits, BLOCK_M, BLOCK_D)
        _store_rows(dv_ptr, bh, heads_kv, offs_n, n_ok, dv, stride_dv_b, stride_dv_n,
                    stride_dv_h, HEAD_DIM, BLOCK_D)
