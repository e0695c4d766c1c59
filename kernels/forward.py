"""Forward kernel and its launcher.

Online softmax follows FlashAttention-2's names: ``m_i`` running row max (log2 domain), ``l_i``
running row sum of exp2(s - m_i), ``acc`` un-normalized output. Axis letters: b batch, h head,
m query position, n key position, d head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._checks import CheckedInputs
from ._launch import (LOG2E, dot_options, ensure_runnable, is_interpreted, operand_args,
                      padded_head_dim)
from ._score import (LN2, any_visible, causal_key_end, mma, operand_base, scores_log2,
                     tile_offsets, visible_keys)


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
    mask_ptr, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n, mask_head_div,
    bias_ptr, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n, bias_head_div,
    stride_q_b, stride_q_m, stride_q_h,
    stride_k_b, stride_k_n, stride_k_h,
    stride_v_b, stride_v_n, stride_v_h,
    stride_o_b, stride_o_m, stride_o_h,
    heads_q, group_size, seqlen_q, seqlen_k, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, IS_CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // heads_q
    h = bh % heads_q

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM  # folds away when HEAD_DIM == BLOCK_D

    q_base = operand_base(q_ptr, b, h, 1, stride_q_b, stride_q_h)
    k_base = operand_base(k_ptr, b, h, group_size, stride_k_b, stride_k_h)
    v_base = operand_base(v_ptr, b, h, group_size, stride_v_b, stride_v_h)
    q = tl.load(q_base + tile_offsets(offs_m[:, None], offs_d[None, :], stride_q_m, 1),
                mask=(offs_m[:, None] < seqlen_q) & d_ok[None, :], other=0.0)

    mask_ptrs = operand_base(mask_ptr, b, h, mask_head_div, stride_mask_b, stride_mask_h) \
        + tile_offsets(offs_m[:, None], offs_n0[None, :], stride_mask_m, stride_mask_n)
    bias_ptrs = operand_base(bias_ptr, b, h, bias_head_div, stride_bias_b, stride_bias_h) \
        + tile_offsets(offs_m[:, None], offs_n0[None, :], stride_bias_m, stride_bias_n)
    k_ptrs = k_base + tile_offsets(offs_n0[:, None], offs_d[None, :], stride_k_n, 1)
    v_ptrs = v_base + tile_offsets(offs_n0[:, None], offs_d[None, :], stride_v_n, 1)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Causal: keys past the last visible column of this block's last row are never needed.
    hi = seqlen_k
    if IS_CAUSAL:
        hi = causal_key_end(start_m, BLOCK_M, seqlen_q, seqlen_k)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        keep = visible_keys(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, mask_ptrs,
                            HAS_MASK, IS_CAUSAL)
        active = True
        if HAS_MASK:
            active = any_visible(keep)
        if active:
            n_ok = offs_n[:, None] < seqlen_k
            k = tl.load(k_ptrs, mask=n_ok & d_ok[None, :], other=0.0)
            qk = mma(q, tl.trans(k), DOT_PRECISION, WIDEN_DOTS)
            s = scores_log2(qk, keep, bias_ptrs, qk_scale, HAS_BIAS)
            # -- update m_i, l_i; an all -inf row so far shifts by 0 instead of -inf (NaN guard)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_shift[:, None])
            alpha = tl.math.exp2(m_i - m_shift)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptrs, mask=n_ok & d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, WIDEN_DOTS)
            m_i = m_new
        k_ptrs += BLOCK_N * stride_k_n
        v_ptrs += BLOCK_N * stride_v_n
        mask_ptrs += BLOCK_N * stride_mask_n
        bias_ptrs += BLOCK_N * stride_bias_n

    # Rows that saw no key: l_i == 0, m_i == -inf -> output 0 and LSE -inf, never 0/0.
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    out_base = operand_base(out_ptr, b, h, 1, stride_o_b, stride_o_h)
    tl.store(out_base + tile_offsets(offs_m[:, None], offs_d[None, :], stride_o_m, 1),
             out.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < seqlen_q) & d_ok[None, :])
    # LSE is (B, Hq, Lq) contiguous. The row predicate keeps a partial last block from writing
    # into the next head's rows (the LSE race seen in other Triton attention ports).
    tl.store(lse_ptr + bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)


@dataclass(frozen=True)
class ForwardConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def forward_config(block_d: int, dtype: torch.dtype, interpreted: bool) -> ForwardConfig:
    if interpreted:
        # Small tiles so that test shapes span several tiles (skips, partial tiles, causal edge).
        return ForwardConfig(32, 32, 4, 1)
    if dtype == torch.float32:
        # fp32 tiles take twice the shared memory; fp32 is for accuracy checks, not speed.
        return ForwardConfig(64, 32, 4, 2 if block_d <= 128 else 1)
    if block_d <= 64:
        return ForwardConfig(128, 64, 4, 3)
    if block_d <= 128:
        return ForwardConfig(128, 64, 8, 3)
    return ForwardConfig(64, 32, 8, 2)


def attention_forward(query, key, value, checked: CheckedInputs, is_causal: bool):
    """Launch the forward. Returns (out (B, Lq, Hq, D), lse (B, Hq, Lq) float32)."""
    ensure_runnable(_attn_fwd_kernel, query.device)
    shape = checked.shape
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    lse = torch.empty((shape.batch, shape.heads_q, shape.seqlen_q), dtype=torch.float32,
                      device=query.device)
    block_d = padded_head_dim(shape.head_dim)
    interpreted = is_interpreted(_attn_fwd_kernel)
    cfg = forward_config(block_d, query.dtype, interpreted)
    mask = operand_args(checked.mask, out)
    bias = operand_args(checked.bias, out)
    grid = (triton.cdiv(shape.seqlen_q, cfg.block_m), shape.batch * shape.heads_q)
    _attn_fwd_kernel[grid](
        query, key, value, out, lse,
        *mask.as_args(), *bias.as_args(),
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        shape.heads_q, shape.group_size, shape.seqlen_q, shape.seqlen_k,
        checked.softmax_scale * LOG2E,
        HEAD_DIM=shape.head_dim, BLOCK_D=block_d,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        HAS_MASK=checked.mask is not None, HAS_BIAS=checked.bias is not None,
        IS_CAUSAL=bool(is_causal), **dot_options(query.dtype, interpreted),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse
