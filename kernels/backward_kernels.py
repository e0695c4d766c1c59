"""The backward's dq and fused Triton kernels (dkdv's are in ``backward_dkdv_kernels``);
``backward`` plans and launches them.

Two launches, FlashAttention-2 style:
1. ``attn_bwd_dq_kernel``: one program per (query block, b, q head), looping over keys. It
   first computes delta = rowsum(dO * O), one fp32 per (b, hq, m), and stores it for dkdv. A
   grid too small to fill the GPU (decode) also splits the keys, as the forward does: each
   share writes an fp32 partial of dq, and the last share of a row block sums them in order.
2. ``attn_bwd_dkdv_kernel``: one program per (key block, b, kv head). It loops over the query
   heads of its GQA group and over query blocks, so dk and dv are reduced in registers: no
   atomics and no (B, Lk, Hq, D) temporary. A grid too small to fill the GPU splits the group's
   heads into shares instead, and the last share of a key block sums the shares' fp32
   partials in order (both merges: ``_partials``). It also sums the gradient of
   a one-row bias (B, H, 1, Lk). A full-size bias's gradient tiles are dS itself, and the dq
   kernel writes them (the dkdv kernel only when ``deterministic=True`` must add several in
   order; see ``_dbias``).
On small grids, where host time decides, ``attn_bwd_fused_kernel`` runs both kinds of program
in one launch, each computing delta itself.

Scores and probabilities are rebuilt with the forward's helpers from the saved LSE. dkdv works
in the transposed (n, m) orientation so that its dots need no extra transposes of dS and P.
Axis letters: b batch, h head, m query position, n key position, d head dim.
"""

import triton
import triton.language as tl

from ._partials import merge_shares, store_gradient_rows
from ._score import (block_at, block_list_row, causal_block_split, clamp_index, grid_position,
                     interior_span, mma, operand_base, probs_from_lse, query_tile_scores,
                     split_share, tile_offsets, write_tile)
from .backward_dkdv_kernels import attn_bwd_dkdv_program


@triton.jit
def _attn_bwd_dq_inner(
    dq, q, do, lse, delta, offs_m, offs_n0, d_ok,
    k_ptrs, v_ptrs, stride_k_n, stride_v_n,
    mask_ptrs, stride_mask_n, bias_ptrs, stride_bias_n, dbias_ptrs, stride_db_n, m_ok,
    block_list_ptr, first_block, num_blocks,
    seqlen_q, seqlen_k, qk_scale,
    BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_ROW: tl.constexpr, CAUSAL_TILES: tl.constexpr, USE_LIST: tl.constexpr,
    INTERIOR: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    DQ_DBIAS: tl.constexpr, DBIAS_ATOMIC: tl.constexpr,
):
    """Accumulate dq over key blocks, like ``_attn_fwd_inner`` (INTERIOR likewise); with
    DQ_DBIAS also write each dS tile, the full-size bias gradient's share (see ``_dbias``)."""
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
        if DQ_DBIAS:
            write_tile(dbias_ptrs + start_n.to(tl.int64) * stride_db_n, ds,
                       m_ok[:, None] & (offs_n < seqlen_k)[None, :], DBIAS_ATOMIC, DBIAS_ATOMIC)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dq_part_ptr,
    mask_ptr, bias_ptr, dbias_ptr, list_ptr, count_ptr,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n, mask_head_div,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n, bias_head_div,
    stride_db_b, stride_db_h, stride_db_m, stride_db_n, dbias_head_div,
    stride_list_b, stride_list_h, stride_list_m,
    stride_q_b, stride_q_m, stride_q_h,
    stride_k_b, stride_k_n, stride_k_h,
    stride_v_b, stride_v_n, stride_v_h,
    stride_do_b, stride_do_m, stride_do_h,
    stride_o_b, stride_o_m, stride_o_h,
    stride_dq_b, stride_dq_m, stride_dq_h,
    heads_q, group_size, seqlen_q, seqlen_k, qk_scale, sm_scale, chunk_rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ROW: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    EDGE_SLOTS: tl.constexpr, SPLIT_KEYS: tl.constexpr, DQ_DBIAS: tl.constexpr,
    DBIAS_ATOMIC: tl.constexpr,
):
    """dq of one query block per program; it also stores delta for the dkdv launch."""
    # Split-K (decode): axis 2 takes a contiguous share of this row block's key blocks (list
    # positions with a mask) and writes an fp32 partial; the last share sums them in order.
    # Later query blocks see more keys under causal: they start first.
    row_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    m_block, bh = grid_position(tl.program_id(0), row_blocks, chunk_rows, IS_CAUSAL)
    _attn_bwd_dq_program(
        m_block, bh, tl.program_id(2), tl.num_programs(2), tl.num_programs(0) // row_blocks,
        q_ptr, k_ptr, v_ptr, out_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dq_part_ptr,
        mask_ptr, bias_ptr, dbias_ptr, list_ptr, count_ptr,
        stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n, mask_head_div,
        stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n, bias_head_div,
        stride_db_b, stride_db_h, stride_db_m, stride_db_n, dbias_head_div,
        stride_list_b, stride_list_h, stride_list_m,
        stride_q_b, stride_q_m, stride_q_h, stride_k_b, stride_k_n, stride_k_h,
        stride_v_b, stride_v_n, stride_v_h, stride_do_b, stride_do_m, stride_do_h,
        stride_o_b, stride_o_m, stride_o_h, stride_dq_b, stride_dq_m, stride_dq_h,
        heads_q, group_size, seqlen_q, seqlen_k, qk_scale, sm_scale,
        HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, HAS_MASK, HAS_BIAS, BIAS_ROW, IS_CAUSAL,
        DOT_PRECISION, WIDEN_DOTS, EDGE_SLOTS, SPLIT_KEYS, True, DQ_DBIAS, DBIAS_ATOMIC)


