"""The forward kernel.

Online softmax follows FlashAttention-2's names: ``m_i`` running row max (log2 domain), ``l_i``
running row sum of exp2(s - m_i), ``acc`` un-normalized output. Axis letters: b batch, h head,
m query position, n key position, d head dim.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._partials import last_share_arrived, split_rows, store_partial
from ._scratch import Scratch
from ._score import (LN2, block_at, block_list_row, causal_block_split, clamp_index,
                     grid_position, interior_span, mma, operand_base,
                     query_tile_scores, row_offsets, split_share, tile_offsets)


@triton.jit
def _attn_fwd_inner(
    acc, m_i, l_i, q, offs_m, offs_n0, d_ok,
    k_ptrs, v_ptrs, stride_k_n, stride_v_n,
    mask_ptrs, stride_mask_n, bias_ptrs, stride_bias_n,
    block_list_ptr, first_block, num_blocks,
    seqlen_q, seqlen_k, qk_scale,
    BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_ROW: tl.constexpr, CAUSAL_TILES: tl.constexpr, USE_LIST: tl.constexpr,
    INTERIOR: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
):
    """Fold ``num_blocks`` key blocks into the online softmax state.

    Pointers address key block 0. Blocks are ``first_block + i``, or with USE_LIST the i-th
    entry of the active-tile list, so a sparse mask walks only its active tiles, branch-free.
    The next block's index is read one iteration ahead so that tile addresses never wait on
    it. (Also carrying the next mask tile across iterations was measured 1.7x slower at
    L=16384, D=64: the int1 tile costs registers.)
    INTERIOR blocks lie inside both lengths and below the causal diagonal: no range or causal
    test per pair, only the mask (if any), read through row-clamped pointers.
    """
    block = block_at(block_list_ptr, first_block, 0, num_blocks, USE_LIST)
    for i in range(num_blocks):
        start_n = block * BLOCK_N
        offs_n = start_n + offs_n0
        block = block_at(block_list_ptr, first_block, i + 1, num_blocks, USE_LIST)
        s, k, kv_in_range = query_tile_scores(
            q, offs_m, offs_n, d_ok, start_n, k_ptrs, stride_k_n, mask_ptrs, stride_mask_n,
            bias_ptrs, stride_bias_n, seqlen_q, seqlen_k, qk_scale, HAS_MASK, HAS_BIAS,
            BIAS_ROW, CAUSAL_TILES, INTERIOR, DOT_PRECISION, WIDEN_DOTS)
        # -- update m_i, l_i; an all -inf row so far shifts by 0 instead of -inf (NaN guard)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs + start_n.to(tl.int64) * stride_v_n, mask=kv_in_range, other=0.0)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, WIDEN_DOTS)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, mask_ptr, bias_ptr, list_ptr,
    out_part_ptr, lse_part_ptr, count_ptr,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n, mask_head_div,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n, bias_head_div,
    stride_list_b, stride_list_h, stride_list_m,
    stride_q_b, stride_q_m, stride_q_h,
    stride_k_b, stride_k_n, stride_k_h,
    stride_v_b, stride_v_n, stride_v_h,
    stride_o_b, stride_o_m, stride_o_h,
    heads_q, group_size, seqlen_q, seqlen_k, qk_scale, chunk_rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_PACK: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ROW: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    SPLIT_KEYS: tl.constexpr, EDGE_SLOTS: tl.constexpr,
):
    # A tile has BLOCK_M rows. With GROUP_PACK = G > 1 (GQA), row r is query position
    # start_m + r // G of query head hx * G + r % G: the G heads sharing a KV head share one
    # program, so K, V and the (group-shared) mask are read once for all of them.
    QUERY_ROWS: tl.constexpr = BLOCK_M // GROUP_PACK
    # Later query blocks see more keys under causal: they start first (see grid_position).
    m_block, head_program = grid_position(tl.program_id(0), tl.cdiv(seqlen_q, QUERY_ROWS),
                                          chunk_rows, IS_CAUSAL)
    start_m = m_block * QUERY_ROWS
    heads_grid = heads_q // GROUP_PACK
    b = head_program // heads_grid
    first_head = (head_program % heads_grid) * GROUP_PACK
    # Split-K (decode): axis 2 cuts this row block's key blocks into contiguous shares.
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    rows = tl.arange(0, BLOCK_M)
    offs_m = start_m + rows // GROUP_PACK
    heads = first_head + rows % GROUP_PACK
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM  # folds away when HEAD_DIM == BLOCK_D
    row_ok = offs_m < seqlen_q

    q = tl.load(q_ptr + b.to(tl.int64) * stride_q_b
                + row_offsets(offs_m, heads, 1, stride_q_m, stride_q_h)[:, None] + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_ptrs = operand_base(k_ptr, b, first_head, group_size, stride_k_b, stride_k_h) \
        + tile_offsets(offs_n0[:, None], offs_d[None, :], stride_k_n, 1)
    v_ptrs = operand_base(v_ptr, b, first_head, group_size, stride_v_b, stride_v_h) \
        + tile_offsets(offs_n0[:, None], offs_d[None, :], stride_v_n, 1)
    # Mask and bias rows past seqlen_q read the last row: interior tiles load unpredicated.
    safe_m = clamp_index(offs_m, seqlen_q)
    mask_ptrs = mask_ptr + b.to(tl.int64) * stride_mask_b \
        + row_offsets(safe_m, heads, mask_head_div, stride_mask_m, stride_mask_h)[:, None] \
        + offs_n0.to(tl.int64)[None, :] * stride_mask_n
    if BIAS_ROW:  # one query row shared by the tile's heads: address it once (see load_bias)
        bias_rows = operand_base(bias_ptr, b, first_head, bias_head_div, stride_bias_b,
                                 stride_bias_h) + tl.zeros([1, 1], dtype=tl.int64)
    else:
        bias_rows = bias_ptr + b.to(tl.int64) * stride_bias_b \
            + row_offsets(safe_m, heads, bias_head_div, stride_bias_m, stride_bias_h)[:, None]
    bias_ptrs = bias_rows + offs_n0.to(tl.int64)[None, :] * stride_bias_n

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Key blocks [0, interior_end) need no per-pair range or causal test; the rest (the
    # diagonal band and a partial last block) do. Split-K shares [lo, hi) cut across both.
    num_full, num_blocks = causal_block_split(start_m, QUERY_ROWS, BLOCK_N, seqlen_q, seqlen_k,
                                              IS_CAUSAL)
    interior_end = tl.minimum(num_full, seqlen_k // BLOCK_N)
    if HAS_MASK:
        # Causal is already folded into the lists. When packed, the host guarantees that the
        # tile's heads share one mask head. List positions: [0, full) full tiles (no mask
        # read), then partial tiles, interior ones [full, mid) before edge ones [mid, count).
        block_list, count, full = block_list_row(
            list_ptr, stride_list_b, stride_list_h, stride_list_m, b, first_head,
            mask_head_div, m_block)
        _, mid = interior_span(block_list + full, count - full, 0, interior_end, EDGE_SLOTS)
        mid += full
        # Split-K: this program's share [lo, hi) of the positions, cut into the three spans.
        lo, hi = split_share(count, split, num_splits)
        full = tl.minimum(tl.maximum(full, lo), hi)
        mid = tl.minimum(tl.maximum(mid, lo), hi)
        # Full tiles: every pair visible, so no mask read and no per-pair test.
        acc, m_i, l_i = _attn_fwd_inner(
            acc, m_i, l_i, q, offs_m, offs_n0, d_ok, k_ptrs, v_ptrs, stride_k_n, stride_v_n,
            mask_ptrs, stride_mask_n, bias_ptrs, stride_bias_n,
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
    acc, m_i, l_i = _attn_fwd_inner(
        acc, m_i, l_i, q, offs_m, offs_n0, d_ok, k_ptrs, v_ptrs, stride_k_n, stride_v_n,
        mask_ptrs, stride_mask_n, bias_ptrs, stride_bias_n,
        inner_list, inner_first, inner_count, seqlen_q, seqlen_k, qk_scale,
        BLOCK_N, HAS_MASK, HAS_BIAS, BIAS_ROW, False, HAS_MASK, True, DOT_PRECISION, WIDEN_DOTS)
    acc, m_i, l_i = _attn_fwd_inner(
        acc, m_i, l_i, q, offs_m, offs_n0, d_ok, k_ptrs, v_ptrs, stride_k_n, stride_v_n,
        mask_ptrs, stride_mask_n, bias_ptrs, stride_bias_n,
        edge_list, edge_first, edge_count, seqlen_q, seqlen_k, qk_scale,
        BLOCK_N, HAS_MASK, HAS_BIAS, BIAS_ROW, IS_CAUSAL, HAS_MASK, False, DOT_PRECISION,
        WIDEN_DOTS)

    # Rows that saw no key: l_i == 0, m_i == -inf -> output 0 and LSE -inf, never 0/0.
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    # LSE rows of (B, Hq, Lq). The row predicate keeps a partial last block from writing into
    # the next head's rows (the LSE race seen in other Triton attention ports).
    bh = b * heads_q + heads  # each row's (batch x head) row
    lse_rows = bh.to(tl.int64) * seqlen_q + offs_m
    store = True
    if SPLIT_KEYS:
        # Partials are (splits, B*Hq, Lq, BLOCK_D) fp32 (and (splits, B*Hq, Lq) for the LSE);
        # the last split of the tile to finish combines them (``_partials``).
        num_bh = tl.num_programs(0) // tl.cdiv(seqlen_q, QUERY_ROWS) * GROUP_PACK
        store_partial(out_part_ptr, out, offs_m, row_ok, split, bh, num_bh, seqlen_q, BLOCK_D)
        tl.store(lse_part_ptr + split_rows(split, bh, num_bh, seqlen_q) + offs_m, lse,
                 mask=row_ok)
        store = last_share_arrived(count_ptr + tl.program_id(0), num_splits)
        if store:
            out, lse = _combine_splits(out_part_ptr, lse_part_ptr, offs_m, row_ok, bh, num_bh,
                                       seqlen_q, num_splits, BLOCK_M, BLOCK_D)
    if store:
        tl.store(out_ptr + b.to(tl.int64) * stride_o_b
                 + row_offsets(offs_m, heads, 1, stride_o_m, stride_o_h)[:, None]
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + lse_rows, lse, mask=row_ok)


@triton.jit
def _combine_splits(out_part_ptr, lse_part_ptr, offs_m, row_ok, bh, num_bh, seqlen_q,
                    num_splits, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """(out, lse) of rows ``offs_m`` of (batch x head) rows ``bh`` merged over the key splits'
    partials (laid out as ``_partials.split_rows`` says): out = sum_s exp(lse_s - lse) * out_s,
    lse = logsumexp_s lse_s."""
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(lse_part_ptr + split_rows(s, bh, num_bh, seqlen_q) + offs_m,
                                  mask=row_ok, other=float("-inf"), cache_modifier=".cg"))
    m_shift = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: weights stay 0
    weight_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s in range(num_splits):
        rows = split_rows(s, bh, num_bh, seqlen_q) + offs_m
        w = tl.exp(tl.load(lse_part_ptr + rows, mask=row_ok, other=float("-inf"),
                           cache_modifier=".cg") - m_shift)
        part = tl.load(out_part_ptr + tile_offsets(rows[:, None], offs_d[None, :], BLOCK_D, 1),
                       mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
        weight_sum += w
        acc += w[:, None] * part
    empty = weight_sum == 0.0
    out = acc / tl.where(empty, 1.0, weight_sum)[:, None]
    lse = tl.where(empty, float("-inf"), m_shift + tl.log(tl.where(empty, 1.0, weight_sum)))
    return out, lse
