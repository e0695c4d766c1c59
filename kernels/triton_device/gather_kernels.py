"""Decode that reads only the kept keys: the kept-key lists and the forward over them.

A decode call has few query rows (at most 16). Under a mask that keeps W of its Lk keys (a
top-W mask of a per-key bias keeps scattered keys, so nearly every key block holds one), the
tile walk reads every K and V block; these kernels read the kept rows alone:

* ``_kept_counts_kernel`` and ``_kept_keys_kernel``: per row of the mask's (batch, head) rows,
  the keys that any query row of the call keeps (mask and causality), compacted in key order
  into an int32 list, and its length. One program per (row, chunk of keys) in both: the first
  counts its chunk's kept keys, the second sums the counts of the chunks before its own and
  writes its keys after theirs (``_kept_word_keys_kernel``: from the bits, a word at a
  time). ``_kept_list_kernel`` does both in one launch, each chunk
  waiting for the counts before it (decoupled look-back). A ``KeyIntervals`` mask decides
  per key in O(1) (the rows [max(start, first causal row), min(end, Lq)) are not empty); a
  bool mask ORs its rows.
* ``_gather_decode_kernel``: one program per (batch, pack of query heads, key share) walks its
  share of a list in blocks of BLOCK_N entries: it gathers those K and V rows (and the mask's
  and bias's entries at those keys), tests each (row, key) pair again (rows of one call may
  keep different keys), and folds them into the online softmax. The shares' partials merge in
  the launch (``partials``), as split-K decode does. All query heads of a GQA group that share
  one list read each K and V row once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .forward_kernels import store_rows
from .score import (LOG2E, clamped_bounds, mma, online_softmax_step, packed_query_tile,
                    row_offsets, rows_within)

# How a call's mask reaches these kernels (``MASK_KIND``): a bool mask read as bytes,
# ``KeyIntervals`` as one int64 word per key (start low, end high: ``inputs.interval_words``),
# or as the caller's start and end tensors (one layout, int32 or int64).
BOOL_MASK = tl.constexpr(0)
INTERVAL_WORDS = tl.constexpr(1)
INTERVAL_PAIRS = tl.constexpr(2)


@triton.jit
def _runs_at(start_ptrs, end_ptrs, ok, MASK_KIND: tl.constexpr):
    """(start, end) as int32 in [0, 2**31 - 1] of the keys at these pointers (row i keeps a
    key iff start <= i < end)."""
    if MASK_KIND == INTERVAL_WORDS:
        word = tl.load(start_ptrs, mask=ok, other=0)
        start = word.to(tl.int32)
        end = (word >> 32).to(tl.int32)
    else:
        start, end = clamped_bounds(tl.load(start_ptrs, mask=ok, other=0),
                                    tl.load(end_ptrs, mask=ok, other=0))
    return start, end


@triton.jit
def _chunk_kept(ptrs, mask_layout, sizes, list_heads, scan_rows, MASK_KIND: tl.constexpr,
                IS_CAUSAL: tl.constexpr, CHUNK: tl.constexpr):
    """(keys, kept) of this program's chunk: keys [chunk x CHUNK, ...) of list row
    ``program_id(0)`` (``_kept_in_chunk``)."""
    return _kept_in_chunk(ptrs, mask_layout, sizes, tl.program_id(0), list_heads, scan_rows,
                          tl.program_id(1), MASK_KIND, IS_CAUSAL, CHUNK)


@triton.jit
def _kept_in_chunk(ptrs, mask_layout, sizes, row, list_heads, scan_rows, chunk,
                   MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, CHUNK: tl.constexpr):
    """(keys, kept): keys [chunk x CHUNK, ...) of list row ``row`` = (batch b, head h) of
    ``list_heads`` heads, and whether any query row of the call keeps each (mask and
    causality; False past the last key)."""
    keys = chunk * CHUNK + tl.arange(0, CHUNK)
    b = row // list_heads
    h = row % list_heads
    seqlen_q = sizes.seqlen_q
    seqlen_k = sizes.seqlen_k
    head_offset = b.to(tl.int64) * mask_layout.stride_b + h.to(tl.int64) * mask_layout.stride_h
    in_range = keys < seqlen_k
    key_offsets = head_offset + keys.to(tl.int64) * mask_layout.stride_n
    # Causal, bottom-right: row r sees key j iff j <= r + (Lk - Lq), so key j's first row.
    lo = tl.zeros([CHUNK], dtype=tl.int32)
    if IS_CAUSAL:
        lo = tl.maximum(keys - (seqlen_k - seqlen_q), 0)
    if MASK_KIND == BOOL_MASK:
        kept = tl.zeros([CHUNK], dtype=tl.int1)
        for r in range(scan_rows):
            byte = tl.load(ptrs.mask + key_offsets + r * mask_layout.stride_m, mask=in_range,
                           other=0)
            # A mask broadcast over rows (scan_rows 1) stands for every row: the last row
            # sees the most keys.
            last_row = tl.where(scan_rows == 1, seqlen_q - 1, r)
            kept = kept | ((byte != 0) & (lo <= last_row))
        kept = kept & in_range
    else:
        start, end = _runs_at(ptrs.mask + key_offsets, ptrs.mask_end + key_offsets, in_range,
                              MASK_KIND)
        kept = in_range & (tl.maximum(start, lo) < tl.minimum(end, seqlen_q))
    return keys, kept


@triton.jit
def _kept_counts_kernel(ptrs, mask_layout, sizes, list_heads, scan_rows, num_chunks,
                        MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, CHUNK: tl.constexpr):
    """Grid (list rows, chunks of CHUNK keys): how many keys of its chunk the call keeps, into
    ``ptrs.chunk_counts`` (list rows x ``num_chunks`` int32), and which, a bit per key in
    ``ptrs.kept_bits`` (bit i of word w: key 32 w + i of the row), so that the keys pass reads
    1 bit a key instead of the mask's 1 or 8 bytes again. ``ptrs`` is an
    ``operands.KeptPointers``; ``scan_rows``: the bool mask's query rows to OR (1 where it
    broadcasts over rows)."""
    _, kept = _chunk_kept(ptrs, mask_layout, sizes, list_heads, scan_rows, MASK_KIND,
                          IS_CAUSAL, CHUNK)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    taken = kept.to(tl.int32)
    tl.store(ptrs.chunk_counts + row * num_chunks + chunk, tl.sum(taken, 0))
    # Distinct bits: their sum is their OR (bit 31 wraps to the sign, as an OR would set it).
    bits = tl.reshape(taken, [CHUNK // 32, 32]) << tl.arange(0, 32)[None, :]
    words = chunk * (CHUNK // 32) + tl.arange(0, CHUNK // 32)
    tl.store(ptrs.kept_bits + row * (num_chunks * (CHUNK // 32)) + words, tl.sum(bits, 1))


@triton.jit
def _kept_before(ptrs, row, num_chunks, chunks, COUNTS_BLOCK: tl.constexpr):
    """The kept keys of list row ``row``'s first ``chunks`` chunks: the sum of their counts
    (``ptrs.chunk_counts``, ``num_chunks`` a row), COUNTS_BLOCK at a time."""
    count_row = ptrs.chunk_counts + row.to(tl.int64) * num_chunks
    before = 0
    for first in range(0, chunks, COUNTS_BLOCK):
        offs = first + tl.arange(0, COUNTS_BLOCK)
        before += tl.sum(tl.load(count_row + offs, mask=offs < chunks, other=0), 0)
    return before


@triton.jit
def _kept_keys_kernel(ptrs, num_chunks, capacity, CHUNK: tl.constexpr,
                      COUNTS_BLOCK: tl.constexpr):
    """Grid (list rows, chunks of CHUNK keys), after ``_kept_counts_kernel``: each chunk writes
    its kept keys (from ``ptrs.kept_bits``), in key order, into its row's list (``capacity``
    int32 entries) after those of the chunks before it, and the last chunk writes the list's
    length."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    before = _kept_before(ptrs, row, num_chunks, chunk, COUNTS_BLOCK)
    words = tl.load(ptrs.kept_bits + row.to(tl.int64) * (num_chunks * (CHUNK // 32))
                    + chunk * (CHUNK // 32) + tl.arange(0, CHUNK // 32))
    taken = tl.reshape((words[:, None] >> tl.arange(0, 32)[None, :]) & 1, [CHUNK])
    keys = chunk * CHUNK + tl.arange(0, CHUNK)
    slot = before + tl.cumsum(taken, 0) - 1
    tl.store(ptrs.kept + row.to(tl.int64) * capacity + slot, keys,
             mask=(taken != 0) & (slot < capacity))
    if chunk == num_chunks - 1:
        tl.store(ptrs.counts + row, tl.minimum(before + tl.sum(taken, 0), capacity))


@triton.jit
def _popcount(words):
    """The set bits of each int32 word (a SWAR sum: pairs, nibbles, bytes, then the bytes'
    sum in the top byte; the masks drop what the arithmetic shifts bring in)."""
    words = words - ((words >> 1) & 0x55555555)
    words = (words & 0x33333333) + ((words >> 2) & 0x33333333)
    words = (words + (words >> 4)) & 0x0F0F0F0F
    return (words * 0x01010101) >> 24


@triton.jit
def _bit_index(power):
    """The index of the one set bit of each nonzero int32 word: its float32 exponent (2**31
    reads as -2**31, whose exponent is 31 too)."""
    return ((power.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _kept_word_keys_kernel(ptrs, num_chunks, capacity, CHUNK: tl.constexpr,
                           WORDS: tl.constexpr, COUNTS_BLOCK: tl.constexpr):
    """``_kept_keys_kernel``'s lists from the bits a word at a time. Grid (list rows, parts of
    WORDS words of ``ptrs.kept_bits``, whole chunks of CHUNK keys each): a part adds the
    counts of the chunks before its own and its words' popcounts before each word, then
    writes its words' kept keys lowest bit first, one bit of every word a step, as many steps
    as its fullest word has bits (a top-W mask keeps a few keys a word, so few steps, against
    a scan and a test of every key). The row's last part writes the list's length."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    CHUNK_WORDS: tl.constexpr = CHUNK // 32
    row_words = num_chunks * CHUNK_WORDS
    before = _kept_before(ptrs, row, num_chunks, part * (WORDS // CHUNK_WORDS), COUNTS_BLOCK)
    word_ids = part * WORDS + tl.arange(0, WORDS)
    words = tl.load(ptrs.kept_bits + row.to(tl.int64) * row_words + word_ids,
                    mask=word_ids < row_words, other=0)
    taken = _popcount(words)
    slots = before + tl.cumsum(taken, 0) - taken
    list_row = ptrs.kept + row.to(tl.int64) * capacity
    left = words
    for _ in range(tl.max(taken, 0)):
        live = left != 0
        lowest = left & -left
        tl.store(list_row + slots, word_ids * 32 + _bit_index(lowest),
                 mask=live & (slots < capacity))
        slots += live.to(tl.int32)
        left = left & (left - 1)
    if part == tl.num_programs(1) - 1:
        tl.store(ptrs.counts + row, tl.minimum(before + tl.sum(taken, 0), capacity))


# A chunk's published status (``_kept_list_kernel``): the call's tag (its epoch + 1) from bit
# 33, bit 32 set where the count is the prefix through the chunk, the count in bits 0-31.
STATUS_TAG_SHIFT = tl.constexpr(33)
STATUS_PREFIX = tl.constexpr(1 << 32)
STATUS_COUNT = tl.constexpr((1 << 32) - 1)


# num_chunks is not specialized: at 1 (one chunk of keys) the look-back loop folds to a
# constant and Triton 3.6's coalescing pass fails on what remains (PassManager::run failed,
# offline sm_90a).
@triton.jit(do_not_specialize=["num_chunks"])
def _kept_list_kernel(ptrs, mask_layout, sizes, list_heads, scan_rows, num_chunks, capacity,
                      MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, CHUNK: tl.constexpr,
                      LOOKBACK: tl.constexpr):
    """Both list passes in one launch. Grid (list rows, chunks of CHUNK keys); ``ptrs`` is an
    ``operands.OnePassListPointers``. A program takes its row's next ticket, which names its
    chunk (ticket mod chunks) and the call (ticket div chunks: tickets are never reset, so
    each call's tag differs from the last), counts the chunk's kept keys, publishes the count,
    then adds the counts of the chunks before its own, read LOOKBACK at a time back from the
    nearest until one has published its prefix (decoupled look-back), publishes its own
    prefix and writes its keys after the others'. Tickets go out in the order programs start,
    so every chunk a program waits on belongs to a program already running: no wait can
    deadlock. The row's last chunk writes the list's length."""
    row = tl.program_id(0)
    ticket = tl.atomic_add(ptrs.tickets + row, 1)
    chunk = (ticket % num_chunks).to(tl.int32)
    tag = ticket // num_chunks + 1
    keys, kept = _kept_in_chunk(ptrs, mask_layout, sizes, row, list_heads, scan_rows, chunk,
                                MASK_KIND, IS_CAUSAL, CHUNK)
    taken = kept.to(tl.int32)
    total = tl.sum(taken, 0).to(tl.int64)
    statuses = ptrs.statuses + row.to(tl.int64) * num_chunks
    tl.atomic_xchg(statuses + chunk, (tag << STATUS_TAG_SHIFT) | total, sem="release")
    # The chunks before this one, LOOKBACK at a time from the nearest: their counts up to the
    # nearest that published its prefix are added once all of those have published this
    # call's count (else the window is read again).
    before = total * 0
    behind = chunk
    back = tl.arange(0, LOOKBACK)
    while behind > 0:
        earlier = behind - 1 - back
        valid = earlier >= 0
        words = tl.atomic_add(statuses + earlier, 0, mask=valid, sem="acquire")
        ready = ((words >> STATUS_TAG_SHIFT) == tag) | ~valid
        nearest = tl.min(tl.where(valid & ((words & STATUS_PREFIX) != 0), back, LOOKBACK), 0)
        needed = valid & (back <= nearest)
        waiting = tl.sum((needed & ~ready).to(tl.int32), 0) > 0
        added = tl.sum(tl.where(needed, words & STATUS_COUNT, 0), 0)
        before += tl.where(waiting, 0, added)
        behind = tl.where(waiting, behind, tl.where(nearest < LOOKBACK, 0, behind - LOOKBACK))
    tl.atomic_xchg(statuses + chunk,
                   (tag << STATUS_TAG_SHIFT) | STATUS_PREFIX | (before + total), sem="release")
    slot = before + tl.cumsum(taken, 0) - 1
    tl.store(ptrs.kept + row.to(tl.int64) * capacity + slot, keys,
             mask=(taken != 0) & (slot < capacity))
    if chunk == num_chunks - 1:
        tl.store(ptrs.counts + row, tl.minimum(before + total, capacity).to(tl.int32))


@triton.jit
def _gather_decode_kernel(ptrs, q_strides, k_strides, v_strides, o_strides, mask_layout,
                          bias_layout, sizes, qk_scale, list_heads, list_batch_stride,
                          list_head_div, capacity, MASK_KIND: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          GROUP_PACK: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BIAS_ROW: tl.constexpr, IS_CAUSAL: tl.constexpr,
                          SPLIT_KEYS: tl.constexpr, ROW_TESTS: tl.constexpr,
                          DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr):
    """Grid (batch x query heads // GROUP_PACK, 1, key shares). Tile row r is query position
    r // GROUP_PACK of query head first_head + r % GROUP_PACK; the pack's heads share one KV
    head and one list (list row: batch b * ``list_batch_stride`` + head // ``list_head_div``,
    of ``list_heads`` heads). ``ptrs`` is an ``operands.GatherPointers``; the mask there is
    interval words (int64) or a bool mask (bytes), read at the gathered keys. Without
    ``ROW_TESTS`` (one query row: its list holds exactly the keys it keeps, causality included)
    the mask is not read and every listed key is kept."""
    seqlen_q = sizes.seqlen_q
    seqlen_k = sizes.seqlen_k
    program = tl.program_id(0)
    heads_grid = sizes.heads_q // GROUP_PACK
    b = program // heads_grid
    first_head = (program % heads_grid) * GROUP_PACK
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    offs_m, heads, row_ok, offs_d, d_ok, q = packed_query_tile(
        ptrs.q, q_strides, b, first_head, 0, seqlen_q, HEAD_DIM, BLOCK_D, BLOCK_M, GROUP_PACK)
    safe_m = tl.minimum(offs_m, seqlen_q - 1)
    offs_j = tl.arange(0, BLOCK_N)
    kv_head = first_head // sizes.group_size
    k_base = ptrs.k + b.to(tl.int64) * k_strides.stride_b + kv_head.to(tl.int64) * k_strides.stride_h
    v_base = ptrs.v + b.to(tl.int64) * v_strides.stride_b + kv_head.to(tl.int64) * v_strides.stride_h
    if MASK_KIND == BOOL_MASK:
        mask_rows = ptrs.mask + b.to(tl.int64) * mask_layout.stride_b \
            + row_offsets(safe_m, heads, mask_layout.head_div, mask_layout.stride_m,
                          mask_layout.stride_h)[:, None]
        end_rows = mask_rows
    else:  # intervals: one key vector for the pack's one mask head
        run_offset = b.to(tl.int64) * mask_layout.stride_b \
            + (first_head // mask_layout.head_div).to(tl.int64) * mask_layout.stride_h \
            + tl.zeros([1, 1], dtype=tl.int64)
        mask_rows = ptrs.mask + run_offset
        end_rows = ptrs.mask_end + run_offset
    if BIAS_ROW:
        bias_rows = ptrs.bias + b.to(tl.int64) * bias_layout.stride_b \
            + (first_head // bias_layout.head_div).to(tl.int64) * bias_layout.stride_h \
            + tl.zeros([1, 1], dtype=tl.int64)
    else:
        bias_rows = ptrs.bias + b.to(tl.int64) * bias_layout.stride_b \
            + row_offsets(safe_m, heads, bias_layout.head_div, bias_layout.stride_m,
                          bias_layout.stride_h)[:, None]

    list_row = b * list_batch_stride + (first_head // list_head_div) % list_heads
    kept_base = ptrs.kept + list_row.to(tl.int64) * capacity
    count = tl.load(ptrs.counts + list_row)
    blocks = tl.cdiv(count, BLOCK_N)
    per_share = tl.cdiv(blocks, num_splits)
    block_lo = split * per_share
    block_hi = tl.minimum(block_lo + per_share, blocks)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    diagonal = seqlen_k - seqlen_q
    for block in range(block_lo, block_hi):
        slots = block * BLOCK_N + offs_j
        listed = slots < count
        keys = tl.load(kept_base + slots, mask=listed, other=0)
        key_off = keys.to(tl.int64)
        kv_ok = listed[:, None] & d_ok[None, :]
        k = tl.load(k_base + key_off[:, None] * k_strides.stride_l + offs_d[None, :],
                    mask=kv_ok, other=0.0)
        # V's rows are requested with K's, before the scores need K: both gathers are then in
        # flight at once.
        v = tl.load(v_base + key_off[:, None] * v_strides.stride_l + offs_d[None, :],
                    mask=kv_ok, other=0.0)
        keep = row_ok[:, None] & listed[None, :]
        mask_offsets = key_off[None, :] * mask_layout.stride_n
        if ROW_TESTS:
            if MASK_KIND == BOOL_MASK:
                keep = keep & (tl.load(mask_rows + mask_offsets, mask=keep, other=0) != 0)
            else:
                start, end = _runs_at(mask_rows + mask_offsets, end_rows + mask_offsets,
                                      listed[None, :], MASK_KIND)
                keep = keep & rows_within(offs_m[:, None], start, end)
            if IS_CAUSAL:
                keep = keep & (keys[None, :] <= offs_m[:, None] + diagonal)
        s = mma(q, tl.trans(k), DOT_PRECISION, WIDEN_DOTS) * qk_scale
        if HAS_BIAS:
            if BIAS_ROW:
                bias = tl.load(bias_rows + key_off[None, :] * bias_layout.stride_n,
                               mask=listed[None, :], other=0.0)
            else:
                bias = tl.load(bias_rows + key_off[None, :] * bias_layout.stride_n,
                               mask=keep, other=0.0)
            s += bias.to(tl.float32) * LOG2E
        s = tl.where(keep, s, float("-inf"))
        p, alpha, m_new, l_i = online_softmax_step(s, m_i, l_i)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, WIDEN_DOTS)
        m_i = m_new

    store_rows(ptrs, o_strides, acc, l_i, m_i, b, heads, offs_m, offs_d, row_ok, d_ok,
               sizes.heads_q, seqlen_q, split, num_splits, tl.num_programs(0) * GROUP_PACK,
               ptrs.arrivals + program, SPLIT_KEYS, BLOCK_M, BLOCK_D)