@triton.jit
def _attn_bwd_dq_program(
    m_block, bh, split, num_splits, num_bh,
    q_ptr, k_ptr, v_ptr, out_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dq_part_ptr,
    mask_ptr, bias_ptr, dbias_ptr, list_ptr, count_ptr,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n, mask_head_div,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n, bias_head_div,
    stride_db_b, stride_db_h, stride_db_m, stride_db_n, dbias_head_div,
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
    EDGE_SLOTS: tl.constexpr, SPLIT_KEYS: tl.constexpr, STORE_DELTA: tl.constexpr,
    DQ_DBIAS: tl.constexpr, DBIAS_ATOMIC: tl.constexpr,
):
    """Query block ``m_block`` of (batch x q head) row ``bh`` of ``num_bh``, key share
    ``split`` of ``num_splits``."""
    start_m = m_block * BLOCK_M
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
    if STORE_DELTA:
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
    dbias_ptrs = operand_base(dbias_ptr, b, h, dbias_head_div, stride_db_b, stride_db_h) \
        + tile_offsets(offs_m[:, None], offs_n0[None, :], stride_db_m, stride_db_n)

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
            dbias_ptrs, stride_db_n, m_ok, block_list + lo, 0, full - lo, seqlen_q, seqlen_k,
            qk_scale, BLOCK_N, False, HAS_BIAS, BIAS_ROW, False, True, True, DOT_PRECISION,
            WIDEN_DOTS, DQ_DBIAS, DBIAS_ATOMIC)
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
        dbias_ptrs, stride_db_n, m_ok, inner_list, inner_first, inner_count, seqlen_q, seqlen_k,
        qk_scale, BLOCK_N, HAS_MASK, HAS_BIAS, BIAS_ROW, False, HAS_MASK, True, DOT_PRECISION,
        WIDEN_DOTS, DQ_DBIAS, DBIAS_ATOMIC)
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse, delta, offs_m, offs_n0, d_ok, k_ptrs, v_ptrs,
        stride_k_n, stride_v_n, mask_ptrs, stride_mask_n, bias_ptrs, stride_bias_n,
        dbias_ptrs, stride_db_n, m_ok, edge_list, edge_first, edge_count, seqlen_q, seqlen_k,
        qk_scale, BLOCK_N, HAS_MASK, HAS_BIAS, BIAS_ROW, IS_CAUSAL, HAS_MASK, False,
        DOT_PRECISION, WIDEN_DOTS, DQ_DBIAS, DBIAS_ATOMIC)

    dq *= sm_scale
    store = True
    if SPLIT_KEYS:
        # Partials are (splits, B*Hq, Lq, BLOCK_D) fp32. Every share writes its rows, an empty
        # share zeros, and the last share of the row block to finish sums them in order.
        dq, store = merge_shares(dq_part_ptr, count_ptr + bh * tl.cdiv(seqlen_q, BLOCK_M)
                                 + m_block, dq, offs_m, m_ok, split, num_splits, bh, num_bh,
                                 seqlen_q, BLOCK_M, BLOCK_D)
    if store:
        store_gradient_rows(dq_ptr, b, h, offs_m, dq, q_in_range, stride_dq_b, stride_dq_m,
                            stride_dq_h, BLOCK_D)


