"""Backward kernels and their launcher.

Two launches, FlashAttention-2 style (three with split-K dq):
1. ``_attn_bwd_dq_kernel``: one program per (query block, b, q head), looping over keys. It
   first computes delta = rowsum(dO * O), one fp32 per (b, hq, m), and stores it for dkdv. A
   grid too small to fill the GPU (decode) also splits the keys, as the forward does: each
   share writes an fp32 partial of dq and ``_attn_bwd_dq_merge_kernel`` sums them in order.
2. ``_attn_bwd_dkdv_kernel``: one program per (key block, b, kv head). It loops over the query
   heads of its GQA group and over query blocks, so dk and dv are reduced in registers: no
   atomics and no (B, Lk, Hq, D) temporary. It also produces the bias gradient for biases that
   span the key axis (see ``_dbias``).

Scores and probabilities are rebuilt with the forward's helpers from the saved LSE. dkdv works
in the transposed (n, m) orientation so that its dots need no extra transposes of dS and P.
Axis letters: b batch, h head, m query position, n key position, d head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._blocks import ActivityMap, BlockLists, block_list_strides
from ._checks import AttnShape
from ._dbias import plan_dbias
from ._launch import (ABSENT_OPERAND, LOG2E, PlannedLaunch, ceil_div, contiguous_strides,
                      dot_options, edge_slots, is_interpreted, key_splits, multiprocessors,
                      operand_pointer, padded_head_dim, strides3)
from ._score import (block_at, block_list_row, causal_block_split, causal_query_split,
                     clamp_index, interior_span, load_bias, mma, operand_base, probs_from_lse,
                     query_tile_scores, scores_log2, split_share, tile_offsets, visible_keys,
                     write_tile)


@triton.jit
def _attn_bwd_dq_merge_kernel(
    dq_ptr, dq_part_ptr,
    stride_dq_b, stride_dq_m, stride_dq_h,
    heads_q, seqlen_q, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """dq = the sum of the key shares' fp32 partials (split-K dq), in split order."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seqlen_q
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for split in range(num_splits):
        part_rows = (split * tl.num_programs(1) + bh).to(tl.int64) * seqlen_q + offs_m
        dq += tl.load(dq_part_ptr + tile_offsets(part_rows[:, None], offs_d[None, :], BLOCK_D, 1),
                      mask=m_ok[:, None], other=0.0)
    tl.store(operand_base(dq_ptr, bh // heads_q, bh % heads_q, 1, stride_dq_b, stride_dq_h)
             + tile_offsets(offs_m[:, None], offs_d[None, :], stride_dq_m, 1),
             dq.to(dq_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, dbias_col, k, v, offs_n, offs_m0, d_ok, n_ok,
    q_ptrs, do_ptrs, stride_q_m, stride_do_m,
    mask_ptrs, stride_mask_m, bias_ptrs, stride_bias_m, dbias_ptrs, stride_db_m,
    lse_ptr, delta_ptr, block_list_ptr, first_block, num_blocks,
    seqlen_q, seqlen_k, qk_scale,
    BLOCK_M: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_ROW: tl.constexpr, CAUSAL_TILES: tl.constexpr, USE_LIST: tl.constexpr,
    INTERIOR: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    HAS_DBIAS: tl.constexpr, DBIAS_REDUCE_M: tl.constexpr,
    DBIAS_ACCUMULATE: tl.constexpr, DBIAS_ATOMIC: tl.constexpr,
):
    """Accumulate one query head's contribution to a key block's dk, dv (and dbias).

    Works in the (n, m) orientation. Pointers address query block 0; blocks are
    ``first_block + i`` or the i-th entry of the transposed active-tile list. INTERIOR query
    blocks are whole and below the diagonal: no per-pair range or causal test (mask and bias
    pointers are key-clamped by the caller; key rows past seqlen_k are never stored).
    """
    block = block_at(block_list_ptr, first_block, 0, num_blocks, USE_LIST)
    for i in range(num_blocks):
        start_m = block * BLOCK_M
        offs_m = start_m + offs_m0
        m_ok = offs_m < seqlen_q
        # The next block's index one iteration ahead (see _attn_fwd_inner).
        block = block_at(block_list_ptr, first_block, i + 1, num_blocks, USE_LIST)
        keep = 0  # interior tiles without a mask keep every pair
        if HAS_MASK or not INTERIOR:
            keep = visible_keys(offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k,
                                mask_ptrs + start_m.to(tl.int64) * stride_mask_m,
                                HAS_MASK, CAUSAL_TILES, INTERIOR)
        if INTERIOR:
            q_in_range = d_ok[None, :]
        else:
            q_in_range = m_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptrs + start_m.to(tl.int64) * stride_q_m, mask=q_in_range, other=0.0)
        bias = 0.0
        if HAS_BIAS:
            bias = load_bias(bias_ptrs + start_m.to(tl.int64) * stride_bias_m, keep,
                             n_ok[:, None], BIAS_ROW, INTERIOR)
        qk_t = mma(k, tl.trans(q), DOT_PRECISION, WIDEN_DOTS)
        s_t = scores_log2(qk_t, keep, bias, qk_scale, HAS_BIAS, HAS_MASK or not INTERIOR)
        p_t = probs_from_lse(s_t, tl.load(lse_ptr + offs_m, mask=m_ok, other=0.0)[None, :])
        do = tl.load(do_ptrs + start_m.to(tl.int64) * stride_do_m, mask=q_in_range, other=0.0)
        dv += mma(p_t.to(do.dtype), do, DOT_PRECISION, WIDEN_DOTS)
        dp_t = mma(v, tl.trans(do), DOT_PRECISION, WIDEN_DOTS)
        # dS = P * (dP - delta): the gradient of the (natural) score, bias included.
        ds_t = p_t * (dp_t - tl.load(delta_ptr + offs_m, mask=m_ok, other=0.0)[None, :])
        dk += mma(ds_t.to(q.dtype), q, DOT_PRECISION, WIDEN_DOTS)
        if HAS_DBIAS:
            if DBIAS_REDUCE_M:
                dbias_col += tl.sum(ds_t, 1)
            else:
                write_tile(dbias_ptrs + start_m.to(tl.int64) * stride_db_m, ds_t,
                           n_ok[:, None] & m_ok[None, :], DBIAS_ACCUMULATE, DBIAS_ATOMIC)
    return dk, dv, dbias_col


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    mask_ptr, bias_ptr, dbias_ptr, list_ptr,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n, mask_head_div,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n, bias_head_div,
    stride_db_b, stride_db_h, stride_db_m, stride_db_n, dbias_head_div,
    stride_list_b, stride_list_h, stride_list_n,
    stride_q_b, stride_q_m, stride_q_h,
    stride_k_b, stride_k_n, stride_k_h,
    stride_v_b, stride_v_n, stride_v_h,
    stride_do_b, stride_do_m, stride_do_h,
    stride_dk_b, stride_dk_n, stride_dk_h,
    stride_dv_b, stride_dv_n, stride_dv_h,
    heads_q, group_size, seqlen_q, seqlen_k, qk_scale, sm_scale,
    batch_start, head_start, heads_per_launch,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ROW: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    HAS_DBIAS: tl.constexpr, DBIAS_REDUCE_M: tl.constexpr, DBIAS_SUM_GROUP: tl.constexpr,
    DBIAS_ACCUMULATE: tl.constexpr, DBIAS_ATOMIC: tl.constexpr, EDGE_SLOTS: tl.constexpr,
):
    n_block = tl.program_id(0)
    start_n = n_block * BLOCK_N
    # Axis 1 enumerates (batch, kv head) pairs of this launch; deterministic dbias for a shared
    # bias launches one slice at a time (batch_start / head_start) in a fixed order.
    b = batch_start + tl.program_id(1) // heads_per_launch
    hk = head_start + tl.program_id(1) % heads_per_launch

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    n_ok = offs_n < seqlen_k
    kv_in_range = n_ok[:, None] & d_ok[None, :]
    k = tl.load(operand_base(k_ptr, b, hk, 1, stride_k_b, stride_k_h)
                + tile_offsets(offs_n[:, None], offs_d[None, :], stride_k_n, 1),
                mask=kv_in_range, other=0.0)
    v = tl.load(operand_base(v_ptr, b, hk, 1, stride_v_b, stride_v_h)
                + tile_offsets(offs_n[:, None], offs_d[None, :], stride_v_n, 1),
                mask=kv_in_range, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    if BIAS_ROW:  # one query row: address it once per tile (see load_bias)
        bias_cols = tl.zeros([1, 1], dtype=tl.int32)
    else:
        bias_cols = offs_m0[None, :]
    # Mask and bias keys past seqlen_k read the last key: interior tiles load unpredicated.
    safe_n = clamp_index(offs_n, seqlen_k)
    # Query blocks [first, full_from) straddle the diagonal; [full_from, interior_end) need no
    # per-pair test; a partial last query block needs the range test again.
    first, full_from, num_blocks = causal_query_split(start_n, BLOCK_M, BLOCK_N, seqlen_q,
                                                      seqlen_k, IS_CAUSAL)
    interior_end = tl.maximum(seqlen_q // BLOCK_M, full_from)
    # One-row bias gradient: summed over queries here, and over the group's query heads too
    # when they share a gradient row (DBIAS_SUM_GROUP), so that no reduction follows.
    dbias_col = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in range(group_size):
        h = hk * group_size + g
        bh = b * heads_q + h
        q_ptrs = operand_base(q_ptr, b, h, 1, stride_q_b, stride_q_h) \
            + tile_offsets(offs_m0[:, None], offs_d[None, :], stride_q_m, 1)
        do_ptrs = operand_base(do_ptr, b, h, 1, stride_do_b, stride_do_h) \
            + tile_offsets(offs_m0[:, None], offs_d[None, :], stride_do_m, 1)
        mask_ptrs = operand_base(mask_ptr, b, h, mask_head_div, stride_mask_b, stride_mask_h) \
            + tile_offsets(safe_n[:, None], offs_m0[None, :], stride_mask_n, stride_mask_m)
        bias_ptrs = operand_base(bias_ptr, b, h, bias_head_div, stride_bias_b, stride_bias_h) \
            + tile_offsets(safe_n[:, None], bias_cols, stride_bias_n, stride_bias_m)
        dbias_ptrs = operand_base(dbias_ptr, b, h, dbias_head_div, stride_db_b, stride_db_h) \
            + tile_offsets(offs_n[:, None], offs_m0[None, :], stride_db_n, stride_db_m)
        lse_row = lse_ptr + bh.to(tl.int64) * seqlen_q
        delta_row = delta_ptr + bh.to(tl.int64) * seqlen_q
        if not DBIAS_SUM_GROUP:
            dbias_col = tl.zeros([BLOCK_N], dtype=tl.float32)
        if HAS_MASK:
            block_list, count, full = block_list_row(
                list_ptr, stride_list_b, stride_list_h, stride_list_n, b, h, mask_head_div,
                n_block)
            # List positions: [0, full) full tiles, read without the mask; then partial
            # tiles: edge [full, lo), interior [lo, hi), edge again [hi, count).
            lo, hi = interior_span(block_list + full, count - full, full_from, interior_end,
                                   EDGE_SLOTS)
            lo += full
            hi += full
            # Full tiles: every pair visible, so no mask read and no per-pair test.
            dk, dv, dbias_col = _attn_bwd_dkdv_inner(
                dk, dv, dbias_col, k, v, offs_n, offs_m0, d_ok, n_ok,
                q_ptrs, do_ptrs, stride_q_m, stride_do_m, mask_ptrs, stride_mask_m,
                bias_ptrs, stride_bias_m, dbias_ptrs, stride_db_m, lse_row, delta_row,
                block_list, 0, full, seqlen_q, seqlen_k, qk_scale,
                BLOCK_M, False, HAS_BIAS, BIAS_ROW, False, True, True, DOT_PRECISION,
                WIDEN_DOTS, HAS_DBIAS, DBIAS_REDUCE_M, DBIAS_ACCUMULATE, DBIAS_ATOMIC)
            # The partial tiles' three spans, as slices of the list.
            edge_list, edge_first, edge_count = block_list + full, 0, lo - full
            inner_list, inner_first, inner_count = block_list + lo, 0, hi - lo
            tail_list, tail_first, tail_count = block_list + hi, 0, count - hi
        else:
            # The same three spans as ranges of query blocks (the list pointer is unused).
            edge_list, edge_first, edge_count = list_ptr, first, full_from - first
            inner_list, inner_first, inner_count = list_ptr, full_from, interior_end - full_from
            tail_list, tail_first, tail_count = list_ptr, interior_end, num_blocks - interior_end
        # Blocks on the causal diagonal, interior blocks, then a partial last query block.
        dk, dv, dbias_col = _attn_bwd_dkdv_inner(
            dk, dv, dbias_col, k, v, offs_n, offs_m0, d_ok, n_ok,
            q_ptrs, do_ptrs, stride_q_m, stride_do_m, mask_ptrs, stride_mask_m,
            bias_ptrs, stride_bias_m, dbias_ptrs, stride_db_m, lse_row, delta_row,
            edge_list, edge_first, edge_count, seqlen_q, seqlen_k, qk_scale,
            BLOCK_M, HAS_MASK, HAS_BIAS, BIAS_ROW, IS_CAUSAL, HAS_MASK, False, DOT_PRECISION,
            WIDEN_DOTS, HAS_DBIAS, DBIAS_REDUCE_M, DBIAS_ACCUMULATE, DBIAS_ATOMIC)
        dk, dv, dbias_col = _attn_bwd_dkdv_inner(
            dk, dv, dbias_col, k, v, offs_n, offs_m0, d_ok, n_ok,
            q_ptrs, do_ptrs, stride_q_m, stride_do_m, mask_ptrs, stride_mask_m,
            bias_ptrs, stride_bias_m, dbias_ptrs, stride_db_m, lse_row, delta_row,
            inner_list, inner_first, inner_count, seqlen_q, seqlen_k, qk_scale,
            BLOCK_M, HAS_MASK, HAS_BIAS, BIAS_ROW, False, HAS_MASK, True, DOT_PRECISION,
            WIDEN_DOTS, HAS_DBIAS, DBIAS_REDUCE_M, DBIAS_ACCUMULATE, DBIAS_ATOMIC)
        dk, dv, dbias_col = _attn_bwd_dkdv_inner(
            dk, dv, dbias_col, k, v, offs_n, offs_m0, d_ok, n_ok,
            q_ptrs, do_ptrs, stride_q_m, stride_do_m, mask_ptrs, stride_mask_m,
            bias_ptrs, stride_bias_m, dbias_ptrs, stride_db_m, lse_row, delta_row,
            tail_list, tail_first, tail_count, seqlen_q, seqlen_k, qk_scale,
            BLOCK_M, HAS_MASK, HAS_BIAS, BIAS_ROW, False, HAS_MASK, False, DOT_PRECISION,
            WIDEN_DOTS, HAS_DBIAS, DBIAS_REDUCE_M, DBIAS_ACCUMULATE, DBIAS_ATOMIC)
        if HAS_DBIAS and DBIAS_REDUCE_M and not DBIAS_SUM_GROUP:
            # Row (b, hq) of a (B, Hq, 1, Lk) buffer: a single writer, no atomics.
            tl.store(operand_base(dbias_ptr, b, h, dbias_head_div, stride_db_b, stride_db_h)
                     + offs_n.to(tl.int64) * stride_db_n,
                     dbias_col.to(dbias_ptr.dtype.element_ty), mask=n_ok)
    if HAS_DBIAS and DBIAS_REDUCE_M and DBIAS_SUM_GROUP:
        # Row (b, hk) of a (B, Hk, 1, Lk) buffer, written once by this program.
        tl.store(operand_base(dbias_ptr, b, hk, dbias_head_div, stride_db_b, stride_db_h)
                 + offs_n.to(tl.int64) * stride_db_n,
                 dbias_col.to(dbias_ptr.dtype.element_ty), mask=n_ok)

    # q.k was scaled in the forward, so dK picks up the scale once here.
    dk *= sm_scale
    tl.store(operand_base(dk_ptr, b, hk, 1, stride_dk_b, stride_dk_h)
             + tile_offsets(offs_n[:, None], offs_d[None, :], stride_dk_n, 1),
             dk.to(dk_ptr.dtype.element_ty), mask=kv_in_range)
    tl.store(operand_base(dv_ptr, b, hk, 1, stride_dv_b, stride_dv_h)
             + tile_offsets(offs_n[:, None], offs_d[None, :], stride_dv_n, 1),
             dv.to(dv_ptr.dtype.element_ty), mask=kv_in_range)


@triton.jit
def _attn_bwd_dq_inner(
    dq, q, do, lse, delta, offs_m, offs_n0, d_ok,
    k_ptrs, v_ptrs, stride_k_n, stride_v_n,
    mask_ptrs, stride_mask_n, bias_ptrs, stride_bias_n,
    block_list_ptr, first_block, num_blocks,
    seqlen_q, seqlen_k, qk_scale,
    BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_ROW: tl.constexpr, CAUSAL_TILES: tl.constexpr, USE_LIST: tl.constexpr,
    INTERIOR: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
):
    """Accumulate dq over key blocks, like ``_attn_fwd_inner`` (INTERIOR likewise)."""
    block = block_at(block_list_ptr, first_block, 0, num_blocks, USE_LIST)
    for i in range(num_blocks):
        start_n = block * BLOCK_N
        offs_n = start_n + offs_n0
        # The next block's index one iteration ahead (see _attn_fwd_inner).
        block = block_at(block_list_ptr, first_block, i + 1, num_blocks, USE_LIST)
        s, k, kv_in_range = query_tile_scores(
            q, offs_m, offs_n, d_ok, start_n, k_ptrs, stride_k_n, mask_ptrs, stride_mask_n,
            bias_ptrs, stride_bias_n, seqlen_q, seqlen_k, qk_scale, HAS_MASK, HAS_BIAS,
            BIAS_ROW, CAUSAL_TILES, INTERIOR, DOT_PRECISION, WIDEN_DOTS)
        p = probs_from_lse(s, lse[:, None])
        v = tl.load(v_ptrs + start_n.to(tl.int64) * stride_v_n, mask=kv_in_range, other=0.0)
        dp = mma(do, tl.trans(v), DOT_PRECISION, WIDEN_DOTS)
        ds = p * (dp - delta[:, None])
        dq += mma(ds.to(k.dtype), k, DOT_PRECISION, WIDEN_DOTS)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dq_part_ptr,
    mask_ptr, bias_ptr, list_ptr,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n, mask_head_div,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n, bias_head_div,
    stride_list_b, stride_list_h, stride_list_m,
    stride_q_b, stride_q_m, stride_q_h,
    stride_k_b, stride_k_n, stride_k_h,
    stride_v_b, stride_v_n, stride_v_h,
    stride_do_b, stride_do_m, stride_do_h,
    stride_o_b, stride_o_m, stride_o_h,
    stride_dq_b, stride_dq_m, stride_dq_h,
    heads_q, group_size, seqlen_q, seqlen_k, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ROW: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    EDGE_SLOTS: tl.constexpr, SPLIT_KEYS: tl.constexpr,
):
    m_block = tl.program_id(0)
    start_m = m_block * BLOCK_M
    bh = tl.program_id(1)
    # Split-K (decode): axis 2 takes a contiguous share of this row block's key blocks (list
    # positions with a mask) and writes an fp32 partial; the merge kernel sums them in order.
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    b = bh // heads_q
    h = bh % heads_q

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < seqlen_q
    q_in_range = m_ok[:, None] & d_ok[None, :]
    q = tl.load(operand_base(q_ptr, b, h, 1, stride_q_b, stride_q_h)
                + tile_offsets(offs_m[:, None], offs_d[None, :], stride_q_m, 1),
                mask=q_in_range, other=0.0)
    do = tl.load(operand_base(do_ptr, b, h, 1, stride_do_b, stride_do_h)
                 + tile_offsets(offs_m[:, None], offs_d[None, :], stride_do_m, 1),
                 mask=q_in_range, other=0.0)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * seqlen_q + offs_m, mask=m_ok, other=0.0)
    # delta = rowsum(dO * O) is computed here rather than in a launch of its own (one launch
    # less of host time); the dkdv kernel, launched after this one, reads what share 0 stores.
    o = tl.load(operand_base(out_ptr, b, h, 1, stride_o_b, stride_o_h)
                + tile_offsets(offs_m[:, None], offs_d[None, :], stride_o_m, 1),
                mask=q_in_range, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if split == 0:
        tl.store(delta_ptr + bh.to(tl.int64) * seqlen_q + offs_m, delta, mask=m_ok)

    k_ptrs = operand_base(k_ptr, b, h, group_size, stride_k_b, stride_k_h) \
        + tile_offsets(offs_n0[:, None], offs_d[None, :], stride_k_n, 1)
    v_ptrs = operand_base(v_ptr, b, h, group_size, stride_v_b, stride_v_h) \
        + tile_offsets(offs_n0[:, None], offs_d[None, :], stride_v_n, 1)
    # Mask and bias rows past seqlen_q read the last row: interior tiles load unpredicated.
    safe_m = clamp_index(offs_m, seqlen_q)
    mask_ptrs = operand_base(mask_ptr, b, h, mask_head_div, stride_mask_b, stride_mask_h) \
        + tile_offsets(safe_m[:, None], offs_n0[None, :], stride_mask_m, stride_mask_n)
    if BIAS_ROW:  # one query row: address it once per tile (see load_bias)
        bias_rows = tl.zeros([1, 1], dtype=tl.int32)
    else:
        bias_rows = safe_m[:, None]
    bias_ptrs = operand_base(bias_ptr, b, h, bias_head_div, stride_bias_b, stride_bias_h) \
        + tile_offsets(bias_rows, offs_n0[None, :], stride_bias_m, stride_bias_n)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Key blocks [0, interior_end) need no per-pair range or causal test (as in the forward).
    num_full, num_blocks = causal_block_split(start_m, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k,
                                              IS_CAUSAL)
    interior_end = tl.minimum(num_full, seqlen_k // BLOCK_N)
    if HAS_MASK:
        # List positions: full tiles [0, full), partial interior [full, mid), edge [mid, count).
        block_list, count, full = block_list_row(
            list_ptr, stride_list_b, stride_list_h, stride_list_m, b, h, mask_head_div,
            m_block)
        _, mid = interior_span(block_list + full, count - full, 0, interior_end, EDGE_SLOTS)
        mid += full
        # This program's share [lo, hi) of the positions, cut into the three spans.
        lo, hi = split_share(count, split, num_splits)
        full = tl.minimum(tl.maximum(full, lo), hi)
        mid = tl.minimum(tl.maximum(mid, lo), hi)
        # Full tiles: every pair visible, so no mask read and no per-pair test.
        dq = _attn_bwd_dq_inner(
            dq, q, do, lse, delta, offs_m, offs_n0, d_ok, k_ptrs, v_ptrs,
            stride_k_n, stride_v_n, mask_ptrs, stride_mask_n, bias_ptrs, stride_bias_n,
            block_list + lo, 0, full - lo, seqlen_q, seqlen_k, qk_scale,
            BLOCK_N, False, HAS_BIAS, BIAS_ROW, False, True, True, DOT_PRECISION, WIDEN_DOTS)
        inner_list, inner_first, inner_count = block_list + full, 0, mid - full
        edge_list, edge_first, edge_count = block_list + mid, 0, hi - mid
    else:
        # The same two spans as ranges of key blocks (the list pointer is unused).
        lo, hi = split_share(num_blocks, split, num_splits)
        mid = tl.minimum(tl.maximum(interior_end, lo), hi)
        inner_list, inner_first, inner_count = list_ptr, lo, mid - lo
        edge_list, edge_first, edge_count = list_ptr, mid, hi - mid
    # Interior key blocks, then the causal diagonal and a partial last key block.
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse, delta, offs_m, offs_n0, d_ok, k_ptrs, v_ptrs,
        stride_k_n, stride_v_n, mask_ptrs, stride_mask_n, bias_ptrs, stride_bias_n,
        inner_list, inner_first, inner_count, seqlen_q, seqlen_k, qk_scale,
        BLOCK_N, HAS_MASK, HAS_BIAS, BIAS_ROW, False, HAS_MASK, True, DOT_PRECISION, WIDEN_DOTS)
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse, delta, offs_m, offs_n0, d_ok, k_ptrs, v_ptrs,
        stride_k_n, stride_v_n, mask_ptrs, stride_mask_n, bias_ptrs, stride_bias_n,
        edge_list, edge_first, edge_count, seqlen_q, seqlen_k, qk_scale,
        BLOCK_N, HAS_MASK, HAS_BIAS, BIAS_ROW, IS_CAUSAL, HAS_MASK, False, DOT_PRECISION,
        WIDEN_DOTS)

    dq *= sm_scale
    if SPLIT_KEYS:
        # Partials are (splits, B*Hq, Lq, BLOCK_D) fp32. Every share writes its rows, an empty
        # share zeros, so the merge kernel never reads an unwritten element.
        part_rows = (split * tl.num_programs(1) + bh).to(tl.int64) * seqlen_q + offs_m
        tl.store(dq_part_ptr + tile_offsets(part_rows[:, None], offs_d[None, :], BLOCK_D, 1),
                 dq, mask=m_ok[:, None])
    else:
        tl.store(operand_base(dq_ptr, b, h, 1, stride_dq_b, stride_dq_h)
                 + tile_offsets(offs_m[:, None], offs_d[None, :], stride_dq_m, 1),
                 dq.to(dq_ptr.dtype.element_ty), mask=q_in_range)


