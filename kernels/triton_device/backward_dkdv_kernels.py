"""The dkdv kernel: dk, dv (and the bias gradient's one-row sums) of one key block per
program, in the transposed (n, m) orientation; ``backward_kernels`` describes the backward's
launches, and its fused kernel runs ``attn_bwd_dkdv_program`` beside the dq program.
Arguments are grouped as there (``planning.operands``).
Axis letters: b batch, h head, m query position, n key position, d head dim.
"""

import triton
import triton.language as tl

from .dbias_modes import DKDV_GROUP_ROWS, DKDV_ROWS, DKDV_TILES_ORDERED
from .partials import (last_share_arrived, store_gradient_rows, store_partial, sum_group_rows,
                       sum_partials)
from .score import (clamp_index, head_base, load_bias, mma, probs_from_lse, scores_log2, seq_base,
                    tile_offsets, visible_keys, write_tile)
from .spans import (FULL, INNER, LEAD, SPAN_KINDS, block_at, block_spans, dense_spans,
                    grid_position, interval_rows, span)


@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, dbias_col, k, v, offs_n, offs_m0, d_ok, n_ok, tiles, steps, lse_ptr, delta_ptr,
    block_list_ptr, first_block, num_blocks, seqlen_q, seqlen_k, qk_scale,
    BLOCK_M: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_ROW: tl.constexpr, CAUSAL_TILES: tl.constexpr, USE_LIST: tl.constexpr,
    INTERIOR: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    HAS_DBIAS: tl.constexpr, DBIAS_REDUCE_M: tl.constexpr,
    DBIAS_ACCUMULATE: tl.constexpr, DELTA_FROM_OUT: tl.constexpr,
    MASK_KEYS_CLAMPED: tl.constexpr,
):
    """Accumulate one query head's contribution to a key block's dk, dv (and dbias).

    Works in the (n, m) orientation. ``tiles`` are the (q, dO, O, mask, bias, dbias) tile
    pointers at query block 0 and ``steps`` their strides along queries; blocks are
    ``first_block + i`` or the i-th entry of the transposed active-tile list. INTERIOR query
    blocks are whole and below the diagonal: no per-pair range or causal test, only the key
    range guards their mask and bias loads (key rows past seqlen_k are never stored).
    DELTA_FROM_OUT: delta = rowsum(dO * O) is computed here from the output tile instead of
    read from what the dq kernel stored (the fused launch, where dq runs alongside).
    MASK_KEYS_CLAMPED: the mask pointers' keys are clamped into range, so interior mask loads
    need no predicate (see ``attn_bwd_dkdv_program``); bias keys never are.
    """
    q_ptrs, do_ptrs, o_ptrs, mask_ptrs, bias_ptrs, dbias_ptrs = tiles
    stride_q_m, stride_do_m, stride_o_m, stride_mask_m, stride_bias_m, stride_db_m = steps
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
                                HAS_MASK=HAS_MASK, IS_CAUSAL=CAUSAL_TILES, INTERIOR=INTERIOR,
                                GUARD_KEYS=not MASK_KEYS_CLAMPED)
        if INTERIOR:
            q_in_range = d_ok[None, :]
        else:
            q_in_range = m_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptrs + start_m.to(tl.int64) * stride_q_m, mask=q_in_range, other=0.0)
        bias = 0.0
        if HAS_BIAS:
            bias = load_bias(bias_ptrs + start_m.to(tl.int64) * stride_bias_m, keep,
                             n_ok[:, None], BIAS_ROW=BIAS_ROW, INTERIOR=INTERIOR,
                             GUARD_KEYS=True)
        qk_t = mma(k, tl.trans(q), DOT_PRECISION, WIDEN_DOTS)
        s_t = scores_log2(qk_t, keep, bias, qk_scale, HAS_BIAS=HAS_BIAS,
                          APPLY_KEEP=HAS_MASK or not INTERIOR)
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
                           n_ok[:, None] & m_ok[None, :], ACCUMULATE=DBIAS_ACCUMULATE,
                           ATOMIC=False)
    return dk, dv, dbias_col




