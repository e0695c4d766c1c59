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

Every kernel takes its tensors as one pointer tuple (``planning.operands``: ``DqPointers``...),
the tensors' strides as one ``BackwardStrides``, the mask, bias, bias gradient and list tables
as one ``BackwardLayouts`` and the sizes as one ``Sizes``. DBIAS_MODE is the bias gradient's
``dbias_modes.DbiasMode`` code.

Scores and probabilities are rebuilt with the forward's helpers from the saved LSE. dkdv works
in the transposed (n, m) orientation so that its dots need no extra transposes of dS and P.
Axis letters: b batch, h head, m query position, n key position, d head dim.
"""

import triton
import triton.language as tl

from .backward_dkdv_kernels import attn_bwd_dkdv_program
from .dbias_modes import DQ_TILES, DQ_TILES_ATOMIC
from .partials import merge_shares, store_gradient_rows
from .score import (clamp_index, head_base, mma, probs_from_lse, query_tile_scores, seq_base,
                    tile_offsets, write_tile)
from .spans import (FULL, INNER, LEAD, SPAN_KINDS, TAIL, block_at, block_spans, dense_spans,
                    grid_position, interval_rows, span)


@triton.jit
def _attn_bwd_dq_inner(
    dq, q, do, lse, delta, offs_m, offs_n0, d_ok, m_ok, tiles, steps,
    block_list_ptr, first_block, num_blocks, seqlen_q, seqlen_k, qk_scale,
    BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_ROW: tl.constexpr, CAUSAL_TILES: tl.constexpr, USE_LIST: tl.constexpr,
    INTERIOR: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    DQ_DBIAS: tl.constexpr, DBIAS_ATOMIC: tl.constexpr,
):
    """Accumulate dq over key blocks, like ``_attn_fwd_inner`` (INTERIOR likewise); with
    DQ_DBIAS also write each dS tile, the full-size bias gradient's share (see ``_dbias``).
    ``tiles`` are the (K, V, mask, bias, dbias) tile pointers at key block 0, ``steps`` their
    strides along keys."""
    k_ptrs, v_ptrs, mask_ptrs, bias_ptrs, dbias_ptrs = tiles
    stride_k_n, stride_v_n, stride_mask_n, stride_bias_n, stride_db_n = steps
    block = block_at(block_list_ptr, first_block, 0, num_blocks, USE_LIST)
    for i in range(num_blocks):
        start_n = block * BLOCK_N
        offs_n = start_n + offs_n0
        # The next block's index one iteration ahead (see _attn_fwd_inner).
        block = block_at(block_list_ptr, first_block, i + 1, num_blocks, USE_LIST)
        s, k, kv_in_range = query_tile_scores(
            q, offs_m, offs_n, d_ok, start_n, k_ptrs, stride_k_n, mask_ptrs, stride_mask_n,
            bias_ptrs, stride_bias_n, seqlen_q, seqlen_k, qk_scale, HAS_MASK=HAS_MASK,
            HAS_BIAS=HAS_BIAS, BIAS_ROW=BIAS_ROW, CAUSAL_TILES=CAUSAL_TILES, INTERIOR=INTERIOR,
            DOT_PRECISION=DOT_PRECISION, WIDEN_DOTS=WIDEN_DOTS)
        p = probs_from_lse(s, lse[:, None])
        v = tl.load(v_ptrs + start_n.to(tl.int64) * stride_v_n, mask=kv_in_range, other=0.0)
        dp = mma(do, tl.trans(v), DOT_PRECISION, WIDEN_DOTS)
        ds = p * (dp - delta[:, None])
        dq += mma(ds.to(k.dtype), k, DOT_PRECISION, WIDEN_DOTS)
        if DQ_DBIAS:
            write_tile(dbias_ptrs + start_n.to(tl.int64) * stride_db_n, ds,
                       m_ok[:, None] & (offs_n < seqlen_k)[None, :], ACCUMULATE=DBIAS_ATOMIC,
                       ATOMIC=DBIAS_ATOMIC)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    ptrs, strides, layouts, sizes, qk_scale, sm_scale, chunk_rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ROW: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    EDGE_SLOTS: tl.constexpr, SPLIT_KEYS: tl.constexpr, DBIAS_MODE: tl.constexpr,
):
    """dq of one query block per program (``ptrs``: ``DqPointers``); it also stores delta
    for the dkdv launch."""
    # Split-K (decode): axis 2 takes a contiguous share of this row block's key blocks (list
    # positions with a mask) and writes an fp32 partial; the last share sums them in order.
    # Later query blocks see more keys under causal: they start first.
    row_blocks = tl.cdiv(sizes.seqlen_q, BLOCK_M)
    m_block, bh = grid_position(tl.program_id(0), row_blocks, chunk_rows, IS_CAUSAL)
    _attn_bwd_dq_program(
        m_block, bh, tl.program_id(2), tl.num_programs(2), tl.num_programs(0) // row_blocks,
        ptrs, strides, layouts, sizes, qk_scale, sm_scale,
        HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        HAS_MASK=HAS_MASK, HAS_BIAS=HAS_BIAS, BIAS_ROW=BIAS_ROW, IS_CAUSAL=IS_CAUSAL,
        DOT_PRECISION=DOT_PRECISION, WIDEN_DOTS=WIDEN_DOTS, EDGE_SLOTS=EDGE_SLOTS,
        SPLIT_KEYS=SPLIT_KEYS, STORE_DELTA=True, DBIAS_MODE=DBIAS_MODE)


@triton.jit
def _attn_bwd_dq_program(
    m_block, bh, split, num_splits, num_bh, ptrs, strides, layouts, sizes, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ROW: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    EDGE_SLOTS: tl.constexpr, SPLIT_KEYS: tl.constexpr, STORE_DELTA: tl.constexpr,
    DBIAS_MODE: tl.constexpr,
):
    """Query block ``m_block`` of (batch x q head) row ``bh`` of ``num_bh``, key share
    ``split`` of ``num_splits``. ``ptrs`` has the fields of ``DqPointers``."""
    # Full-size bias gradient tiles are dq's to write (see ``_dbias``), atomically where
    # several programs add into one element.
    DQ_DBIAS: tl.constexpr = (DBIAS_MODE == DQ_TILES) | (DBIAS_MODE == DQ_TILES_ATOMIC)
    DBIAS_ATOMIC: tl.constexpr = DBIAS_MODE == DQ_TILES_ATOMIC
    seqlen_q = sizes.seqlen_q
    seqlen_k = sizes.seqlen_k
    start_m = m_block * BLOCK_M
    b = bh // sizes.heads_q
    h = bh % sizes.heads_q

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < seqlen_q
    q_in_range = m_ok[:, None] & d_ok[None, :]
    q = tl.load(seq_base(ptrs.q, strides.q, b, h)
                + tile_offsets(offs_m[:, None], offs_d[None, :], strides.q.stride_l, 1),
                mask=q_in_range, other=0.0)
    do = tl.load(seq_base(ptrs.do, strides.do, b, h)
                 + tile_offsets(offs_m[:, None], offs_d[None, :], strides.do.stride_l, 1),
                 mask=q_in_range, other=0.0)
    lse = tl.load(ptrs.lse + bh.to(tl.int64) * seqlen_q + offs_m, mask=m_ok, other=0.0)
    # delta = rowsum(dO * O) is computed here rather than in a launch of its own (one launch
    # less of host time); the dkdv kernel, launched after this one, reads what share 0 stores.
    o = tl.load(seq_base(ptrs.out, strides.out, b, h)
                + tile_offsets(offs_m[:, None], offs_d[None, :], strides.out.stride_l, 1),
                mask=q_in_range, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if STORE_DELTA:
        if split == 0:
            tl.store(ptrs.delta + bh.to(tl.int64) * seqlen_q + offs_m, delta, mask=m_ok)

    kv_head = h // sizes.group_size
    k_ptrs = seq_base(ptrs.k, strides.k, b, kv_head) \
        + tile_offsets(offs_n0[:, None], offs_d[None, :], strides.k.stride_l, 1)
    v_ptrs = seq_base(ptrs.v, strides.v, b, kv_head) \
        + tile_offsets(offs_n0[:, None], offs_d[None, :], strides.v.stride_l, 1)
    # Mask and bias rows past seqlen_q read the last row: interior tiles load unpredicated.
    safe_m = clamp_index(offs_m, seqlen_q)
    if tl.constexpr(ptrs.mask.dtype.element_ty == tl.int64):  # KeyIntervals: one key vector
        mask_rows = interval_rows()
    else:
        mask_rows = safe_m[:, None]
    mask_ptrs = head_base(ptrs.mask, layouts.mask, b, h) \
        + tile_offsets(mask_rows, offs_n0[None, :], layouts.mask.stride_m,
                       layouts.mask.stride_n)
    if BIAS_ROW:  # one query row: address it once per tile (see load_bias)
        bias_rows = tl.zeros([1, 1], dtype=tl.int32)
    else:
        bias_rows = safe_m[:, None]
    bias_ptrs = head_base(ptrs.bias, layouts.bias, b, h) \
        + tile_offsets(bias_rows, offs_n0[None, :], layouts.bias.stride_m,
                       layouts.bias.stride_n)
    dbias_ptrs = head_base(ptrs.dbias, layouts.dbias, b, h) \
        + tile_offsets(offs_m[:, None], offs_n0[None, :], layouts.dbias.stride_m,
                       layouts.dbias.stride_n)
    tiles = (k_ptrs, v_ptrs, mask_ptrs, bias_ptrs, dbias_ptrs)
    steps = (strides.k.stride_l, strides.v.stride_l, layouts.mask.stride_n,
             layouts.bias.stride_n, layouts.dbias.stride_n)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dense = dense_spans(start_m, seqlen_q, seqlen_k, LOOP_ROWS=BLOCK_M, STEP_ROWS=BLOCK_N,
                        IS_CAUSAL=IS_CAUSAL, TRANSPOSED=False)
    span_list, spans = block_spans(
        dense, ptrs.q_lists, layouts.q_lists, layouts.mask.head_div, b, h, m_block, split,
        num_splits, HAS_MASK=HAS_MASK, EDGE_SLOTS=EDGE_SLOTS, TRANSPOSED=False)
    # The forward's walk: full tiles, interior key blocks, then the causal diagonal and a
    # partial last key block.
    for kind in tl.static_range(SPAN_KINDS):
        if (HAS_MASK or kind != FULL) and kind != LEAD:
            blocks, first, count = span(span_list, spans[kind], HAS_MASK)
            dq = _attn_bwd_dq_inner(
                dq, q, do, lse, delta, offs_m, offs_n0, d_ok, m_ok, tiles, steps, blocks,
                first, count, seqlen_q, seqlen_k, qk_scale, BLOCK_N=BLOCK_N,
                HAS_MASK=HAS_MASK and kind != FULL, HAS_BIAS=HAS_BIAS, BIAS_ROW=BIAS_ROW,
                CAUSAL_TILES=IS_CAUSAL and kind == TAIL, USE_LIST=HAS_MASK,
                INTERIOR=kind == FULL or kind == INNER, DOT_PRECISION=DOT_PRECISION,
                WIDEN_DOTS=WIDEN_DOTS, DQ_DBIAS=DQ_DBIAS, DBIAS_ATOMIC=DBIAS_ATOMIC)

    dq *= sm_scale
    store = True
    if SPLIT_KEYS:
        # Partials are (splits, B*Hq, Lq, BLOCK_D) fp32. Every share writes its rows, an empty
        # share zeros, and the last share of the row block to finish sums them in order.
        dq, store = merge_shares(ptrs.dq_part, ptrs.dq_counts
                                 + bh * tl.cdiv(seqlen_q, BLOCK_M) + m_block, dq, offs_m,
                                 m_ok, split, num_splits, bh, num_bh, seqlen_q, BLOCK_M,
                                 BLOCK_D)
    if store:
        store_gradient_rows(ptrs.dq, b, h, offs_m, dq, q_in_range, strides.dq.stride_b,
                            strides.dq.stride_l, strides.dq.stride_h, BLOCK_D)


@triton.jit
def attn_bwd_fused_kernel(
    ptrs, strides, layouts, sizes, qk_scale, sm_scale,
    dkdv_programs, head_shares, dq_row_blocks, num_bh, dq_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_BLOCK_M: tl.constexpr, KV_BLOCK_N: tl.constexpr,
    Q_BLOCK_M: tl.constexpr, Q_BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ROW: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    DBIAS_MODE: tl.constexpr, KV_EDGE_SLOTS: tl.constexpr, Q_EDGE_SLOTS: tl.constexpr,
    SPLIT_KEYS: tl.constexpr, SPLIT_HEADS: tl.constexpr, GROUP_ROWS: tl.constexpr,
):
    """The dkdv and dq programs of one backward in a single launch (``ptrs``:
    ``FusedPointers``), for grids too small to hide a launch's host time. The dkdv programs
    come first, as each walks every query block of its group and so runs longest. Neither side
    reads the other's output: each computes delta = rowsum(dO * O) itself. Split dkdv (head
    shares) and dq (key shares) programs merge their partials as in the separate launches."""
    pid = tl.program_id(0)
    if pid < dkdv_programs:
        key_blocks = tl.cdiv(sizes.seqlen_k, KV_BLOCK_N)
        row = pid // key_blocks
        attn_bwd_dkdv_program(
            pid % key_blocks, row // head_shares, row % head_shares, head_shares,
            dkdv_programs // key_blocks // head_shares, ptrs, strides, layouts, sizes,
            qk_scale, sm_scale, 0, 0, sizes.heads_q // sizes.group_size,
            HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=KV_BLOCK_M, BLOCK_N=KV_BLOCK_N,
            HAS_MASK=HAS_MASK, HAS_BIAS=HAS_BIAS, BIAS_ROW=BIAS_ROW, IS_CAUSAL=IS_CAUSAL,
            DOT_PRECISION=DOT_PRECISION, WIDEN_DOTS=WIDEN_DOTS, DBIAS_MODE=DBIAS_MODE,
            EDGE_SLOTS=KV_EDGE_SLOTS, DELTA_FROM_OUT=True, SPLIT_HEADS=SPLIT_HEADS,
            GROUP_ROWS=GROUP_ROWS)
    else:
        rest = pid - dkdv_programs
        m_block = rest % dq_row_blocks
        rest = rest // dq_row_blocks
        _attn_bwd_dq_program(
            m_block, rest % num_bh, rest // num_bh, dq_splits, num_bh, ptrs, strides, layouts,
            sizes, qk_scale, sm_scale,
            HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=Q_BLOCK_M, BLOCK_N=Q_BLOCK_N,
            HAS_MASK=HAS_MASK, HAS_BIAS=HAS_BIAS, BIAS_ROW=BIAS_ROW, IS_CAUSAL=IS_CAUSAL,
            DOT_PRECISION=DOT_PRECISION, WIDEN_DOTS=WIDEN_DOTS, EDGE_SLOTS=Q_EDGE_SLOTS,
            SPLIT_KEYS=SPLIT_KEYS, STORE_DELTA=False, DBIAS_MODE=DBIAS_MODE)
