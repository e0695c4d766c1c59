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
    (``_checks.interval_words``), and row i is kept iff start <= i < end. Its pointers are one
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
def interval_block_range(start_row, end_row, stride_n, m0, m1, seqlen_q, seqlen_k, first_key,
                         num_keys, interior_hi, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                         IS_CAUSAL: tl.constexpr):
    """``(lo, hi, full_lo, full_hi)`` for a program of rows [m0, m1), reading each key's
    interval from ``start_row`` and ``end_row`` (key 0's, ``stride_n`` apart), CHUNK keys a
    step over keys [first_key, num_keys) (``first_key`` a multiple of BLOCK_N), in blocks of
    BLOCK_N keys:

    * [lo, hi): the blocks from the one of the first key some row sees (causal: bottom-right)
      to the one of the last; empty where no row sees a key. Blocks between may hold no
      visible pair: the caller tests every pair of them.
    * [full_lo, full_hi): the blocks wholly inside the first run of keys that every row sees
      (start <= m0 and end >= m1), cut to the interior blocks [0, interior_hi) (inside both
      lengths and wholly below the causal diagonal). Where there is none,
      full_lo == full_hi == lo.

    Keys before ``first_key`` count as unseen.

    Four reductions over each step's keys; the two that find the run cost nothing measurable
    (H100, L1024-8192: the same times with them left out), and walking the run with no mask
    read made B1 H16/4 L1024 top-1024 (every visible key kept) 26.8 us against 34.5.
    """
    offs = tl.arange(0, CHUNK)
    none = 2147483647
    first = tl.full((), 0, tl.int32) + num_keys
    last = tl.full((), -1, tl.int32)
    run_lo = tl.full((), none, tl.int32)
    run_hi = tl.full((), none, tl.int32)
    for chunk in range(first_key, num_keys, CHUNK):
        keys = chunk + offs
        ok = keys < num_keys
        offsets = keys.to(tl.int64) * stride_n
        start, end = clamped_bounds(tl.load(start_row + offsets, mask=ok, other=0),
                                    tl.load(end_row + offsets, mask=ok, other=0))
        every_row = ok & (start <= m0) & (end >= m1)
        if IS_CAUSAL:
            start = tl.maximum(start, keys - (seqlen_k - seqlen_q))
        seen = ok & (tl.maximum(start, m0) < tl.minimum(end, m1))
        first = tl.minimum(first, tl.min(tl.where(seen, keys, num_keys), 0))
        last = tl.maximum(last, tl.max(tl.where(seen, keys, -1), 0))
        # Steps run in key order: the run's first key is found first, and it ends at the
        # next key that not every row sees (or past the keys).
        run_lo = tl.minimum(run_lo, tl.min(tl.where(every_row, keys, none), 0))
        run_hi = tl.minimum(run_hi, tl.min(tl.where(~every_row & (keys > run_lo), keys, none),
                                           0))
    any_seen = last >= 0
    lo = tl.where(any_seen, first // BLOCK_N, 0)
    hi = tl.where(any_seen, last // BLOCK_N + 1, 0)
    full_lo = (run_lo + BLOCK_N - 1) // BLOCK_N
    full_hi = tl.minimum(tl.minimum(run_hi, num_keys) // BLOCK_N, interior_hi)
    has_run = (run_lo < none) & (full_lo < full_hi)  # its keys are seen: inside [lo, hi)
    return lo, hi, tl.where(has_run, full_lo, lo), tl.where(has_run, full_hi, lo)


@triton.jit
def interval_rows():
    """The row offsets of a ``KeyIntervals`` mask's tile pointers: one row, since every query
    row of a tile reads the same (start, end) per key (query stride 0, one mask head per tile).
    As a (BLOCK_M, BLOCK_N) tile of int32 pairs the pipelined loads needed 263 KB of shared
    memory in the D128 masked forward, over the H100's 227 KB; as a key vector they need a
    few hundred bytes."""
    return tl.zeros([1, 1], dtype=tl.int32)


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
def interior_span(block_list_ptr, count, interior_lo, interior_hi, SLOTS: tl.constexpr):
    """[start, end) positions of the list entries that are interior blocks.

    The list holds ``count`` ascending block indices; blocks in [interior_lo, interior_hi) need
    no range or causal test. At most SLOTS entries lie below interior_lo and at most SLOTS at
    or above interior_hi (the diagonal band and a partial last block), so reading SLOTS entries
    from each end of the list finds both edges without a scan.
    """
    interior_hi = tl.maximum(interior_hi, interior_lo)  # an empty interior counts once, as head
    j = tl.arange(0, SLOTS)
    head = tl.load(block_list_ptr + j, mask=j < count, other=interior_lo)
    tail_at = count - SLOTS + j
    tail = tl.load(block_list_ptr + tail_at, mask=tail_at >= 0, other=-1)
    start = tl.sum((head < interior_lo).to(tl.int32), 0)
    end = count - tl.sum((tail >= interior_hi).to(tl.int32), 0)
    return start, end


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
def block_at(block_list_ptr, first_block, i, num_blocks, USE_LIST: tl.constexpr):
    """Index of the i-th block a loop visits: from the active-tile list, or a plain range.

    Past the end a list read returns block 0 (always addressable); its tile is never used.
    """
    if USE_LIST:
        return tl.load(block_list_ptr + i, mask=i < num_blocks, other=0)
    return first_block + i


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
def causal_key_end(start_m, BLOCK_M: tl.constexpr, seqlen_q, seqlen_k):
    """One past the last key any row of the query block [start_m, start_m + BLOCK_M) can see."""
    return tl.minimum(seqlen_k, tl.maximum(start_m + BLOCK_M + seqlen_k - seqlen_q, 0))


@triton.jit
def causal_query_start(start_n, BLOCK_M: tl.constexpr, seqlen_q, seqlen_k):
    """First query block (aligned to BLOCK_M) with a row that can see key ``start_n``."""
    return (tl.maximum(start_n - (seqlen_k - seqlen_q), 0) // BLOCK_M) * BLOCK_M


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
def causal_block_split(start_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, seqlen_q, seqlen_k,
                       IS_CAUSAL: tl.constexpr):
    """(full, total) key blocks for the query block at ``start_m`` without a mask.

    Key blocks [0, full) are visible to every row of the block and need no causal test;
    [full, total) straddle the diagonal. Without causality every block is full.
    """
    total = tl.cdiv(seqlen_k, BLOCK_N)
    full = total
    if IS_CAUSAL:
        total = tl.cdiv(causal_key_end(start_m, BLOCK_M, seqlen_q, seqlen_k), BLOCK_N)
        full = tl.minimum(tl.maximum(start_m + seqlen_k - seqlen_q + 1, 0) // BLOCK_N, total)
    return full, total


@triton.jit
def causal_query_split(start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, seqlen_q, seqlen_k,
                       IS_CAUSAL: tl.constexpr):
    """(first, full, total) query blocks for the key block at ``start_n`` without a mask.

    Query blocks [first, full) straddle the diagonal and need the causal test; [full, total)
    see every key of the block. Without causality all blocks are full.
    """
    total = tl.cdiv(seqlen_q, BLOCK_M)
    first = 0
    full = 0
    if IS_CAUSAL:
        first = causal_query_start(start_n, BLOCK_M, seqlen_q, seqlen_k) // BLOCK_M
        last_key = start_n + BLOCK_N - 1
        full = tl.minimum(tl.cdiv(tl.maximum(last_key - (seqlen_k - seqlen_q), 0), BLOCK_M),
                          total)
        full = tl.maximum(full, first)
    return first, full, total


@triton.jit
def block_list_row(list_ptr, stride_list_b, stride_list_h, stride_list_row, b, h, head_div,
                   row):
    """(pointer to the active-block list of ``row``, its length, how many lead entries are full
    tiles) for batch b, head h. A row of the table is (count, full count, blocks...); see
    ``_blocks``: full tiles first, then partial ones."""
    row_ptr = operand_base(list_ptr, b, h, head_div, stride_list_b, stride_list_h) \
        + row.to(tl.int64) * stride_list_row
    return row_ptr + 2, tl.load(row_ptr), tl.load(row_ptr + 1)


@triton.jit
def split_share(total, split, num_splits):
    """[lo, hi) of ``total`` items that split ``split`` of ``num_splits`` takes (split-K)."""
    per = tl.cdiv(total, num_splits)
    lo = tl.minimum(split * per, total)
    return lo, tl.minimum(lo + per, total)


@triton.jit
def grid_position(pid, blocks, chunk_rows, LAST_FIRST: tl.constexpr):
    """(block, row) of program ``pid`` in a 1-D grid of ``blocks`` blocks for each of its rows
    (a row is a (batch, head) pair, or a (batch, kv head) pair in dkdv).

    The GPU starts programs roughly in launch order. The grid runs in chunks of
    ``chunk_rows`` rows (the host's ``grid_chunk_rows`` picks it); within a chunk every row's
    block of one range starts before any row's next block. Where blocks differ in work
    (causal), the chunk then starts its longest programs first and ends on its shortest, so
    the grid's last wave is short work; LAST_FIRST walks the blocks from the last, for
    kernels whose later blocks hold more work. One row per chunk is plain row-by-row order,
    whose rows' programs share K and V (or Q and dO) in L2."""
    rows = tl.num_programs(0) // blocks
    per_chunk = blocks * chunk_rows
    first_row = (pid // per_chunk) * chunk_rows
    rest = pid % per_chunk
    width = tl.minimum(chunk_rows, rows - first_row)  # the last chunk may be narrower
    block = rest // width
    if LAST_FIRST:
        block = blocks - 1 - block
    return block, first_row + rest % width


@triton.jit
def head_base(ptr, layout, b, h):
    """Base pointer of (batch b, query head h) in a broadcast operand of ``layout``
    (``_operands.Layout``): query head h reads head h // head_div. 64-bit products: a bias of
    (1, 32, 8192, 65536) has head offsets past 2**31."""
    return operand_base(ptr, b, h, layout.head_div, layout.stride_b, layout.stride_h)


@triton.jit
def seq_base(ptr, strides, b, h):
    """Base pointer of (batch b, head h) in a (B, L, H, D) tensor of ``strides``
    (``_operands.SeqStrides``)."""
    return operand_base(ptr, b, h, 1, strides.stride_b, strides.stride_h)


@triton.jit
def dense_spans(start, seqlen_q, seqlen_k, LOOP_ROWS: tl.constexpr, STEP_ROWS: tl.constexpr,
                IS_CAUSAL: tl.constexpr, TRANSPOSED: tl.constexpr):
    """``(lead_lo, inner_lo, inner_hi, tail_hi)``: the block spans, as block indices, of a
    program that holds a block of ``LOOP_ROWS`` query rows from ``start`` (TRANSPOSED:
    ``LOOP_ROWS`` keys) and walks ``STEP_ROWS``-sized blocks of the other axis, before any mask:

    * lead [lead_lo, inner_lo): blocks on the causal diagonal before the interior (TRANSPOSED
      only: query blocks that straddle it);
    * inner [inner_lo, inner_hi): blocks inside both lengths with no causal test;
    * tail [inner_hi, tail_hi): the rest, tested per pair (the diagonal and a partial last key
      block, or TRANSPOSED a partial last query block).
    """
    if TRANSPOSED:
        lead_lo, inner_lo, tail_hi = causal_query_split(start, STEP_ROWS, LOOP_ROWS, seqlen_q,
                                                        seqlen_k, IS_CAUSAL)
        inner_hi = tl.maximum(seqlen_q // STEP_ROWS, inner_lo)
    else:
        inner_hi, tail_hi = causal_block_split(start, LOOP_ROWS, STEP_ROWS, seqlen_q, seqlen_k,
                                               IS_CAUSAL)
        inner_hi = tl.minimum(inner_hi, seqlen_k // STEP_ROWS)
        lead_lo = 0
        inner_lo = 0
    return lead_lo, inner_lo, inner_hi, tail_hi


# The kinds of span of ``block_spans``, in the order a program walks them; a kernel walks
# them in a ``tl.static_range(SPAN_KINDS)`` loop, so each kind's inner loop is compiled with
# that kind's constexpr flags.
FULL = tl.constexpr(0)
LEAD = tl.constexpr(1)
INNER = tl.constexpr(2)
TAIL = tl.constexpr(3)
SPAN_KINDS = tl.constexpr(4)


@triton.jit
def block_spans(dense, lists_ptr, list_strides, head_div, b, h, block, split, num_splits,
                HAS_MASK: tl.constexpr, EDGE_SLOTS: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The spans of blocks that a program walks: the one block walker of every kernel.

    ``dense`` are the spans without a mask (``dense_spans``). Returns ``(list, spans)``, where
    ``spans[kind]`` is the ``(lo, hi)`` of a kind of span: FULL, LEAD, INNER, TAIL, in walk order.

    * full [full_lo, full_hi): active tiles whose every pair is visible, walked with no mask
      read and no per-pair test (a mask's only: without one it is empty);
    * lead [lead_lo, inner_lo), inner [inner_lo, inner_hi) and tail [inner_hi, tail_hi): the
      dense spans. Not TRANSPOSED the lead is empty (the interior starts at the share's first
      block) and kernels skip it; TRANSPOSED the tail holds no causal diagonal.

    ``span`` turns one into loop arguments. With a mask they are positions in ``list``, the
    active-tile list of row ``block`` of (batch b, head h) (see ``_blocks``): the full tiles
    first, then the partial ones, cut where the dense spans' interior begins and ends.
    Without a mask they are block indices.

    Not TRANSPOSED, split-K cuts the positions into ``num_splits`` contiguous shares; the spans
    cover share ``split``.
    """
    lead_lo, inner_lo, inner_hi, tail_hi = dense
    span_list = lists_ptr
    full_lo = 0
    full_hi = 0
    if HAS_MASK:
        span_list, tail_hi, full_hi = block_list_row(
            lists_ptr, list_strides.stride_b, list_strides.stride_h, list_strides.stride_row,
            b, h, head_div, block)
        lo, hi = interior_span(span_list + full_hi, tail_hi - full_hi, inner_lo, inner_hi,
                               EDGE_SLOTS)
        lead_lo = full_hi
        inner_hi = hi + full_hi
        if TRANSPOSED:
            inner_lo = lo + full_hi
        else:  # the interior starts at key block 0: no list entry lies before it
            inner_lo = full_hi
    if not TRANSPOSED:
        share_lo, tail_hi = split_share(tail_hi, split, num_splits)
        full_lo = share_lo
        full_hi = tl.minimum(tl.maximum(full_hi, share_lo), tail_hi)
        inner_lo = tl.minimum(tl.maximum(inner_lo, share_lo), tail_hi)
        inner_hi = tl.minimum(tl.maximum(inner_hi, share_lo), tail_hi)
        lead_lo = inner_lo
    spans = ((full_lo, full_hi), (lead_lo, inner_lo), (inner_lo, inner_hi), (inner_hi, tail_hi))
    return span_list, spans


@triton.jit
def span(span_list, bounds, HAS_MASK: tl.constexpr):
    """(list pointer, first block, count) of the span ``bounds`` = (lo, hi) of ``block_spans``,
    as an inner loop's ``block_at`` reads them: list positions with a mask, block indices
    without."""
    lo, hi = bounds
    # One return statement: compiled Triton rejects returns of different types.
    if HAS_MASK:
        list_ptr = span_list + lo
        first = 0
    else:
        list_ptr = span_list
        first = lo
    return list_ptr, first, hi - lo
