"""The backward of a few query rows per GQA group (decode), as one launch that reads K and V once.

The general backward runs dq programs (query blocks, walking keys) and dkdv programs (key
blocks, walking query blocks), so each reads K and V once: twice in all. With Lq = 1 there is
little to compute besides those reads and the dk, dv writes, so the second read is a third of
the backward's bytes (at B1 H32/8 Lk 65536 D128: 805 MB, and 537 MB read once; the general path
took 770 us on an H100, this one 203). Here, as in the
forward's GROUP_PACK tiles, a tile's rows are every (query position, query head) of one GQA
group: row r is query position r // G of query head hk * G + r % G. One program owns a share
of the key blocks of one (batch, kv head): for each block it forms scores, probabilities and
dS for all of the group's rows at once, stores that block's dk and dv whole (no other program
touches them, so no partials) and adds the block's part of dq to a register tile. Key shares
merge their dq partials as the split backward does (``_partials``): the last share
of a group to arrive sums them in share order, so results are bitwise reproducible.

A mask is read densely, a tile per key block, rather than through the active-tile lists: keys
that no row keeps skip their K and V reads and store zero dk and dv. Where a prepared mask
leaves at most half the key blocks live, the launch instead branches around whole dead blocks
(SKIP_DEAD_BLOCKS, ``backward_schedule.skips_dead_blocks``). A bias is added as in the forward,
and its gradient (dS) is stored per key block by the one program that owns it (the PACKED_* modes
of ``dbias_modes.DbiasMode``); a bias whose gradient would sum some but not all of a tile's rows
(with G > 1 and Lq > 1: a (B, Hk, Lq, Lk) bias, or a (B, Hq, 1, Lk) one) keeps the general
path (``backward_schedule.takes_packed``).
"""

import triton
import triton.language as tl

from .dbias_modes import PACKED_ROWS, PACKED_SUMMED_ROWS
from .partials import merge_shares
from .score import (clamp_index, head_base, load_bias, mma, probs_from_lse, row_offsets,
                    scores_log2, seq_base, tile_offsets, visible_keys)
from .spans import INNER, TAIL, block_spans, dense_spans


@triton.jit
def _group_rows(ptr, b, offs_m, heads, strides):
    """Pointers to the packed rows (query position ``offs_m``, head ``heads``) of batch ``b``
    of a tensor with (batch, position, head) ``strides``, shaped [rows, 1] for a tile's column
    offsets."""
    stride_b, stride_m, stride_h = strides
    return ptr + b.to(tl.int64) * stride_b \
        + row_offsets(offs_m, heads, 1, stride_m, stride_h)[:, None]


@triton.jit
def _layout_rows(ptr, layout, b, offs_m, heads):
    """``_group_rows`` of a broadcast operand of ``layout`` (``operands.Layout``)."""
    return _group_rows(ptr, b, offs_m, heads // layout.head_div,
                       (layout.stride_b, layout.stride_m, layout.stride_h))


