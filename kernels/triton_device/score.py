"""Score construction shared by the forward and both backward kernels.

Axis letters used in every kernel module: b batch, h head, m query position, n key position,
d head dim. Strides are named ``stride_<tensor>_<axis>``.

All scores are kept in the log2 domain: ``s2 = (scale * q.k + bias) * log2(e)``, so that the
softmax uses ``exp2`` (one MUFU instruction) and the scale costs one multiply folded into
``qk_scale = scale * log2(e)``. The stored LSE is natural-log; kernels convert at the edges.
"""

import triton
import triton.language as tl


# log2(e): converts natural-log quantities to the exp2 domain.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def operand_base(ptr, b, h, head_div, stride_b, stride_h):
    """Base pointer of (b, head) in a tensor whose head axis is read as h // head_div.

    The products are 64-bit: a bias of (1, 32, 8192, 65536) has head offsets past 2**31.
    """
    return ptr + b.to(tl.int64) * stride_b + (h // head_div).to(tl.int64) * stride_h


@triton.jit
def row_offsets(offs_m, heads, head_div, stride_m, stride_h):
    """64-bit offsets of rows that may belong to different heads (GQA-packed forward tiles).

    Head ``h`` reads head ``h // head_div`` of the operand, as in ``operand_base``.
    """
    return (heads // head_div).to(tl.int64) * stride_h + offs_m.to(tl.int64) * stride_m


@triton.jit
def packed_query_tile(q_ptr, q_strides, b, first_head, start_m, seqlen_q,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                      GROUP_PACK: tl.constexpr):
    """(offs_m, heads, row_ok, offs_d, d_ok, q) of a tile whose row r is query position
    start_m + r // GROUP_PACK of query head first_head + r % GROUP_PACK (the GQA heads sharing
    one KV head share the tile), with q loaded (zeros past seqlen_q and HEAD_DIM)."""
    rows = tl.arange(0, BLOCK_M)
    offs_m = start_m + rows // GROUP_PACK
    heads = first_head + rows % GROUP_PACK
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM  # folds away when HEAD_DIM == BLOCK_D
    row_ok = offs_m < seqlen_q
    q = tl.load(q_ptr + b.to(tl.int64) * q_strides.stride_b
                + row_offsets(offs_m, heads, 1, q_strides.stride_l,
                              q_strides.stride_h)[:, None] + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    return offs_m, heads, row_ok, offs_d, d_ok, q


@triton.jit
def tile_offsets(rows, cols, stride_rows, stride_cols):
    """64-bit element offsets of a 2-D tile; broadcast axes simply have stride 0.

    ``rows`` and ``cols`` arrive already shaped for broadcasting ([:, None] and [None, :], or
    the transpose), so one helper serves (m, n) tiles and the backward's (n, m) tiles alike.
    """
    return rows.to(tl.int64) * stride_rows + cols.to(tl.int64) * stride_cols


@triton.jit
def rows_within(m_idx, start, end):
    """start <= i < end for rows ``m_idx``, with start and end clamped to [0, 2**31 - 1], as
    one unsigned compare: i - start wraps above any span when negative, and an empty interval
    (end <= start) has span 0. Fewer live values than two compares: H100, L4096 H16/4
    top-1024, intervals at D80/D96 fwd 0.935x and fwd+bwd 0.968x the time, others 1.00x."""
    span = tl.maximum(end - start, 0)
    return (m_idx - start).to(tl.uint32, bitcast=True) < span.to(tl.uint32, bitcast=True)


@triton.jit
def mask_keeps(mask_ptrs, m_idx, load_ok, key_ok, PREDICATED: tl.constexpr = True):
    """The mask's verdict on a tile of pairs: loads predicated on ``load_ok`` (not PREDICATED:
    unpredicated, the pointers clamped into range).

    A bool mask (read as bytes) keeps a pair whose byte is non-zero. A ``KeyIntervals`` mask
    arrives as one int64 word per key, its start in the low 32 bits and its end in the high
    (``inputs.interval_words``), and row i is kept iff start <= i < end. Its pointers are one
    key vector (``interval_rows``), so its loads are predicated on ``key_ok``, the key range
    test of the same shape.
    """
    if tl.constexpr(mask_ptrs.dtype.element_ty == tl.int64):  # KeyIntervals
        # One 8-byte word per key, contiguous along keys: a thread's two adjacent keys are one
        # 16-byte copy. As two int32 loads at key stride 2 each key was two 4-byte copies
        # (sm_90 SASS of the D128 forward's masked loop: 48 LDGSTS against 20 for a bool mask).
        if PREDICATED:
            word = tl.load(mask_ptrs, mask=key_ok, other=0)
        else:
            word = tl.load(mask_ptrs)
        # The low half is the start, the high half the end (values are in [0, 2**31 - 1]).
        keep = rows_within(m_idx, word.to(tl.int32), (word >> 32).to(tl.int32))
    elif PREDICATED:
        keep = tl.load(mask_ptrs, mask=load_ok, other=0) != 0
    else:
        keep = tl.load(mask_ptrs) != 0
    return keep


@triton.jit
def clamped_bounds(start, end):
    """Interval bounds as given (int32 or int64) clamped into [0, 2**31 - 1], as int32: the
    meaning for every row 0 <= i < 2**31 - 1 stays (``intervals.KeyIntervals.kernel_operand``)."""
    start = tl.minimum(tl.maximum(start, 0), 2147483647).to(tl.int32)
    end = tl.minimum(tl.maximum(end, 0), 2147483647).to(tl.int32)
    return start, end


@triton.jit
def pair_keeps(start_ptrs, end_ptrs, m_idx, key_ok, PREDICATED: tl.constexpr):
    """``mask_keeps`` of intervals read as the caller gave them: start and end from their own
    tensors (int32 or int64), each a key vector like ``interval_rows``'. Row i is kept iff
    start <= i < end (``rows_within``)."""
    if PREDICATED:
        start, end = clamped_bounds(tl.load(start_ptrs, mask=key_ok, other=0),
                                    tl.load(end_ptrs, mask=key_ok, other=0))
    else:
        start, end = clamped_bounds(tl.load(start_ptrs), tl.load(end_ptrs))
    return rows_within(m_idx, start, end)


@triton.jit
def visible_keys(m_idx, n_idx, seqlen_q, seqlen_k, mask_ptrs,
                 HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr,
                 INTERIOR: tl.constexpr = False, GUARD_KEYS: tl.constexpr = False):
    """Which (query, key) pairs of the tile take part: in range, kept by the mask, causal.

    ``m_idx`` / ``n_idx`` are broadcast-shaped query and key positions (either orientation).
    Causal is bottom-right aligned: query i sees key j iff j <= i + (seqlen_k - seqlen_q).
    The mask is read with the range predicate, so odd lengths never read out of bounds.

    An INTERIOR tile lies inside both lengths and wholly below the causal diagonal (see
    ``interior_span``): only the mask decides, and its pointers must already be clamped into
    range, because the load has no predicate. Callers skip this for interior tiles without a mask.
    GUARD_KEYS: the key positions are not clamped (dkdv's (n, m) tiles, see
    ``attn_bwd_dkdv_program``), so an interior load is predicated on the key range alone.
    """
    if INTERIOR:
        if GUARD_KEYS:
            key_ok = n_idx < seqlen_k
            keep = mask_keeps(mask_ptrs, m_idx, key_ok, key_ok)
        else:
            keep = mask_keeps(mask_ptrs, m_idx, n_idx, n_idx, PREDICATED=False)
    else:
        key_ok = n_idx < seqlen_k
        keep = (m_idx < seqlen_q) & key_ok
        if HAS_MASK:
            # Predicated on the range test alone: it is constant along rows and columns, so
            # the loads can stay vectorized. Adding the causal test to the predicate made the
            # list pass 1.3-2.8x slower on the H100.
            keep = keep & mask_keeps(mask_ptrs, m_idx, keep, key_ok)
        if IS_CAUSAL:
            keep = keep & (n_idx <= m_idx + (seqlen_k - seqlen_q))
    return keep


@triton.jit
def clamp_index(idx, length):
    """Positions past the end read the last valid row instead: interior tiles load without a
    predicate, and the rows or columns computed from such positions are never stored."""
    return tl.minimum(idx, length - 1)


@triton.jit
def load_bias(bias_ptrs, keep, keys_in_range, BIAS_ROW: tl.constexpr,
              INTERIOR: tl.constexpr = False, GUARD_KEYS: tl.constexpr = False):
    """Bias values for a tile.

    With BIAS_ROW (a bias with one query row, e.g. flash-dmattn's (B, Hk, 1, Lk)) the pointers
    are a single key row, [1, N] or [N, 1], loaded once and broadcast by the score add. A full
    tile of identical addresses cost 0.23 ms of 0.59 ms at L=16384, D=64 on an H100.
    Interior tiles (clamped pointers, see ``visible_keys``) load without a predicate, or with
    GUARD_KEYS (unclamped keys) on ``keys_in_range`` alone.
    """
    # One return statement: compiled Triton (3.6+) rejects returns of different shapes even
    # under a constexpr branch; the interpreter does not.
    if INTERIOR and not GUARD_KEYS:
        bias = tl.load(bias_ptrs)
    elif BIAS_ROW or INTERIOR:
        bias = tl.load(bias_ptrs, mask=keys_in_range, other=0.0)
    else:
        bias = tl.load(bias_ptrs, mask=keep, other=0.0)
    return bias


@triton.jit
def scores_log2(qk, keep, bias, qk_scale, HAS_BIAS: tl.constexpr,
                APPLY_KEEP: tl.constexpr = True):
    """Scaled, biased scores in the log2 domain; pairs not kept are -inf.

    Interior tiles without a mask keep every pair (APPLY_KEEP False): no select at all.
    """
    s = qk * qk_scale
    if HAS_BIAS:
        # The bias is added after scaling, so it gets log2(e) alone.
        s += bias.to(tl.float32) * LOG2E
    if APPLY_KEEP:
        s = tl.where(keep, s, float("-inf"))
    return s


@triton.jit
def query_tile_scores(q, offs_m, offs_n, d_ok, start_n, k_ptrs, stride_k_n,
                      mask_ptrs, stride_mask_n, bias_ptrs, stride_bias_n,
                      seqlen_q, seqlen_k, qk_scale,
                      HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ROW: tl.constexpr,
                      CAUSAL_TILES: tl.constexpr, INTERIOR: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr):
    """Log2 scores of a (query rows x key block) tile, as the forward and dq loops need them.

    Returns (scores, the K tile, the K/V load predicate). Pointers address key block 0;
    ``start_n`` is this block's first key. Keys not kept score -inf (see ``visible_keys``).
    """
    keep = 0  # interior tiles without a mask keep every pair
    if HAS_MASK or not INTERIOR:
        keep = visible_keys(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k,
                            mask_ptrs + start_n.to(tl.int64) * stride_mask_n,
                            HAS_MASK=HAS_MASK, IS_CAUSAL=CAUSAL_TILES, INTERIOR=INTERIOR)
    if INTERIOR:
        kv_in_range = d_ok[None, :]
    else:
        kv_in_range = (offs_n[:, None] < seqlen_k) & d_ok[None, :]
    k = tl.load(k_ptrs + start_n.to(tl.int64) * stride_k_n, mask=kv_in_range, other=0.0)
    bias = 0.0
    if HAS_BIAS:
        bias = load_bias(bias_ptrs + start_n.to(tl.int64) * stride_bias_n, keep,
                         (offs_n < seqlen_k)[None, :], BIAS_ROW=BIAS_ROW, INTERIOR=INTERIOR)
    qk = mma(q, tl.trans(k), DOT_PRECISION, WIDEN_DOTS)
    s = scores_log2(qk, keep, bias, qk_scale, HAS_BIAS=HAS_BIAS,
                    APPLY_KEEP=HAS_MASK or not INTERIOR)
    return s, k, kv_in_range


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """One key block of the online softmax over log2-domain scores ``s``: (p, alpha, m_new,
    l_new), where the caller scales its accumulator by ``alpha`` and adds p @ V. A row whose
    scores are all -inf so far shifts by 0 instead of -inf (NaN guard)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def probs_from_lse(s, lse):
    """Recompute softmax probabilities from log2 scores and the saved natural-log LSE.

    Empty rows have LSE -inf and all scores -inf; shifting by 0 there keeps exp2 at 0, not NaN.
    """
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * LOG2E)
    return tl.math.exp2(s - lse2)


@triton.jit
def write_tile(ptrs, values, in_range, ACCUMULATE: tl.constexpr, ATOMIC: tl.constexpr):
    """Store a gradient tile: plain store, add into an fp32 accumulator, or atomic add."""
    if ATOMIC:
        # Relaxed: the sums need no ordering against other memory, and the default acq_rel
        # would order every element's add (nothing reads them before the kernel ends).
        tl.atomic_add(ptrs, values, mask=in_range, sem="relaxed")
    elif ACCUMULATE:
        tl.store(ptrs, tl.load(ptrs, mask=in_range, other=0.0) + values, mask=in_range)
    else:
        tl.store(ptrs, values.to(ptrs.dtype.element_ty), mask=in_range)


@triton.jit
def mma(a, b, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr):
    """tl.dot with the kernels' precision policy.

    WIDEN_DOTS is set only under Triton's CPU interpreter for bfloat16 inputs: the interpreter
    (seen in triton 3.9) multiplies bf16 operands as their raw uint16 storage. bf16 products are
    exact in fp32, so widening first gives the tensor cores' result. Compiled code never widens.
    """
    if WIDEN_DOTS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def head_base(ptr, layout, b, h):
    """Base pointer of (batch b, query head h) in a broadcast operand of ``layout``
    (``operands.Layout``): query head h reads head h // head_div. 64-bit products: a bias of
    (1, 32, 8192, 65536) has head offsets past 2**31."""
    return operand_base(ptr, b, h, layout.head_div, layout.stride_b, layout.stride_h)


@triton.jit
def seq_base(ptr, strides, b, h):
    """Base pointer of (batch b, head h) in a (B, L, H, D) tensor of ``strides``
    (``operands.SeqStrides``)."""
    return operand_base(ptr, b, h, 1, strides.stride_b, strides.stride_h)