@triton.jit
def attn_bwd_fused_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, do_ptr, lse_ptr, dq_ptr, dq_part_ptr, dk_ptr, dv_ptr,
    dk_part_ptr, dv_part_ptr, mask_ptr, bias_ptr, dbias_ptr, q_list_ptr, kv_list_ptr,
    dq_count_ptr, kv_count_ptr, dbias_sum_ptr,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n, mask_head_div,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n, bias_head_div,
    stride_db_b, stride_db_h, stride_db_m, stride_db_n, dbias_head_div,
    stride_q_list_b, stride_q_list_h, stride_q_list_m,
    stride_kv_list_b, stride_kv_list_h, stride_kv_list_n,
    stride_q_b, stride_q_m, stride_q_h,
    stride_k_b, stride_k_n, stride_k_h,
    stride_v_b, stride_v_n, stride_v_h,
    stride_do_b, stride_do_m, stride_do_h,
    stride_o_b, stride_o_m, stride_o_h,
    stride_dq_b, stride_dq_m, stride_dq_h,
    stride_dk_b, stride_dk_n, stride_dk_h,
    stride_dv_b, stride_dv_n, stride_dv_h,
    heads_q, heads_kv, group_size, seqlen_q, seqlen_k, qk_scale, sm_scale,
    dkdv_programs, head_shares, dq_row_blocks, num_bh, dq_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_BLOCK_M: tl.constexpr, KV_BLOCK_N: tl.constexpr,
    Q_BLOCK_M: tl.constexpr, Q_BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ROW: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    HAS_DBIAS: tl.constexpr, DBIAS_REDUCE_M: tl.constexpr, DBIAS_SUM_GROUP: tl.constexpr,
    DBIAS_ACCUMULATE: tl.constexpr, DQ_DBIAS: tl.constexpr, DBIAS_ATOMIC: tl.constexpr,
    KV_EDGE_SLOTS: tl.constexpr, Q_EDGE_SLOTS: tl.constexpr, SPLIT_KEYS: tl.constexpr,
    SPLIT_HEADS: tl.constexpr, GROUP_ROWS: tl.constexpr,
):
    """The dkdv and dq programs of one backward in a single launch, for grids too small to
    hide a launch's host time (results/notes.md, change 23). The dkdv programs come first, as
    each walks every query block of its group and so runs longest. Neither side reads the
    other's output: each computes delta = rowsum(dO * O) itself. Split dkdv (head shares) and
    dq (key shares) programs merge their partials as in the separate launches."""
    pid = tl.program_id(0)
    if pid < dkdv_programs:
        key_blocks = tl.cdiv(seqlen_k, KV_BLOCK_N)
        row = pid // key_blocks
        attn_bwd_dkdv_program(
            pid % key_blocks, row // head_shares, row % head_shares, head_shares,
            dkdv_programs // key_blocks // head_shares,
            q_ptr, k_ptr, v_ptr, out_ptr, do_ptr, lse_ptr, lse_ptr, dk_ptr, dv_ptr,
            dk_part_ptr, dv_part_ptr,
            mask_ptr, bias_ptr, dbias_ptr, kv_list_ptr, kv_count_ptr, dbias_sum_ptr,
            stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n, mask_head_div,
            stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n, bias_head_div,
            stride_db_b, stride_db_h, stride_db_m, stride_db_n, dbias_head_div,
            stride_kv_list_b, stride_kv_list_h, stride_kv_list_n,
            stride_q_b, stride_q_m, stride_q_h, stride_k_b, stride_k_n, stride_k_h,
            stride_v_b, stride_v_n, stride_v_h, stride_o_b, stride_o_m, stride_o_h,
            stride_do_b, stride_do_m, stride_do_h,
            stride_dk_b, stride_dk_n, stride_dk_h, stride_dv_b, stride_dv_n, stride_dv_h,
            heads_q, group_size, seqlen_q, seqlen_k, qk_scale, sm_scale,
            0, 0, heads_kv,
            HEAD_DIM, BLOCK_D, KV_BLOCK_M, KV_BLOCK_N, HAS_MASK, HAS_BIAS, BIAS_ROW, IS_CAUSAL,
            DOT_PRECISION, WIDEN_DOTS, HAS_DBIAS, DBIAS_REDUCE_M, DBIAS_SUM_GROUP,
            DBIAS_ACCUMULATE, KV_EDGE_SLOTS, True, SPLIT_HEADS, GROUP_ROWS)
    else:
        rest = pid - dkdv_programs
        m_block = rest % dq_row_blocks
        rest = rest // dq_row_blocks
        _attn_bwd_dq_program(
            m_block, rest % num_bh, rest // num_bh, dq_splits, num_bh,
            q_ptr, k_ptr, v_ptr, out_ptr, do_ptr, lse_ptr, lse_ptr, dq_ptr, dq_part_ptr,
            mask_ptr, bias_ptr, dbias_ptr, q_list_ptr, dq_count_ptr,
            stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n, mask_head_div,
            stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n, bias_head_div,
            stride_db_b, stride_db_h, stride_db_m, stride_db_n, dbias_head_div,
            stride_q_list_b, stride_q_list_h, stride_q_list_m,
            stride_q_b, stride_q_m, stride_q_h, stride_k_b, stride_k_n, stride_k_h,
            stride_v_b, stride_v_n, stride_v_h, stride_do_b, stride_do_m, stride_do_h,
            stride_o_b, stride_o_m, stride_o_h, stride_dq_b, stride_dq_m, stride_dq_h,
            heads_q, group_size, seqlen_q, seqlen_k, qk_scale, sm_scale,
            HEAD_DIM, BLOCK_D, Q_BLOCK_M, Q_BLOCK_N, HAS_MASK, HAS_BIAS, BIAS_ROW, IS_CAUSAL,
            DOT_PRECISION, WIDEN_DOTS, Q_EDGE_SLOTS, SPLIT_KEYS, False, DQ_DBIAS, DBIAS_ATOMIC)
