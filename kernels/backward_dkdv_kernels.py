"""The dkdv kernel: dk, dv (and the bias gradient's one-row sums) of one key block per
program, in the transposed (n, m) orientation; ``backward_kernels`` describes the backward's
launches, and its fused kernel runs ``attn_bwd_dkdv_program`` beside the dq program.
Axis letters: b batch, h head, m query position, n key position, d head dim.
"""

import triton
import triton.language as tl

from ._partials import (last_share_arrived, store_gradient_rows, store_partial, sum_group_rows,
                        sum_partials)
from ._score import (block_at, block_list_row, causal_query_split, clamp_index, grid_position,
                     interior_span, load_bias, mma, operand_base, probs_from_lse, scores_log2,
                     tile_offsets, visible_keys, write_tile)


@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, dbias_col, k, v, offs_n, offs_m0, d_ok, n_ok,
    q_ptrs, do_ptrs, o_ptrs, stride_q_m, stride_do_m, stride_o_m,
    mask_ptrs, stride_mask_m, bias_ptrs, stride_bias_m, dbias_ptrs, stride_db_m,
    lse_ptr, delta_ptr, block_list_ptr, first_block, num_blocks,
    seqlen_q, seqlen_k, qk_scale,
    BLOCK_M: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_ROW: tl.constexpr, CAUSAL_TILES: tl.constexpr, USE_LIST: tl.constexpr,
    INTERIOR: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    HAS_DBIAS: tl.constexpr, DBIAS_REDUCE_M: tl.constexpr,
    DBIAS_ACCUMULATE: tl.constexpr, DELTA_FROM_OUT: tl.constexpr,
    MASK_KEYS_CLAMPED: tl.constexpr,
):
    """Accumulate one query head's contribution to a key block's dk, dv (and dbias).

    Works in the (n, m) orientation. Pointers address query block 0; blocks are
    ``first_block + i`` or the i-th entry of the transposed active-tile list. INTERIOR query
    blocks are whole and below the diagonal: no per-pair range or causal test, only the key
    range guards their mask and bias loads (key rows past seqlen_k are never stored).
    DELTA_FROM_OUT: delta = rowsum(dO * O) is computed here from the output tile instead of
    read from what the dq kernel stored (the fused launch, where dq runs alongside).
    MASK_KEYS_CLAMPED: the mask pointers' keys are clamped into range, so interior mask loads
    need no predicate (see ``attn_bwd_dkdv_program``); bias keys never are.
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
                                HAS_MASK, CAUSAL_TILES, INTERIOR,
                                GUARD_KEYS=not MASK_KEYS_CLAMPED)
        if INTERIOR:
            q_in_range = d_ok[None, :]
        else:
            q_in_range = m_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptrs + start_m.to(tl.int64) * stride_q_m, mask=q_in_range, other=0.0)
        bias = 0.0
        if HAS_BIAS:
            bias = load_bias(bias_ptrs + start_m.to(tl.int64) * stride_bias_m, keep,
                             n_ok[:, None], BIAS_ROW, INTERIOR, GUARD_KEYS=True)
        qk_t = mma(k, tl.trans(q), DOT_PRECISION, WIDEN_DOTS)
        s_t = scores_log2(qk_t, keep, bias, qk_scale, HAS_BIAS, HAS_MASK or not INTERIOR)
        p_t = probs_from_lse(s_t, tl.load(lse_ptr + offs_m, mask=m_ok, other=0.0)[None, :])
        do = tl.load(do_ptrs + start_m.to(tl.int64) * stride_do_m, mask=q_in_range, other=0.0)
        dv += mma(p_t.to(do.dtype), do, DOT_PRECISION, WIDEN_DOTS)
        dp_t = mma(v, tl.trans(do), DOT_PRECISION, WIDEN_DOTS)
        # dS = P * (dP - delta): the gradient of the (natural) score, bias included.
        if DELTA_FROM_OUT:
            o = tl.load(o_ptrs + start_m.to(tl.int64) * stride_o_m, mask=q_in_range, other=0.0)
            delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        else:
            delta = tl.load(delta_ptr + offs_m, mask=m_ok, other=0.0)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += mma(ds_t.to(q.dtype), q, DOT_PRECISION, WIDEN_DOTS)
        if HAS_DBIAS:
            if DBIAS_REDUCE_M:
                dbias_col += tl.sum(ds_t, 1)
            else:
                write_tile(dbias_ptrs + start_m.to(tl.int64) * stride_db_m, ds_t,
                           n_ok[:, None] & m_ok[None, :], DBIAS_ACCUMULATE, False)
    return dk, dv, dbias_col


@triton.jit
def attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dk_part_ptr, dv_part_ptr,
    mask_ptr, bias_ptr, dbias_ptr, list_ptr, count_ptr, dbias_sum_ptr,
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
    batch_start, head_start, heads_per_launch, chunk_rows, head_shares,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ROW: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    HAS_DBIAS: tl.constexpr, DBIAS_REDUCE_M: tl.constexpr, DBIAS_SUM_GROUP: tl.constexpr,
    DBIAS_ACCUMULATE: tl.constexpr, EDGE_SLOTS: tl.constexpr, SPLIT_HEADS: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
):
    """dk, dv (and dbias) of one key block per program, reading the delta dq stored. The
    output pointer and strides that only the fused launch reads are given dO's.

    SPLIT_HEADS: a grid row is a (pair, share) of ``head_shares`` shares of the GQA group's
    query heads, so that a grid of few (batch, kv head) pairs still fills the GPU; the shares'
    partials are summed within the launch (see ``attn_bwd_dkdv_program``)."""
    # Earlier key blocks see more queries under causal: n ascending is already longest first.
    key_blocks = tl.cdiv(seqlen_k, BLOCK_N)
    n_block, row = grid_position(tl.program_id(0), key_blocks, chunk_rows, False)
    attn_bwd_dkdv_program(
        n_block, row // head_shares, row % head_shares, head_shares,
        tl.num_programs(0) // key_blocks // head_shares,
        q_ptr, k_ptr, v_ptr, do_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
        dk_part_ptr, dv_part_ptr,
        mask_ptr, bias_ptr, dbias_ptr, list_ptr, count_ptr, dbias_sum_ptr,
        stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n, mask_head_div,
        stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n, bias_head_div,
        stride_db_b, stride_db_h, stride_db_m, stride_db_n, dbias_head_div,
        stride_list_b, stride_list_h, stride_list_n,
        stride_q_b, stride_q_m, stride_q_h, stride_k_b, stride_k_n, stride_k_h,
        stride_v_b, stride_v_n, stride_v_h, stride_do_b, stride_do_m, stride_do_h,
        stride_do_b, stride_do_m, stride_do_h,
        stride_dk_b, stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h,
        heads_q, group_size, seqlen_q, seqlen_k, qk_scale, sm_scale,
        batch_start, head_start, heads_per_launch,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, HAS_BIAS, BIAS_ROW, IS_CAUSAL,
        DOT_PRECISION, WIDEN_DOTS, HAS_DBIAS, DBIAS_REDUCE_M, DBIAS_SUM_GROUP,
        DBIAS_ACCUMULATE, EDGE_SLOTS, False, SPLIT_HEADS, GROUP_ROWS)


@triton.jit
def attn_bwd_dkdv_program(
    n_block, pair, share, num_shares, num_pairs,
    q_ptr, k_ptr, v_ptr, out_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    dk_part_ptr, dv_part_ptr,
    mask_ptr, bias_ptr, dbias_ptr, list_ptr, count_ptr, dbias_sum_ptr,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n, mask_head_div,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n, bias_head_div,
    stride_db_b, stride_db_h, stride_db_m, stride_db_n, dbias_head_div,
    stride_list_b, stride_list_h, stride_list_n,
    stride_q_b, stride_q_m, stride_q_h,
    stride_k_b, stride_k_n, stride_k_h,
    stride_v_b, stride_v_n, stride_v_h,
    stride_o_b, stride_o_m, stride_o_h,
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
    DBIAS_ACCUMULATE: tl.constexpr, EDGE_SLOTS: tl.constexpr, DELTA_FROM_OUT: tl.constexpr,
    SPLIT_HEADS: tl.constexpr, GROUP_ROWS: tl.constexpr,
):
    """Key block ``n_block`` of (batch, kv head) pair ``pair`` of the launch's ``num_pairs``,
    over share ``share`` of ``num_shares`` of its group's query heads.

    SPLIT_HEADS: each share writes fp32 partials of dk and dv, and the last share of the key
    block to finish sums them and stores dk and dv (``_partials``). GROUP_ROWS: the
    shares wrote a one-row bias gradient per query head (``dbias_ptr``, fp32 rows (B * Hq, Lk));
    that last share also sums its group's rows into row ``pair`` of ``dbias_sum_ptr``."""
    start_n = n_block * BLOCK_N
    # ``pair`` enumerates (batch, kv head) pairs of this launch; deterministic dbias for a
    # shared bias launches one slice at a time (batch_start / head_start) in a fixed order.
    b = batch_start + pair // heads_per_launch
    hk = head_start + pair % heads_per_launch

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
    # Query blocks [first, full_from) straddle the diagonal; [full_from, interior_end) need no
    # per-pair test; a partial last query block needs the range test again.
    first, full_from, num_blocks = causal_query_split(start_n, BLOCK_M, BLOCK_N, seqlen_q,
                                                      seqlen_k, IS_CAUSAL)
    interior_end = tl.maximum(seqlen_q // BLOCK_M, full_from)
    # One-row bias gradient: summed over queries here, and over the group's query heads too
    # when they share a gradient row (DBIAS_SUM_GROUP), so that no reduction follows.
    dbias_col = tl.zeros([BLOCK_N], dtype=tl.float32)
    # The key is the contiguous axis of these (n, m) tiles, unlike the (m, n) kernels' clamped
    # query rows, and a clamped index has no known contiguity: its loads are scalar. So bias
    # keys are never clamped, and interior loads are predicated on the key range instead
    # (GUARD_KEYS), which keeps them vectorized when seqlen_k is a multiple of 16. Mask keys
    # are clamped in one case: a one-row bias on a head-share grid, where the vectorized mask
    # made dkdv slower on the H100 (128 -> 178 us at B1 H8/2 L2048 topk; results/notes.md,
    # change 27), while every other case probed was as fast or faster (topk 112 -> 92 us).
    MASK_KEYS_CLAMPED: tl.constexpr = BIAS_ROW and SPLIT_HEADS
    if MASK_KEYS_CLAMPED:
        mask_keys = clamp_index(offs_n, seqlen_k)
    else:
        mask_keys = offs_n
    heads_per_share = group_size // num_shares
    for g in range(share * heads_per_share, (share + 1) * heads_per_share):
        h = hk * group_size + g
        bh = b * heads_q + h
        q_ptrs = operand_base(q_ptr, b, h, 1, stride_q_b, stride_q_h) \
            + tile_offsets(offs_m0[:, None], offs_d[None, :], stride_q_m, 1)
        do_ptrs = operand_base(do_ptr, b, h, 1, stride_do_b, stride_do_h) \
            + tile_offsets(offs_m0[:, None], offs_d[None, :], stride_do_m, 1)
        o_ptrs = operand_base(out_ptr, b, h, 1, stride_o_b, stride_o_h) \
            + tile_offsets(offs_m0[:, None], offs_d[None, :], stride_o_m, 1)
        mask_ptrs = operand_base(mask_ptr, b, h, mask_head_div, stride_mask_b, stride_mask_h) \
            + tile_offsets(mask_keys[:, None], offs_m0[None, :], stride_mask_n, stride_mask_m)
        bias_ptrs = operand_base(bias_ptr, b, h, bias_head_div, stride_bias_b, stride_bias_h) \
            + tile_offsets(offs_n[:, None], bias_cols, stride_bias_n, stride_bias_m)
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
                q_ptrs, do_ptrs, o_ptrs, stride_q_m, stride_do_m, stride_o_m, mask_ptrs,
                stride_mask_m,
                bias_ptrs, stride_bias_m, dbias_ptrs, stride_db_m, lse_row, delta_row,
                block_list, 0, full, seqlen_q, seqlen_k, qk_scale,
                BLOCK_M, False, HAS_BIAS, BIAS_ROW, False, True, True, DOT_PRECISION,
                WIDEN_DOTS, HAS_DBIAS, DBIAS_REDUCE_M, DBIAS_ACCUMULATE, DELTA_FROM_OUT,
                MASK_KEYS_CLAMPED)
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
            q_ptrs, do_ptrs, o_ptrs, stride_q_m, stride_do_m, stride_o_m, mask_ptrs,
            stride_mask_m,
            bias_ptrs, stride_bias_m, dbias_ptrs, stride_db_m, lse_row, delta_row,
            edge_list, edge_first, edge_count, seqlen_q, seqlen_k, qk_scale,
            BLOCK_M, HAS_MASK, HAS_BIAS, BIAS_ROW, IS_CAUSAL, HAS_MASK, False, DOT_PRECISION,
            WIDEN_DOTS, HAS_DBIAS, DBIAS_REDUCE_M, DBIAS_ACCUMULATE, DELTA_FROM_OUT,
            MASK_KEYS_CLAMPED)
        dk, dv, dbias_col = _attn_bwd_dkdv_inner(
            dk, dv, dbias_col, k, v, offs_n, offs_m0, d_ok, n_ok,
            q_ptrs, do_ptrs, o_ptrs, stride_q_m, stride_do_m, stride_o_m, mask_ptrs,
            stride_mask_m,
            bias_ptrs, stride_bias_m, dbias_ptrs, stride_db_m, lse_row, delta_row,
            inner_list, inner_first, inner_count, seqlen_q, seqlen_k, qk_scale,
            BLOCK_M, HAS_MASK, HAS_BIAS, BIAS_ROW, False, HAS_MASK, True, DOT_PRECISION,
            WIDEN_DOTS, HAS_DBIAS, DBIAS_REDUCE_M, DBIAS_ACCUMULATE, DELTA_FROM_OUT,
            MASK_KEYS_CLAMPED)
        dk, dv, dbias_col = _attn_bwd_dkdv_inner(
            dk, dv, dbias_col, k, v, offs_n, offs_m0, d_ok, n_ok,
            q_ptrs, do_ptrs, o_ptrs, stride_q_m, stride_do_m, stride_o_m, mask_ptrs,
            stride_mask_m,
            bias_ptrs, stride_bias_m, dbias_ptrs, stride_db_m, lse_row, delta_row,
            tail_list, tail_first, tail_count, seqlen_q, seqlen_k, qk_scale,
            BLOCK_M, HAS_MASK, HAS_BIAS, BIAS_ROW, False, HAS_MASK, False, DOT_PRECISION,
            WIDEN_DOTS, HAS_DBIAS, DBIAS_REDUCE_M, DBIAS_ACCUMULATE, DELTA_FROM_OUT,
            MASK_KEYS_CLAMPED)
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
    store = True
    if SPLIT_HEADS:
        # (shares, launch pairs, Lk, BLOCK_D) fp32 partials; the last share sums them.
        store_partial(dk_part_ptr, dk, offs_n, n_ok, share, pair, num_pairs, seqlen_k, BLOCK_D)
        store_partial(dv_part_ptr, dv, offs_n, n_ok, share, pair, num_pairs, seqlen_k, BLOCK_D)
        store = last_share_arrived(count_ptr + pair * tl.cdiv(seqlen_k, BLOCK_N) + n_block,
                                   num_shares)
        if store:
            dk = sum_partials(dk_part_ptr, offs_n, n_ok, pair, num_pairs, seqlen_k, num_shares,
                              BLOCK_N, BLOCK_D)
            dv = sum_partials(dv_part_ptr, offs_n, n_ok, pair, num_pairs, seqlen_k, num_shares,
                              BLOCK_N, BLOCK_D)
            if GROUP_ROWS:
                sum_group_rows(dbias_ptr, dbias_sum_ptr, pair, group_size, offs_n, n_ok,
                               seqlen_k, BLOCK_N)
    if store:
        store_gradient_rows(dk_ptr, b, hk, offs_n, dk, kv_in_range, stride_dk_b, stride_dk_n,
                            stride_dk_h, BLOCK_D)
        store_gradient_rows(dv_ptr, b, hk, offs_n, dv, kv_in_range, stride_dv_b, stride_dv_n,
                            stride_dv_h, BLOCK_D)
