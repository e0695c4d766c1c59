"""The forward kernel.

Online softmax follows FlashAttention-2's names: ``m_i`` running row max (log2 domain), ``l_i``
running row sum of exp2(s - m_i), ``acc`` un-normalized output. Axis letters: b batch, h head,
m query position, n key position, d head dim.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .partials import last_share_arrived, split_rows, store_partial
from .score import (LN2, clamp_index, head_base, mma, online_softmax_step, operand_base,
                    packed_query_tile, pair_keeps, query_tile_scores, row_offsets, tile_offsets)
from .spans import (FULL, INNER, LEAD, SPAN_KINDS, TAIL, block_at, block_spans, dense_spans,
                    grid_position, interval_block_range, interval_rows, span, split_share)


@triton.jit
def _attn_fwd_inner(
    acc, m_i, l_i, q, offs_m, offs_n0, d_ok, tiles, steps,
    block_list_ptr, first_block, num_blocks, seqlen_q, seqlen_k, qk_scale,
    BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_ROW: tl.constexpr, CAUSAL_TILES: tl.constexpr, USE_LIST: tl.constexpr,
    INTERIOR: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    PAIR_MASK: tl.constexpr = False, skip_at=0, skip_len=0, SKIP: tl.constexpr = False,
):
    """Fold ``num_blocks`` key blocks into the online softmax state.

    ``tiles`` are the (K, V, mask, bias, interval end) tile pointers at key block 0 and
    ``steps`` the first four's strides along keys (the interval end's is the mask's). Blocks
    are ``first_block + i``, or with USE_LIST the i-th entry of the active-tile list, so a
    sparse mask walks only its active tiles, branch-free. The next block's index is read one
    iteration ahead so that tile addresses never wait on it. (Also carrying the next mask tile
    across iterations was measured 1.7x slower at L=16384, D=64: the int1 tile costs
    registers.) SKIP (without a list): from i = ``skip_at`` on, the blocks lie ``skip_len``
    further, so that one loop walks the blocks on both sides of a run another loop walks.
    INTERIOR blocks lie inside both lengths and below the causal diagonal: no range or causal
    test per pair, only the mask (if any), read through row-clamped pointers.
    PAIR_MASK: the mask is intervals read as given (``score.pair_keeps``), start at the mask
    pointers and end at the interval end pointers.
    """
    k_ptrs, v_ptrs, mask_ptrs, bias_ptrs, end_ptrs = tiles
    stride_k_n, stride_v_n, stride_mask_n, stride_bias_n = steps
    block = block_at(block_list_ptr, first_block, 0, num_blocks, USE_LIST)
    if SKIP:
        block += tl.where(skip_at <= 0, skip_len, 0)
    for i in range(num_blocks):
        start_n = block * BLOCK_N
        offs_n = start_n + offs_n0
        block = block_at(block_list_ptr, first_block, i + 1, num_blocks, USE_LIST)
        if SKIP:
            block += tl.where(i + 1 >= skip_at, skip_len, 0)
        s, k, kv_in_range = query_tile_scores(
            q, offs_m, offs_n, d_ok, start_n, k_ptrs, stride_k_n, mask_ptrs, stride_mask_n,
            bias_ptrs, stride_bias_n, seqlen_q, seqlen_k, qk_scale,
            HAS_MASK=HAS_MASK and not PAIR_MASK, HAS_BIAS=HAS_BIAS, BIAS_ROW=BIAS_ROW,
            CAUSAL_TILES=CAUSAL_TILES, INTERIOR=INTERIOR, DOT_PRECISION=DOT_PRECISION,
            WIDEN_DOTS=WIDEN_DOTS)
        if PAIR_MASK and HAS_MASK:
            pair_offset = start_n.to(tl.int64) * stride_mask_n
            keep = pair_keeps(mask_ptrs + pair_offset, end_ptrs + pair_offset,
                              offs_m[:, None], (offs_n < seqlen_k)[None, :],
                              PREDICATED=not INTERIOR)
            s = tl.where(keep, s, float("-inf"))
        p, alpha, m_new, l_i = online_softmax_step(s, m_i, l_i)
        v = tl.load(v_ptrs + start_n.to(tl.int64) * stride_v_n, mask=kv_in_range, other=0.0)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, WIDEN_DOTS)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attn_fwd_kernel(
    ptrs, q_strides, k_strides, v_strides, o_strides, mask_layout, bias_layout, list_strides,
    sizes, qk_scale, chunk_rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_PACK: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ROW: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    SPLIT_KEYS: tl.constexpr, EDGE_SLOTS: tl.constexpr,
    SCAN_KEYS: tl.constexpr = False, SCAN_CHUNK: tl.constexpr = 1024,
):
    """One tile of query rows per program; ``ptrs`` is a ``operands.ForwardPointers``.

    SCAN_KEYS: the mask is KeyIntervals read as the caller gave them (start at ``ptrs.mask``,
    end at ``ptrs.mask_end``, one layout): the program finds the key blocks from its first to
    its last visible key itself (``spans.interval_block_range``, SCAN_CHUNK keys a step) and
    tests every pair of them; no activity map, no list.

    A tile has BLOCK_M rows. With GROUP_PACK = G > 1 (GQA), row r is query position
    start_m + r // G of query head hx * G + r % G: the G heads sharing a KV head share one
    program, so K, V and the (group-shared) mask are read once for all of them.
    """
    seqlen_q = sizes.seqlen_q
    seqlen_k = sizes.seqlen_k
    QUERY_ROWS: tl.constexpr = BLOCK_M // GROUP_PACK
    # Later query blocks see more keys under causal: they start first (see grid_position).
    m_block, head_program = grid_position(tl.program_id(0), tl.cdiv(seqlen_q, QUERY_ROWS),
                                          chunk_rows, IS_CAUSAL)
    start_m = m_block * QUERY_ROWS
    heads_grid = sizes.heads_q // GROUP_PACK
    b = head_program // heads_grid
    first_head = (head_program % heads_grid) * GROUP_PACK
    # Split-K (decode): axis 2 cuts this row block's key blocks into contiguous shares.
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    offs_n0 = tl.arange(0, BLOCK_N)
    offs_m, heads, row_ok, offs_d, d_ok, q = packed_query_tile(
        ptrs.q, q_strides, b, first_head, start_m, seqlen_q, HEAD_DIM, BLOCK_D, BLOCK_M,
        GROUP_PACK)
    k_ptrs = operand_base(ptrs.k, b, first_head, sizes.group_size, k_strides.stride_b,
                          k_strides.stride_h) \
        + tile_offsets(offs_n0[:, None], offs_d[None, :], k_strides.stride_l, 1)
    v_ptrs = operand_base(ptrs.v, b, first_head, sizes.group_size, v_strides.stride_b,
                          v_strides.stride_h) \
        + tile_offsets(offs_n0[:, None], offs_d[None, :], v_strides.stride_l, 1)
    # Mask and bias rows past seqlen_q read the last row: interior tiles load unpredicated.
    safe_m = clamp_index(offs_m, seqlen_q)
    # A KeyIntervals mask's bases (its words, or with SCAN_KEYS its start and end as given).
    start_base = head_base(ptrs.mask, mask_layout, b, first_head)
    end_base = head_base(ptrs.mask_end, mask_layout, b, first_head)
    end_rows = ptrs.mask_end  # read only with SCAN_KEYS
    if SCAN_KEYS:  # KeyIntervals as given: start and end, one key vector each
        mask_rows = start_base + interval_rows()
        end_rows = end_base + interval_rows()
    elif tl.constexpr(ptrs.mask.dtype.element_ty == tl.int64):  # KeyIntervals: one key vector
        mask_rows = start_base + interval_rows()
    else:
        mask_rows = ptrs.mask + b.to(tl.int64) * mask_layout.stride_b \
            + row_offsets(safe_m, heads, mask_layout.head_div, mask_layout.stride_m,
                          mask_layout.stride_h)[:, None]
    mask_ptrs = mask_rows + offs_n0.to(tl.int64)[None, :] * mask_layout.stride_n
    end_ptrs = end_rows + offs_n0.to(tl.int64)[None, :] * mask_layout.stride_n
    if BIAS_ROW:  # one query row shared by the tile's heads: address it once (see load_bias)
        bias_rows = head_base(ptrs.bias, bias_layout, b, first_head) \
            + tl.zeros([1, 1], dtype=tl.int64)
    else:
        bias_rows = ptrs.bias + b.to(tl.int64) * bias_layout.stride_b \
            + row_offsets(safe_m, heads, bias_layout.head_div, bias_layout.stride_m,
                          bias_layout.stride_h)[:, None]
    bias_ptrs = bias_rows + offs_n0.to(tl.int64)[None, :] * bias_layout.stride_n

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # When packed, the host guarantees that the tile's heads share one mask head.
    dense = dense_spans(start_m, seqlen_q, seqlen_k, LOOP_ROWS=QUERY_ROWS, STEP_ROWS=BLOCK_N,
                        IS_CAUSAL=IS_CAUSAL, TRANSPOSED=False)
    LISTED: tl.constexpr = HAS_MASK and not SCAN_KEYS
    if SCAN_KEYS:
        # The blocks this program's rows see (split-K: in this share), as: a run of full
        # blocks below the diagonal (no mask read, no per-pair test), the interior blocks
        # on either side of it, then the tail.
        inner_hi, tail_hi = dense[2], dense[3]
        # Split-K shares the reachable blocks before the read, so that each share reads only
        # its own keys' intervals (decode: Lk / splits each, not Lk).
        share_lo, share_hi = split_share(tail_hi, split, num_splits)
        lo, hi, full_lo, full_hi = interval_block_range(
            start_base, end_base, mask_layout.stride_n, start_m,
            tl.minimum(start_m + QUERY_ROWS, seqlen_q), seqlen_q, seqlen_k, share_lo * BLOCK_N,
            tl.minimum(share_hi * BLOCK_N, seqlen_k), inner_hi, BLOCK_N=BLOCK_N,
            CHUNK=SCAN_CHUNK, IS_CAUSAL=IS_CAUSAL)
        mid = tl.minimum(tl.maximum(inner_hi, full_hi), hi)
        span_list = ptrs.lists
        # One interior walk: [lo, full_lo), then past the run, [full_hi, mid). (A loop of its
        # own for the blocks before the run, four loops in all, took 1.03-1.09x the time at
        # L1024-8192: H100, topk and sliding windows, CUDA graphs.)
        skip_at = full_lo - lo
        skip_len = full_hi - full_lo
        spans = ((full_lo, full_hi), (lo, lo), (lo, lo + skip_at + mid - full_hi), (mid, hi))
    else:
        skip_at = 0
        skip_len = 0
        span_list, spans = block_spans(
            dense, ptrs.lists, list_strides, mask_layout.head_div, b, first_head, m_block,
            split, num_splits, HAS_MASK=HAS_MASK, EDGE_SLOTS=EDGE_SLOTS, TRANSPOSED=False)
    tiles = (k_ptrs, v_ptrs, mask_ptrs, bias_ptrs, end_ptrs)
    steps = (k_strides.stride_l, v_strides.stride_l, mask_layout.stride_n, bias_layout.stride_n)
    # Full tiles (every pair visible: no mask read, no per-pair test), interior key blocks,
    # then the causal diagonal and a partial last key block. The lead span is empty here.
    for kind in tl.static_range(SPAN_KINDS):
        if (HAS_MASK or kind != FULL) and kind != LEAD:
            blocks, first, count = span(span_list, spans[kind], LISTED)
            acc, m_i, l_i = _attn_fwd_inner(
                acc, m_i, l_i, q, offs_m, offs_n0, d_ok, tiles, steps, blocks, first, count,
                seqlen_q, seqlen_k, qk_scale, BLOCK_N=BLOCK_N,
                HAS_MASK=HAS_MASK and kind != FULL, HAS_BIAS=HAS_BIAS, BIAS_ROW=BIAS_ROW,
                CAUSAL_TILES=IS_CAUSAL and kind == TAIL, USE_LIST=LISTED,
                INTERIOR=kind != TAIL, DOT_PRECISION=DOT_PRECISION,
                WIDEN_DOTS=WIDEN_DOTS, PAIR_MASK=SCAN_KEYS, skip_at=skip_at,
                skip_len=skip_len, SKIP=SCAN_KEYS and kind == INNER)

    # Partials are (splits, B*Hq, Lq, BLOCK_D) fp32 (and (splits, B*Hq, Lq) for the LSE).
    num_bh = tl.num_programs(0) // tl.cdiv(seqlen_q, QUERY_ROWS) * GROUP_PACK
    store_rows(ptrs, o_strides, acc, l_i, m_i, b, heads, offs_m, offs_d, row_ok, d_ok,
               sizes.heads_q, seqlen_q, split, num_splits, num_bh,
               ptrs.counts + tl.program_id(0), SPLIT_KEYS, BLOCK_M, BLOCK_D)


@triton.jit
def store_rows(ptrs, o_strides, acc, l_i, m_i, b, heads, offs_m, offs_d, row_ok, d_ok, heads_q,
               seqlen_q, split, num_splits, num_bh, arrival_ptr, SPLIT_KEYS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Finish a forward tile: out = acc / l and the natural-log LSE, stored at ``ptrs.out``
    (strides ``o_strides``) and ``ptrs.lse`` (B, Hq, Lq). With SPLIT_KEYS the tile is one of
    ``num_splits`` key shares of ``num_bh`` (batch x head) rows: it stores its partial, counts
    itself in at ``arrival_ptr``, and the last share to arrive merges them and stores."""
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
        # The last split of the tile to finish combines them (``partials``).
        store_partial(ptrs.out_part, out, offs_m, row_ok, split, bh, num_bh, seqlen_q, BLOCK_D)
        tl.store(ptrs.lse_part + split_rows(split, bh, num_bh, seqlen_q) + offs_m, lse,
                 mask=row_ok)
        store = last_share_arrived(arrival_ptr, num_splits)
        if store:
            out, lse = _combine_splits(ptrs.out_part, ptrs.lse_part, offs_m, row_ok, bh,
                                       num_bh, seqlen_q, num_splits, BLOCK_M, BLOCK_D)
    if store:
        tl.store(ptrs.out + b.to(tl.int64) * o_strides.stride_b
                 + row_offsets(offs_m, heads, 1, o_strides.stride_l,
                               o_strides.stride_h)[:, None]
                 + offs_d[None, :], out.to(ptrs.out.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(ptrs.lse + lse_rows, lse, mask=row_ok)


@triton.jit
def _combine_splits(out_part_ptr, lse_part_ptr, offs_m, row_ok, bh, num_bh, seqlen_q,
                    num_splits, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """(out, lse) of rows ``offs_m`` of (batch x head) rows ``bh`` merged over the key splits'
    partials (laid out as ``partials.split_rows`` says): out = sum_s exp(lse_s - lse) * out_s,
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
