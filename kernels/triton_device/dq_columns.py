"""dQ's cast from the Hopper backward's float32 accumulator whose columns were spread
(``hopper_device.dq_columns``): every 32 columns hold column 8j + 4a + b at a * 16 + j * 4 + b.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dq_from_spread_kernel(acc_ptr, dq_ptr, rows, seqlen, heads, dq_stride_b, dq_stride_l,
                           dq_stride_h, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
    """Grid (cdiv(rows, BLOCK_R),). ``acc``: contiguous float32 (B, Lq, Hq, HEAD_DIM), its
    columns spread; ``dq``: (B, Lq, Hq, HEAD_DIM) in its dtype, last dim contiguous, with the
    given strides; ``rows`` = B x Lq x Hq."""
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.arange(0, HEAD_DIM)
    # column g * 32 + j * 8 + a * 4 + b is stored at g * 32 + a * 16 + j * 4 + b: the loads
    # take the columns in dQ's order (4 consecutive ones stay adjacent, so each thread still
    # reads 16 bytes at once), with no exchange between threads.
    stored = (col // 32) * 32 + ((col // 4) % 2) * 16 + ((col // 8) % 4) * 4 + col % 4
    inside = (row < rows)[:, None]
    acc = tl.load(acc_ptr + row[:, None].to(tl.int64) * HEAD_DIM + stored[None, :],
                  mask=inside, other=0.0)
    batch = row // (seqlen * heads)
    position = (row // heads) % seqlen
    head = row % heads
    offset = (batch.to(tl.int64) * dq_stride_b + position.to(tl.int64) * dq_stride_l
              + head.to(tl.int64) * dq_stride_h)
    tl.store(dq_ptr + offset[:, None] + col[None, :], acc.to(dq_ptr.dtype.element_ty),
             mask=inside)