@dataclass(frozen=True)
class BackwardConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def backward_configs(block_d: int, dtype: torch.dtype, interpreted: bool,
                     seqlen_q: int) -> tuple[BackwardConfig, BackwardConfig]:
    """(dkdv, dq) tiles per head dim, from sweeps on an H100 (notes in results/notes.md).

    dkdv keeps a key block resident and walks query blocks; dq the reverse.
    """
    if interpreted:
        # Unequal tiles, so that the causal split logic is exercised with BLOCK_M != BLOCK_N.
        return BackwardConfig(16, 32, 4, 1), BackwardConfig(32, 16, 4, 1)
    if dtype == torch.float32:
        # fp32 tiles take twice the shared memory; fp32 is for accuracy checks, not speed.
        return BackwardConfig(32, 32, 4, 1), BackwardConfig(32, 32, 4, 1)
    if block_d <= 64:
        return BackwardConfig(64, 64, 4, 3), BackwardConfig(64, 64, 4, 3)
    if block_d <= 128:
        # dkdv: 64-key blocks give twice the programs of 128-key ones, which decides the
        # backward when B * Hk is small (B1 H8/2 L2048: 32 programs on 132 SMs), and 32 query
        # rows a shorter critical path; 32x64 with 4 warps beat 64x128 with 8 warps on every
        # probed case (change 17 in results/notes.md). Decode-sized Lq wastes less in 16 rows.
        dkdv = BackwardConfig(16 if seqlen_q <= 16 else 32, 64, 4, 3)
        return dkdv, BackwardConfig(64, 32, 4, 3)
    return BackwardConfig(32, 32, 4, 2), BackwardConfig(64, 16, 4, 2)


def configs_for(shape: AttnShape, dtype: torch.dtype) -> tuple[BackwardConfig, BackwardConfig]:
    """(dkdv, dq) configs for a problem of this shape and dtype."""
    return backward_configs(padded_head_dim(shape.head_dim), dtype,
                            is_interpreted(_attn_bwd_dq_kernel), shape.seqlen_q)


def backward_tiles(shape: AttnShape, dtype: torch.dtype) -> tuple:
    """The (query rows, key cols) tiles whose active-tile lists the backward walks: the forward
    builds its activity map fine enough for these too."""
    cfg_kv, cfg_q = configs_for(shape, dtype)
    return (cfg_kv.block_m, cfg_kv.block_n), (cfg_q.block_m, cfg_q.block_n)


def backward_lists(activity: ActivityMap | None, cfg_kv: BackwardConfig,
                   cfg_q: BackwardConfig) -> tuple[BlockLists | None, BlockLists | None]:
    """(dkdv lists, keys on rows; dq lists) from the activity map, or (None, None) without one."""
    if activity is None:
        return None, None
    return (activity.lists(cfg_kv.block_n, cfg_kv.block_m, transposed=True),
            activity.lists(cfg_q.block_m, cfg_q.block_n, transposed=False))


def prepare_backward_lists(activity: ActivityMap, shape: AttnShape, dtype: torch.dtype) -> None:
    """Build (and keep in ``activity``) both backward kernels' lists ahead of the call."""
    backward_lists(activity, *configs_for(shape, dtype))