@triton.jit
def attn_bwd_dkdv_kernel(
    ptrs, strides, layouts, sizes, qk_scale, sm_scale,
    batch_start, head_start, heads_per_launch, chunk_rows, head_shares,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ROW: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    DBIAS_MODE: tl.constexpr, EDGE_SLOTS: tl.constexpr, SPLIT_HEADS: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
):
    """dk, dv (and dbias) of one key block per program (``ptrs``: ``DkdvPointers``), reading
    the delta dq stored.

    SPLIT_HEADS: a grid row is a (pair, share) of ``head_shares`` shares of the GQA group's
    query heads, so that a grid of few (batch, kv head) pairs still fills the GPU; the shares'
    partials are summed within the launch (see ``attn_bwd_dkdv_program``)."""
    # Earlier key blocks see more queries under causal: n ascending is already longest first.
    key_blocks = tl.cdiv(sizes.seqlen_k, BLOCK_N)
    n_block, row = grid_position(tl.program_id(0), key_blocks, chunk_rows, False)
    attn_bwd_dkdv_program(
        n_block, row // head_shares, row % head_shares, head_shares,
        tl.num_programs(0) // key_blocks // head_shares, ptrs, strides, layouts, sizes,
        qk_scale, sm_scale, batch_start, head_start, heads_per_launch,
        HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        HAS_MASK=HAS_MASK, HAS_BIAS=HAS_BIAS, BIAS_ROW=BIAS_ROW, IS_CAUSAL=IS_CAUSAL,
        DOT_PRECISION=DOT_PRECISION, WIDEN_DOTS=WIDEN_DOTS, DBIAS_MODE=DBIAS_MODE,
        EDGE_SLOTS=EDGE_SLOTS, DELTA_FROM_OUT=False, SPLIT_HEADS=SPLIT_HEADS,
        GROUP_ROWS=GROUP_ROWS)


