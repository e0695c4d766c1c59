"""The Triton kernel that finishes the Hopper backward in one launch: dQ (and with split heads
dK and dV) cast from their float32 accumulators into the gradients' dtype and strides, and the
bias gradient's float32 rows summed over what the bias broadcasts along and cast.

dQ's accumulator may have its columns spread (``hopper_device.dq_columns``): every 32 columns
hold column 8j + 4a + b at a * 16 + j * 4 + b. Launched by ``planning.hopper_backward_buffers``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _cast_rows(acc_ptr, dst_ptr, block, rows, seqlen, heads, stride_b, stride_l, stride_h,
               SPREAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_R: tl.constexpr):
    """Rows [block x BLOCK_R, + BLOCK_R) of ``acc`` (contiguous float32 (B, L, H, HEAD_DIM),
    ``rows`` = B x L x H) into ``dst`` ((B, L, H, HEAD_DIM) by the given strides, last dim
    contiguous)."""
    row = block * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.arange(0, BLOCK_D)
    if SPREAD:
        # Taken in dQ's order: 4 consecutive columns stay adjacent, so each thread still reads
        # 16 bytes at once, with no exchange between threads.
        stored = (col // 32) * 32 + ((col // 4) % 2) * 16 + ((col // 8) % 4) * 4 + col % 4
    else:
        stored = col
    inside = (row < rows)[:, None] & (col < HEAD_DIM)[None, :]
    acc = tl.load(acc_ptr + row[:, None].to(tl.int64) * HEAD_DIM + stored[None, :],
                  mask=inside, other=0.0)
    batch = row // (seqlen * heads)
    position = (row // heads) % seqlen
    head = row % heads
    offset = (batch.to(tl.int64) * stride_b + position.to(tl.int64) * stride_l
              + head.to(tl.int64) * stride_h)
    tl.store(dst_ptr + offset[:, None] + col[None, :], acc.to(dst_ptr.dtype.element_ty),
             mask=inside)


@triton.jit
def _sum_bias_rows(rows_ptr, grad_ptr, block, key_blocks, seqlen_k, row_heads, bias_heads,
                   summed_batches, group, BLOCK_N: tl.constexpr):
    """Keys [kb x BLOCK_N, + BLOCK_N) of one gradient row (block = row x key_blocks + kb):
    ``grad`` (bB, bias_heads, 1, Lk), contiguous, gets the sum of ``rows`` ((B, row_heads, 1,
    Lk) float32, contiguous) over its ``group`` consecutive heads and, when the bias has one
    batch, over ``summed_batches`` = B; in that fixed order."""
    row = block // key_blocks
    keys = (block % key_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = keys < seqlen_k
    first = (row // bias_heads) * row_heads + (row % bias_heads) * group
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for batch in range(summed_batches):
        for member in range(group):
            source = (first + batch * row_heads + member).to(tl.int64) * seqlen_k
            total += tl.load(rows_ptr + source + keys, mask=inside, other=0.0)
    tl.store(grad_ptr + row.to(tl.int64) * seqlen_k + keys,
             total.to(grad_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _backward_finish_kernel(
    dq_acc_ptr, dq_ptr, dk_acc_ptr, dk_ptr, dv_acc_ptr, dv_ptr, bias_rows_ptr, dbias_ptr,
    q_blocks, kv_blocks, q_rows, kv_rows, seqlen_q, seqlen_k, heads_q, heads_kv,
    dq_stride_b, dq_stride_l, dq_stride_h, dk_stride_b, dk_stride_l, dk_stride_h,
    dv_stride_b, dv_stride_l, dv_stride_h,
    key_blocks, row_heads, bias_heads, summed_batches, group,
    DQ_SPREAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid (q_blocks + 2 x kv_blocks + the bias rows' blocks,): the first programs cast dQ,
    BLOCK_R (batch, row, head)s each, the next dK then dV (``kv_blocks`` 0: none), the rest
    sum the bias rows (``_sum_bias_rows``)."""
    pid = tl.program_id(0)
    if pid < q_blocks:
        _cast_rows(dq_acc_ptr, dq_ptr, pid, q_rows, seqlen_q, heads_q, dq_stride_b,
                   dq_stride_l, dq_stride_h, DQ_SPREAD, HEAD_DIM, BLOCK_D, BLOCK_R)
    elif pid < q_blocks + kv_blocks:
        _cast_rows(dk_acc_ptr, dk_ptr, pid - q_blocks, kv_rows, seqlen_k, heads_kv,
                   dk_stride_b, dk_stride_l, dk_stride_h, False, HEAD_DIM, BLOCK_D, BLOCK_R)
    elif pid < q_blocks + 2 * kv_blocks:
        _cast_rows(dv_acc_ptr, dv_ptr, pid - q_blocks - kv_blocks, kv_rows, seqlen_k,
                   heads_kv, dv_stride_b, dv_stride_l, dv_stride_h, False, HEAD_DIM, BLOCK_D,
                   BLOCK_R)
    else:
        _sum_bias_rows(bias_rows_ptr, dbias_ptr, pid - q_blocks - 2 * kv_blocks, key_blocks,
                       seqlen_k, row_heads, bias_heads, summed_batches, group, BLOCK_N)