@triton.jit
def attn_bwd_packed_kernel(
    ptrs, strides, layouts, sizes, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ROW: tl.constexpr,
    DBIAS_MODE: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDEN_DOTS: tl.constexpr, SPLIT_KEYS: tl.constexpr, SKIP_DEAD_BLOCKS: tl.constexpr,
):
    """dk and dv of key share ``program_id(0)`` of (batch, kv head) ``program_id(1)``, its
    part of the group's dq, and its key blocks' part of the bias gradient. ``ptrs`` is a
    ``operands.PackedPointers``; DBIAS_MODE the ``dbias_modes.DbiasMode`` code."""
    DBIAS_SUM_ROWS: tl.constexpr = DBIAS_MODE == PACKED_SUMMED_ROWS
    DBIAS_PER_ROW: tl.constexpr = DBIAS_MODE == PACKED_ROWS
    seqlen_q = sizes.seqlen_q
    seqlen_k = sizes.seqlen_k
    group_size = sizes.group_size
    heads_q = sizes.heads_q
    split = tl.program_id(0)
    num_splits = tl.num_programs(0)
    pair = tl.program_id(1)
    num_pairs = tl.num_programs(1)
    heads_kv = heads_q // group_size
    b = pair // heads_kv
    first_head = (pair % heads_kv) * group_size

    rows = tl.arange(0, BLOCK_M)
    offs_m = rows // group_size
    heads = first_head + rows % group_size
    row_ok = offs_m < seqlen_q
    # Mask and bias rows past seqlen_q read the last row (never used: those rows score -inf).
    safe_m = clamp_index(offs_m, seqlen_q)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    in_range = row_ok[:, None] & d_ok[None, :]
    q = tl.load(_group_rows(ptrs.q, b, offs_m, heads, strides.q)
                + offs_d[None, :], mask=in_range, other=0.0)
    do = tl.load(_group_rows(ptrs.do, b, offs_m, heads, strides.do)
                 + offs_d[None, :], mask=in_range, other=0.0)
    o = tl.load(_group_rows(ptrs.out, b, offs_m, heads, strides.out)
                + offs_d[None, :], mask=in_range, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(ptrs.lse + (b * heads_q + heads).to(tl.int64) * seqlen_q + offs_m, mask=row_ok,
                  other=0.0)

    kv_head = pair % heads_kv
    k_ptrs = seq_base(ptrs.k, strides.k, b, kv_head) \
        + tile_offsets(offs_n0[:, None], offs_d[None, :], strides.k.stride_l, 1)
    v_ptrs = seq_base(ptrs.v, strides.v, b, kv_head) \
        + tile_offsets(offs_n0[:, None], offs_d[None, :], strides.v.stride_l, 1)
    dk_ptrs = seq_base(ptrs.dk, strides.dk, b, kv_head) \
        + tile_offsets(offs_n0[:, None], offs_d[None, :], strides.dk.stride_l, 1)
    dv_ptrs = seq_base(ptrs.dv, strides.dv, b, kv_head) \
        + tile_offsets(offs_n0[:, None], offs_d[None, :], strides.dv.stride_l, 1)
    key_cols = offs_n0.to(tl.int64)[None, :]
    mask_layout, bias_layout, dbias_layout = layouts.mask, layouts.bias, layouts.dbias
    mask_ptrs = _layout_rows(ptrs.mask, mask_layout, b, safe_m, heads) \
        + key_cols * mask_layout.stride_n
    if BIAS_ROW:  # one bias row for the whole tile: addressed once (see ``load_bias``)
        bias_ptrs = head_base(ptrs.bias, bias_layout, b, first_head) \
            + key_cols * bias_layout.stride_n
    else:
        bias_ptrs = _layout_rows(ptrs.bias, bias_layout, b, safe_m, heads) \
            + key_cols * bias_layout.stride_n
    if DBIAS_SUM_ROWS:  # the (batch, kv head)'s one gradient row
        dbias_ptrs = head_base(ptrs.dbias, dbias_layout, b, first_head) \
            + key_cols * dbias_layout.stride_n
    else:  # a gradient row per tile row
        dbias_ptrs = _layout_rows(ptrs.dbias, dbias_layout, b, safe_m, heads) \
            + key_cols * dbias_layout.stride_n

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # The walk is this program's share of the key blocks, dense: every key is tested per pair
    # (the tile's rows are several queries and heads, so no block is interior to all of them).
    dense = dense_spans(0, seqlen_q, seqlen_k, LOOP_ROWS=BLOCK_M, STEP_ROWS=BLOCK_N,
                        IS_CAUSAL=False, TRANSPOSED=False)
    _, spans = block_spans(dense, ptrs.mask, layouts.kv_lists, 1, b, first_head, 0, split,
                           num_splits, HAS_MASK=False, EDGE_SLOTS=1, TRANSPOSED=False)
    for block in range(spans[INNER][0], spans[TAIL][1]):  # the inner and tail spans as one
        start_n = block * BLOCK_N
        offs_n = start_n + offs_n0
        keys_ok = (offs_n < seqlen_k)[None, :]
        # Rows past Lq, keys past Lk and masked pairs score -inf, so they add nothing below.
        keep = visible_keys(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k,
                            mask_ptrs + start_n.to(tl.int64) * mask_layout.stride_n,
                            HAS_MASK=HAS_MASK, IS_CAUSAL=IS_CAUSAL)
        kv_in_range = (offs_n[:, None] < seqlen_k) & d_ok[None, :]
        live = True
        if SKIP_DEAD_BLOCKS:
            live = tl.max(tl.max(keep.to(tl.int32), 1), 0) > 0
        if live:
            if HAS_MASK and not SKIP_DEAD_BLOCKS:
                # Keys that no row keeps skip their K and V reads (a topk mask keeps few keys
                # per block). The predicate is constant along D, so the loads stay vectorized.
                # Such keys' dk and dv come out zero and are stored all the same: no other
                # program writes them.
                kv_read = kv_in_range & (tl.max(keep.to(tl.int32), 0) > 0)[:, None]
            else:
                kv_read = kv_in_range
            k = tl.load(k_ptrs + start_n.to(tl.int64) * strides.k.stride_l, mask=kv_read, other=0.0)
            v = tl.load(v_ptrs + start_n.to(tl.int64) * strides.v.stride_l, mask=kv_read, other=0.0)
            bias = 0.0
            if HAS_BIAS:
                bias = load_bias(bias_ptrs + start_n.to(tl.int64) * bias_layout.stride_n, keep,
                                 keys_ok, BIAS_ROW=BIAS_ROW)
            s = scores_log2(mma(q, tl.trans(k), DOT_PRECISION, WIDEN_DOTS), keep, bias,
                            qk_scale, HAS_BIAS=HAS_BIAS)
            p = probs_from_lse(s, lse[:, None])
            dp = mma(do, tl.trans(v), DOT_PRECISION, WIDEN_DOTS)
            ds = p * (dp - delta[:, None])
            dv = mma(tl.trans(p.to(do.dtype)), do, DOT_PRECISION, WIDEN_DOTS)
            dk = mma(tl.trans(ds.to(q.dtype)), q, DOT_PRECISION, WIDEN_DOTS) * sm_scale
            dq += mma(ds.to(k.dtype), k, DOT_PRECISION, WIDEN_DOTS)
        else:
            # A block that no row keeps: no K or V read, no dots; its keys' gradients are 0.
            ds = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        tl.store(dk_ptrs + start_n.to(tl.int64) * strides.dk.stride_l,
                 dk.to(ptrs.dk.dtype.element_ty), mask=kv_in_range)
        tl.store(dv_ptrs + start_n.to(tl.int64) * strides.dv.stride_l,
                 dv.to(ptrs.dv.dtype.element_ty), mask=kv_in_range)
        # The bias gradient is dS itself (the bias adds to the scaled scores).
        if DBIAS_SUM_ROWS:
            tl.store(dbias_ptrs + start_n.to(tl.int64) * dbias_layout.stride_n,
                     tl.sum(ds, 0)[None, :].to(ptrs.dbias.dtype.element_ty), mask=keys_ok)
        if DBIAS_PER_ROW:
            tl.store(dbias_ptrs + start_n.to(tl.int64) * dbias_layout.stride_n,
                     ds.to(ptrs.dbias.dtype.element_ty), mask=row_ok[:, None] & keys_ok)

    dq *= sm_scale
    store = True
    if SPLIT_KEYS:
        # Partials are (splits, B * Hk, BLOCK_M, BLOCK_D) fp32, one tile per share and group.
        dq, store = merge_shares(ptrs.dq_part, ptrs.counts + pair, dq, rows, row_ok, split,
                                 num_splits, pair, num_pairs, BLOCK_M, BLOCK_M, BLOCK_D)
    if store:
        tl.store(_group_rows(ptrs.dq, b, offs_m, heads, strides.dq) + offs_d[None, :],
                 dq.to(ptrs.dq.dtype.element_ty), mask=in_range)


# Rows of a packed tile: Lq * G up to this many use the packed backward. 16 is the smallest
# tile tl.dot takes, so decode (Lq = 1) packs any group of up to 16 query heads.
