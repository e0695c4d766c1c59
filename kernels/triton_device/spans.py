"""Which key blocks a program walks: the dense range, the causal edge, the block lists of a mask,
key splits and the grid order, as spans of four kinds (``FULL``, ``LEAD``, ``INNER``, ``TAIL``).
Shared by the forward and backward kernels; the scores themselves are ``score``'s.
"""

import triton
import triton.language as tl

from .score import clamped_bounds, operand_base


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
def block_at(block_list_ptr, first_block, i, num_blocks, USE_LIST: tl.constexpr):
    """Index of the i-th block a loop visits: from the active-tile list, or a plain range.

    Past the end a list read returns block 0 (always addressable); its tile is never used.
    """
    if USE_LIST:
        return tl.load(block_list_ptr + i, mask=i < num_blocks, other=0)
    return first_block + i


@triton.jit
def causal_key_end(start_m, BLOCK_M: tl.constexpr, seqlen_q, seqlen_k):
    """One past the last key any row of the query block [start_m, start_m + BLOCK_M) can see."""
    return tl.minimum(seqlen_k, tl.maximum(start_m + BLOCK_M + seqlen_k - seqlen_q, 0))


@triton.jit
def causal_query_start(start_n, BLOCK_M: tl.constexpr, seqlen_q, seqlen_k):
    """First query block (aligned to BLOCK_M) with a row that can see key ``start_n``."""
    return (tl.maximum(start_n - (seqlen_k - seqlen_q), 0) // BLOCK_M) * BLOCK_M


@triton.jit
def causal_block_split(start_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, seqlen_q, seqlen_k,
                       IS_CAUSAL: tl.constexpr):
    """(full, total) key blocks for the query block at ``start_m`` without a mask.

    Key blocks [0, full) are visible to every row of the block and need no causal test;
    [full, total) straddle the diagonal. Without causality every block is full (the loop bounds
    the last one by its loads). The host's definition is ``planning.key_walk.tile_key_blocks``.
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