@triton.jit
def attn_bwd_dkdv_program(
    n_block, pair, share, num_shares, num_pairs, ptrs, strides, layouts, sizes,
    qk_scale, sm_scale, batch_start, head_start, heads_per_launch,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ROW: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    DBIAS_MODE: tl.constexpr, EDGE_SLOTS: tl.constexpr, DELTA_FROM_OUT: tl.constexpr,
    SPLIT_HEADS: tl.constexpr, GROUP_ROWS: tl.constexpr,
):
    """Key block ``n_block`` of (batch, kv head) pair ``pair`` of the launch's ``num_pairs``,
    over share ``share`` of ``num_shares`` of its group's query heads. ``ptrs`` has the
    fields of ``DkdvPointers``.

    SPLIT_HEADS: each share writes fp32 partials of dk and dv, and the last share of the key
    block to finish sums them and stores dk and dv (``_partials``). GROUP_ROWS: the
    shares wrote a one-row bias gradient per query head (``ptrs.dbias``, fp32 rows
    (B * Hq, Lk)); that last share also sums its group's rows into row ``pair`` of
    ``ptrs.dbias_sum``."""
    # The bias-gradient modes dkdv writes (``_dbias``): one-row sums over queries (and over
    # the group when it shares a row), or full tiles added in order (deterministic).
    DBIAS_REDUCE_M: tl.constexpr = (DBIAS_MODE == DKDV_ROWS) | (DBIAS_MODE == DKDV_GROUP_ROWS)
    DBIAS_SUM_GROUP: tl.constexpr = DBIAS_MODE == DKDV_GROUP_ROWS
    DBIAS_ACCUMULATE: tl.constexpr = DBIAS_MODE == DKDV_TILES_ORDERED
    HAS_DBIAS: tl.constexpr = DBIAS_REDUCE_M | DBIAS_ACCUMULATE
    seqlen_q = sizes.seqlen_q
    seqlen_k = sizes.seqlen_k
    group_size = sizes.group_size
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
    k = tl.load(seq_base(ptrs.k, strides.k, b, hk)
                + tile_offsets(offs_n[:, None], offs_d[None, :], strides.k.stride_l, 1),
                mask=kv_in_range, other=0.0)
    v = tl.load(seq_base(ptrs.v, strides.v, b, hk)
                + tile_offsets(offs_n[:, None], offs_d[None, :], strides.v.stride_l, 1),
                mask=kv_in_range, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    if BIAS_ROW:  # one query row: address it once per tile (see load_bias)
        bias_cols = tl.zeros([1, 1], dtype=tl.int32)
    else:
        bias_cols = offs_m0[None, :]
    # The query blocks' spans before the mask: the same for every head of the group.
    dense = dense_spans(start_n, seqlen_q, seqlen_k, LOOP_ROWS=BLOCK_N, STEP_ROWS=BLOCK_M,
                        IS_CAUSAL=IS_CAUSAL, TRANSPOSED=True)
    # One-row bias gradient: summed over queries here, and over the group's query heads too
    # when they share a gradient row (DBIAS_SUM_GROUP), so that no reduction follows.
    dbias_col = tl.zeros([BLOCK_N], dtype=tl.float32)
    # The key is the contiguous axis of these (n, m) tiles, unlike the (m, n) kernels' clamped
    # query rows, and a clamped index has no known contiguity: its loads are scalar. So bias
    # keys are never clamped, and interior loads are predicated on the key range instead
    # (GUARD_KEYS), which keeps them vectorized when seqlen_k is a multiple of 16. Mask keys
    # are clamped in one case: a one-row bias on a head-share grid, where the vectorized mask
    # made dkdv slower on the H100 (128 -> 178 us at B1 H8/2 L2048 topk), while every other
    # case probed was as fast or faster (topk 112 -> 92 us).
    MASK_KEYS_CLAMPED: tl.constexpr = BIAS_ROW and SPLIT_HEADS
    if MASK_KEYS_CLAMPED:
        mask_keys = clamp_index(offs_n, seqlen_k)
    else:
        mask_keys = offs_n
    heads_per_share = group_size // num_shares
    for g in range(share * heads_per_share, (share + 1) * heads_per_share):
        h = hk * group_size + g
        bh = b * sizes.heads_q + h
        q_ptrs = seq_base(ptrs.q, strides.q, b, h) \
            + tile_offsets(offs_m0[:, None], offs_d[None, :], strides.q.stride_l, 1)
        do_ptrs = seq_base(ptrs.do, strides.do, b, h) \
            + tile_offsets(offs_m0[:, None], offs_d[None, :], strides.do.stride_l, 1)
        o_ptrs = seq_base(ptrs.out, strides.out, b, h) \
            + tile_offsets(offs_m0[:, None], offs_d[None, :], strides.out.stride_l, 1)
        if tl.constexpr(ptrs.mask.dtype.element_ty == tl.int64):  # KeyIntervals: one key vector
            mask_cols = interval_rows()
        else:
            mask_cols = offs_m0[None, :]
        mask_ptrs = head_base(ptrs.mask, layouts.mask, b, h) \
            + tile_offsets(mask_keys[:, None], mask_cols, layouts.mask.stride_n,
                           layouts.mask.stride_m)
        bias_ptrs = head_base(ptrs.bias, layouts.bias, b, h) \
            + tile_offsets(offs_n[:, None], bias_cols, layouts.bias.stride_n,
                           layouts.bias.stride_m)
        dbias_ptrs = head_base(ptrs.dbias, layouts.dbias, b, h) \
            + tile_offsets(offs_n[:, None], offs_m0[None, :], layouts.dbias.stride_n,
                           layouts.dbias.stride_m)
        tiles = (q_ptrs, do_ptrs, o_ptrs, mask_ptrs, bias_ptrs, dbias_ptrs)
        steps = (strides.q.stride_l, strides.do.stride_l, strides.out.stride_l,
                 layouts.mask.stride_m, layouts.bias.stride_m, layouts.dbias.stride_m)
        lse_row = ptrs.lse + bh.to(tl.int64) * seqlen_q
        delta_row = ptrs.delta + bh.to(tl.int64) * seqlen_q
        if not DBIAS_SUM_GROUP:
            dbias_col = tl.zeros([BLOCK_N], dtype=tl.float32)
        span_list, spans = block_spans(
            dense, ptrs.kv_lists, layouts.kv_lists, layouts.mask.head_div, b, h, n_block, 0, 1,
            HAS_MASK=HAS_MASK, EDGE_SLOTS=EDGE_SLOTS, TRANSPOSED=True)
        # Full tiles (every pair visible: no mask read, no per-pair test), blocks on the
        # causal diagonal, interior blocks, then a partial last query block.
        for kind in tl.static_range(SPAN_KINDS):
            if HAS_MASK or kind != FULL:
                blocks, first, count = span(span_list, spans[kind], HAS_MASK)
                dk, dv, dbias_col = _attn_bwd_dkdv_inner(
                    dk, dv, dbias_col, k, v, offs_n, offs_m0, d_ok, n_ok, tiles, steps,
                    lse_row, delta_row, blocks, first, count, seqlen_q, seqlen_k, qk_scale,
                    BLOCK_M=BLOCK_M, HAS_MASK=HAS_MASK and kind != FULL, HAS_BIAS=HAS_BIAS,
                    BIAS_ROW=BIAS_ROW, CAUSAL_TILES=IS_CAUSAL and kind == LEAD,
                    USE_LIST=HAS_MASK, INTERIOR=kind == FULL or kind == INNER,
                    DOT_PRECISION=DOT_PRECISION, WIDEN_DOTS=WIDEN_DOTS, HAS_DBIAS=HAS_DBIAS,
                    DBIAS_REDUCE_M=DBIAS_REDUCE_M, DBIAS_ACCUMULATE=DBIAS_ACCUMULATE,
                    DELTA_FROM_OUT=DELTA_FROM_OUT, MASK_KEYS_CLAMPED=MASK_KEYS_CLAMPED)
        if HAS_DBIAS and DBIAS_REDUCE_M and not DBIAS_SUM_GROUP:
            # Row (b, hq) of a (B, Hq, 1, Lk) buffer: a single writer, no atomics.
            tl.store(head_base(ptrs.dbias, layouts.dbias, b, h)
                     + offs_n.to(tl.int64) * layouts.dbias.stride_n,
                     dbias_col.to(ptrs.dbias.dtype.element_ty), mask=n_ok)
    if HAS_DBIAS and DBIAS_REDUCE_M and DBIAS_SUM_GROUP:
        # Row (b, hk) of a (B, Hk, 1, Lk) buffer, written once by this program.
        tl.store(head_base(ptrs.dbias, layouts.dbias, b, hk)
                 + offs_n.to(tl.int64) * layouts.dbias.stride_n,
                 dbias_col.to(ptrs.dbias.dtype.element_ty), mask=n_ok)

    # q.k was scaled in the forward, so dK picks up the scale once here.
    dk *= sm_scale
    store = True
    if SPLIT_HEADS:
        # (shares, launch pairs, Lk, BLOCK_D) fp32 partials; the last share sums them.
        store_partial(ptrs.dk_part, dk, offs_n, n_ok, share, pair, num_pairs, seqlen_k,
                      BLOCK_D)
        store_partial(ptrs.dv_part, dv, offs_n, n_ok, share, pair, num_pairs, seqlen_k,
                      BLOCK_D)
        store = last_share_arrived(ptrs.kv_counts + pair * tl.cdiv(seqlen_k, BLOCK_N)
                                   + n_block, num_shares)
        if store:
            dk = sum_partials(ptrs.dk_part, offs_n, n_ok, pair, num_pairs, seqlen_k,
                              num_shares, BLOCK_N, BLOCK_D)
            dv = sum_partials(ptrs.dv_part, offs_n, n_ok, pair, num_pairs, seqlen_k,
                              num_shares, BLOCK_N, BLOCK_D)
            if GROUP_ROWS:
                sum_group_rows(ptrs.dbias, ptrs.dbias_sum, pair, group_size, offs_n, n_ok,
                               seqlen_k, BLOCK_N)
    if store:
        store_gradient_rows(ptrs.dk, b, hk, offs_n, dk, kv_in_range, strides.dk.stride_b,
                            strides.dk.stride_l, strides.dk.stride_h, BLOCK_D)
        store_gradient_rows(ptrs.dv, b, hk, offs_n, dv, kv_in_range, strides.dv.stride_b,
                            strides.dv.stride_l, strides.dv.stride_h, BLOCK_D)
