"""The Triton kernel that builds the Hopper backward's loader rows (LSE and delta per query row)
and zeroes the backward's float32 accumulators in the same launch.

What the rows hold, and why, is in ``planning.hopper_backward_buffers``, which launches it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .score import LOG2E


@triton.jit
def _loader_rows_kernel(
    grad_out_ptr, out_ptr, lse_ptr, rows_ptr, zero_ptr, grad_stride_b, grad_stride_l,
    grad_stride_h, out_stride_b, out_stride_l, out_stride_h, heads, seqlen_q, padded_q,
    batch_heads, zero_count, zero_chunk,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    ZERO_BLOCK: tl.constexpr,
):
    """Grid (B x Hq, at least cdiv(padded_q, BLOCK_M)). Writes BLOCK_M rows of one (batch,
    query head): ``rows[bh, r]`` = LSE x log2 e (+inf where the LSE is -inf, and for r >= Lq)
    and ``rows[batch_heads + bh, r]`` = the sum over D of dO * O in float32 (0 for r >= Lq), in
    rows of ``padded_q``; programs past the rows write none. Every program also zeroes its
    ``zero_chunk`` (a multiple of ZERO_BLOCK) float32 words of ``zero_ptr``'s ``zero_count``,
    in the order of its linear program index. ``grad_out`` and ``out``: (B, Lq, Hq, D), last
    dim contiguous; ``lse``: (B, Hq, Lq) contiguous float32."""
    bh = tl.program_id(0)
    batch = bh // heads
    head = bh % heads
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    in_rows = offs_m < seqlen_q
    pairs = in_rows[:, None] & (offs_d < HEAD_DIM)[None, :]
    grad_rows = (grad_out_ptr + batch.to(tl.int64) * grad_stride_b
                 + head.to(tl.int64) * grad_stride_h)
    out_rows = out_ptr + batch.to(tl.int64) * out_stride_b + head.to(tl.int64) * out_stride_h
    grad = tl.load(grad_rows + offs_m[:, None].to(tl.int64) * grad_stride_l + offs_d[None, :],
                   mask=pairs, other=0.0)
    out = tl.load(out_rows + offs_m[:, None].to(tl.int64) * out_stride_l + offs_d[None, :],
                  mask=pairs, other=0.0)
    delta = tl.sum(grad.to(tl.float32) * out.to(tl.float32), 1)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * seqlen_q + offs_m, mask=in_rows,
                  other=float("-inf"))
    scaled = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    in_padded = offs_m < padded_q
    tl.store(rows_ptr + bh.to(tl.int64) * padded_q + offs_m, scaled, mask=in_padded)
    tl.store(rows_ptr + (batch_heads + bh).to(tl.int64) * padded_q + offs_m, delta,
             mask=in_padded)
    # The accumulators' zeroes: a torch.zeros each cost the host 10-40 us on the H200 host.
    program = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + bh
    words = program * zero_chunk + tl.arange(0, ZERO_BLOCK)
    zeros = tl.zeros([ZERO_BLOCK], dtype=tl.float32)
    for start in range(0, zero_chunk, ZERO_BLOCK):
        at = words + start
        tl.store(zero_ptr + at, zeros, mask=at < zero_count)