def dq_key_splits(shape: AttnShape, cfg_q: BackwardConfig, device: torch.device) -> int:
    """How many key shares the dq kernel splits into (1: none), as the forward's split-K.

    A share gets at least 8 key blocks: dq's 32-key blocks are half the forward's 64, and a
    share of fewer than ~256 keys saves less GPU time than its partial buffer and merge launch
    cost on the host (seqlen L256: 8 blocks, so no split; results/notes.md, change 21).
    """
    programs = ceil_div(shape.seqlen_q, cfg_q.block_m) * shape.batch * shape.heads_q
    return key_splits(programs, ceil_div(shape.seqlen_k, cfg_q.block_n),
                      multiprocessors(device, is_interpreted(_attn_bwd_dq_kernel)), min_blocks=8)


class BackwardPlan:
    """The backward's launches for one forward plan and one gradient signature (grad_out's
    strides and dtype, ``deterministic``, whether the bias needs a gradient), worked out once:
    configs, lists, the bias-gradient plan, grids and every scalar argument. The forward plan
    keeps its backward plans, so a repeat backward only allocates and launches."""

    def __init__(self, fwd, grad_out, query, key, value, dq, dk, dv, deterministic: bool,
                 bias_needs_grad: bool):
        shape = fwd.shape
        block_d = padded_head_dim(shape.head_dim)
        interpreted = is_interpreted(_attn_bwd_dq_kernel)
        cfg_kv, cfg_q = configs_for(shape, fwd.dtype)
        self.device = fwd.device
        self.dbias = None
        if bias_needs_grad:
            self.dbias = plan_dbias(fwd.bias_shape, fwd.bias.head_div, shape, fwd.dtype,
                                    deterministic, interpreted)
        kv_lists, q_lists = backward_lists(fwd.activity, cfg_kv, cfg_q)
        self.kv_table = kv_lists.table if kv_lists is not None else None
        self.q_table = q_lists.table if q_lists is not None else None

        rows_grid = (ceil_div(shape.seqlen_q, cfg_q.block_m), shape.batch * shape.heads_q)
        operands = ((fwd.mask or ABSENT_OPERAND).as_args()
                    + (fwd.bias or ABSENT_OPERAND).as_args())
        inputs = (*strides3(query), *strides3(key), *strides3(value), *strides3(grad_out))
        sizes = (shape.heads_q, shape.group_size, shape.seqlen_q, shape.seqlen_k,
                 fwd.softmax_scale * LOG2E, fwd.softmax_scale)
        common = dict(HEAD_DIM=shape.head_dim, BLOCK_D=block_d,
                      HAS_MASK=fwd.mask is not None, HAS_BIAS=fwd.bias is not None,
                      BIAS_ROW=fwd.bias_one_row, IS_CAUSAL=fwd.is_causal,
                      **dot_options(fwd.dtype, interpreted))

        plan = self.dbias
        serialize_batch = bool(plan and plan.serialize_batch)
        serialize_heads = bool(plan and plan.serialize_heads)
        batches_per_launch = 1 if serialize_batch else shape.batch
        heads_per_launch = 1 if serialize_heads else shape.heads_kv
        # One launch, or one per colliding (batch, kv head) slice in a fixed order for a
        # deterministic gradient of a shared bias.
        self.dkdv = [
            PlannedLaunch(
                _attn_bwd_dkdv_kernel,
                (ceil_div(shape.seqlen_k, cfg_kv.block_n), batches_per_launch * heads_per_launch),
                (*operands, *(plan.target if plan else ABSENT_OPERAND).as_args(),
                 *block_list_strides(kv_lists, shape.batch), *inputs,
                 *strides3(dk), *strides3(dv), *sizes,
                 batch_start, head_start, heads_per_launch),
                BLOCK_M=cfg_kv.block_m, BLOCK_N=cfg_kv.block_n,
                HAS_DBIAS=plan is not None and not plan.is_zero,
                DBIAS_REDUCE_M=bool(plan and plan.reduce_m),
                DBIAS_SUM_GROUP=bool(plan and plan.sum_group),
                DBIAS_ACCUMULATE=bool(plan and plan.accumulate),
                DBIAS_ATOMIC=bool(plan and plan.atomic),
                EDGE_SLOTS=edge_slots(cfg_kv.block_n, cfg_kv.block_m),
                num_warps=cfg_kv.num_warps, num_stages=cfg_kv.num_stages, **common,
            )
            for batch_start in (range(shape.batch) if serialize_batch else (0,))
            for head_start in (range(shape.heads_kv) if serialize_heads else (0,))
        ]

        self.splits = dq_key_splits(shape, cfg_q, fwd.device)
        self.dq_part_shape = (self.splits, shape.batch * shape.heads_q, shape.seqlen_q, block_d)
        self.dq = PlannedLaunch(
            _attn_bwd_dq_kernel, rows_grid + (self.splits,),
            (*operands, *block_list_strides(q_lists, shape.batch), *inputs,
             *contiguous_strides(fwd.out_shape)[:3], *strides3(dq), *sizes),
            BLOCK_M=cfg_q.block_m, BLOCK_N=cfg_q.block_n,
            EDGE_SLOTS=edge_slots(cfg_q.block_m, cfg_q.block_n), SPLIT_KEYS=self.splits > 1,
            num_warps=cfg_q.num_warps, num_stages=cfg_q.num_stages, **common,
        )
        self.dq_merge = None
        if self.splits > 1:
            self.dq_merge = PlannedLaunch(
                _attn_bwd_dq_merge_kernel, rows_grid,
                (*strides3(dq), shape.heads_q, shape.seqlen_q, self.splits),
                HEAD_DIM=shape.head_dim, BLOCK_D=block_d, BLOCK_M=cfg_q.block_m,
            )

    def run(self, grad_out, query, key, value, out, lse, mask, bias, dq, dk, dv):
        """Fill ``dq``, ``dk``, ``dv``; return the bias gradient (or None)."""
        delta = torch.empty_like(lse)  # written by the dq kernel, read by dkdv
        mask, bias = operand_pointer(mask, lse), operand_pointer(bias, lse)
        dq_part = lse
        if self.dq_merge is not None:
            dq_part = torch.empty(self.dq_part_shape, dtype=torch.float32, device=self.device)
        self.dq(query, key, value, out, grad_out, lse, delta, dq, dq_part, mask, bias,
                lse if self.q_table is None else self.q_table)
        if self.dq_merge is not None:
            self.dq_merge(dq, dq_part)
        dbias = self.dbias.allocate(self.device) if self.dbias is not None else lse
        kv_table = lse if self.kv_table is None else self.kv_table
        for dkdv in self.dkdv:
            dkdv(query, key, value, grad_out, lse, delta, dk, dv, mask, bias, dbias, kv_table)
        return self.dbias.finish(dbias) if self.dbias is not None else None


def attention_backward(fwd, grad_out, query, key, value, out, lse, mask, bias,
                       deterministic: bool, bias_needs_grad: bool):
    """Launch the backward of a forward run with plan ``fwd`` (a ``forward.ForwardPlan``) on
    these saved tensors. Returns (dq, dk, dv, dbias or None).

    With a mask, both kernels' lists come from the forward's activity map (made fine enough
    for ``backward_tiles``), never from the mask itself.
    """
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    signature = (grad_out.stride(), grad_out.dtype, bool(deterministic), bool(bias_needs_grad))
    plan = fwd.backward_plans.get(signature)
    if plan is None:
        plan = BackwardPlan(fwd, grad_out, query, key, value, dq, dk, dv, deterministic,
                            bias_needs_grad)
        fwd.backward_plans[signature] = plan
    dbias = plan.run(grad_out, query, key, value, out, lse, mask, bias, dq, dk, dv)
    return dq, dk, dv, dbias
