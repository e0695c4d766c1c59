"""The Hopper forward's consumer warpgroups (``attention_forward`` describes the kernel): per
key block the score and PV products in turns with the other warpgroups, the online softmax
between them, a masked tile's keep; then the rows' output and LSE written. Warpgroup w owns
rows [w * ROWS, (w + 1) * ROWS) of a work tile. Also the keys of a packed sequence's tiles
(``document_keys``), which the loader walks too."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from . import named_barriers
from .forms import (BIAS_KEY_ALIGN, CONSUMER_THREADS, CONSUMER_WARPS, INTERVAL_WORDS, MASK_ROW,
                    MASK_TILE, NO_MASK)
from .gluon_compat import reinterpret, tma_store
from .ring import copy_view
from .softmax import finish_rows, fold_scores, join_bias


@gluon.jit
def document_keys(k_base, seqlen_k, DOCUMENTS: gl.constexpr, HAS_BIAS: gl.constexpr):
    """(the packed key of block 0's first column, keys from it, hidden keys before the
    sequence's first) of a tile's keys. With DOCUMENTS and HAS_BIAS a sequence's key blocks
    start at the BIAS_KEY_ALIGN boundary at or before its first key, so that every bias box is
    aligned; the ``shift`` keys before it fall in block 0, which is always tested per pair,
    and are hidden there (``hidden_before``). Otherwise the sequence's own keys, no shift."""
    shift = 0
    if DOCUMENTS and HAS_BIAS:
        shift = k_base % BIAS_KEY_ALIGN
    return k_base - shift, seqlen_k + shift, shift


@gluon.jit
def hidden_before(shift, BLOCK_N: gl.constexpr, DOCUMENTS: gl.constexpr,
                   HAS_BIAS: gl.constexpr, s_layout: gl.constexpr):
    """Block 0's keep for ``document_keys``' shift: [1, BLOCK_N], 0 on the ``shift`` keys
    before the sequence's first; None where there is no shift."""
    keep = None
    if DOCUMENTS and HAS_BIAS:
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = (cols >= shift).to(gl.int8)[None, :]
    return keep


@gluon.jit
def _take_turn(WARPGROUP: gl.constexpr):
    """Wait until this warpgroup may issue its products: its named barrier completes once the
    previous warpgroup's 128 threads have arrived on it (``_pass_turn``), FlashAttention-3's
    warp scheduler barriers. H200, two warpgroups, against a pair of mbarriers: 0.96-0.99x the
    time on dense D128 and biased forwards, the same bits (one process, CUDA graphs)."""
    named_barriers.sync(named_barriers.FIRST_FREE + WARPGROUP, 2 * CONSUMER_THREADS)


@gluon.jit
def _pass_turn(WARPGROUP: gl.constexpr, CONSUMERS: gl.constexpr):
    """Let the next warpgroup of the CONSUMERS, round robin, issue its products."""
    named_barriers.arrive(named_barriers.FIRST_FREE + (WARPGROUP + 1) % CONSUMERS,
                          2 * CONSUMER_THREADS)


@gluon.jit
def _key_blocks(first, stop, ring, acc, p, m_i, l_i, q_tile, kv, qk_scale, rows,
                seqlen_k, diagonal, masks, lists, row, count, biases,
                WARPGROUP: gl.constexpr, CONSUMERS: gl.constexpr, MASK_KIND: gl.constexpr,
                TESTED: gl.constexpr, CAUSAL: gl.constexpr, HAS_BIAS: gl.constexpr,
                s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
    """Key blocks [first, stop) of a tile whose block 0 sits at ring position ``ring``: per
    block j, issue S_j and block j - 1's PV product, fold S_j while PV runs, then rescale.
    ``p`` enters as block first - 1's and leaves as block stop - 1's. With a MASK_KIND the
    blocks are positions of the tile's list ``row`` (``lists``); TESTED blocks are tested per
    pair (with a MASK_KIND, by what ``masks`` holds for them too). With HAS_BIAS, the block's
    bias (``biases``: a row in the slot beside K, or the warpgroup's tile) joins the scores."""
    ROWS: gl.constexpr = q_tile.shape[0]
    BLOCK_N: gl.constexpr = kv.keys.shape[1]
    for j in range(first, stop):
        first_col = _first_col(lists, row, j, count, BLOCK_N, MASK_KIND, TESTED)
        slot, prev_slot = kv.wait_step(ring + j)
        _take_turn(WARPGROUP)
        s_token = warpgroup_mma(q_tile, kv.keys.index(slot).permute((1, 0)),
                                gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                                use_acc=False, is_async=True)
        o_token = warpgroup_mma(p, kv.values.index(prev_slot), acc, is_async=True)
        _pass_turn(WARPGROUP, CONSUMERS)
        # wgmma groups retire in issue order: one left outstanding is the PV product.
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_token,))
        p_next, m_i, l_i, alpha = _fold_block(
            s, slot, ring + j, first_col, m_i, l_i, kv, qk_scale, rows, seqlen_k, diagonal,
            masks, biases, WARPGROUP, MASK_KIND, TESTED, CAUSAL, HAS_BIAS, s_layout, o_layout,
            p_layout, q_tile.dtype)
        # P's registers are the PV product's operand until it retires. Passing the softmax's
        # results through the wait as well keeps LLVM from sinking the softmax below it, which
        # would serialize the two (measured: +1-3% at head dim 128, +6% at 64, H100).
        acc, p, p_next, l_i, alpha = warpgroup_mma_wait(
            num_outstanding=0, deps=(o_token, p, p_next, l_i, alpha))
        kv.free_values(prev_slot)
        acc = acc * alpha[:, None]
        p = p_next
    return acc, p, m_i, l_i


@gluon.jit
def _serial_key_blocks(first, stop, ring, acc, m_i, l_i, q_tile, kv, qk_scale, rows,
                       seqlen_k, diagonal, masks, lists, row, count, biases,
                       WARPGROUP: gl.constexpr, CONSUMERS: gl.constexpr,
                       MASK_KIND: gl.constexpr, TESTED: gl.constexpr, CAUSAL: gl.constexpr,
                       HAS_BIAS: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                       p_layout: gl.constexpr):
    """Key blocks [first, stop) one after another, as ``_key_blocks`` walks them but without
    the overlap within the warpgroup: S_j, its softmax, then P_j V_j, retired before S_{j+1}
    is issued; the other warpgroups' products hold the tensor cores meanwhile. The scores, P
    and O are live together, not a second P (three warpgroups over 128-key blocks at head dim
    64 fit 160 registers so)."""
    ROWS: gl.constexpr = q_tile.shape[0]
    BLOCK_N: gl.constexpr = kv.keys.shape[1]
    for j in range(first, stop):
        first_col = _first_col(lists, row, j, count, BLOCK_N, MASK_KIND, TESTED)
        slot = kv.wait_keys(ring + j)
        _take_turn(WARPGROUP)
        s_token = warpgroup_mma(q_tile, kv.keys.index(slot).permute((1, 0)),
                                gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                                use_acc=False, is_async=True)
        _pass_turn(WARPGROUP, CONSUMERS)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_token,))
        p, m_i, l_i, alpha = _fold_block(
            s, slot, ring + j, first_col, m_i, l_i, kv, qk_scale, rows, seqlen_k, diagonal,
            masks, biases, WARPGROUP, MASK_KIND, TESTED, CAUSAL, HAS_BIAS, s_layout, o_layout,
            p_layout, q_tile.dtype)
        acc = acc * alpha[:, None]
        slot = kv.wait_values(ring + j)
        o_token = warpgroup_mma(p, kv.values.index(slot), acc, is_async=True)
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(o_token, p))
        kv.free_values(slot)
    return acc, m_i, l_i


@gluon.jit
def _first_col(lists, row, j, count, BLOCK_N: gl.constexpr, MASK_KIND: gl.constexpr,
               TESTED: gl.constexpr):
    """The first key of block position ``j``: with a MASK_KIND a tested block is the list's
    entry ``j`` of ``row``."""
    if MASK_KIND != NO_MASK and TESTED:
        first_col = lists.block(row, j, count) * BLOCK_N
    else:
        first_col = j * BLOCK_N
    return first_col


@gluon.jit
def _fold_block(s, slot, position, first_col, m_i, l_i, kv, qk_scale, rows, seqlen_k, diagonal,
                masks, biases, WARPGROUP: gl.constexpr, MASK_KIND: gl.constexpr,
                TESTED: gl.constexpr, CAUSAL: gl.constexpr, HAS_BIAS: gl.constexpr,
                s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                dtype: gl.constexpr):
    """The scores ``s`` of the key block at ring ``position`` (K's ``slot``) with its bias
    (``bias.ForwardBias``) and its keep, folded into the online softmax; frees the K slot.
    Returns (P, m_i, l_i, alpha)."""
    ROWS: gl.constexpr = s.shape[0]
    MASKED: gl.constexpr = MASK_KIND != NO_MASK
    # A tested block of KeyIntervals not causal (key-ordered intervals, causality folded in):
    # one select per score (``_hidden_outside_intervals``).
    ONE_SELECT: gl.constexpr = (MASK_KIND == INTERVAL_WORDS) and TESTED and not CAUSAL
    # The mask bytes are read after the score product's wait: read before it (beside the
    # product) they cost as much or more (H200: 1556-1767 against 1569-1683 us on three
    # masks). The bias row before the mask: the other way round ptxas (sm_90a, offline) kept a
    # KeyIntervals block's 64 word registers beside it and spilled 22 words a block.
    bias_row = biases.scores_bias(slot, position, WARPGROUP, HAS_BIAS, s_layout)
    if ONE_SELECT:
        s, scale = join_bias(s, qk_scale, bias_row)  # before the words are read
        words = _interval_words(masks, slot, s_layout)
        kv.free_keys(slot)
        s = _hidden_outside_intervals(s, words, rows)
        p, m_i, l_i, alpha = fold_scores(
            s, m_i, l_i, scale, rows, first_col, seqlen_k, diagonal, None, None, False,
            CAUSAL, s_layout, o_layout, p_layout, dtype, MASKED)
    else:
        keep = None
        if MASKED and TESTED:
            keep = _keeps(masks, slot, rows, WARPGROUP, ROWS, s_layout, MASK_KIND)
        kv.free_keys(slot)
        p, m_i, l_i, alpha = fold_scores(
            s, m_i, l_i, qk_scale, rows, first_col, seqlen_k, diagonal, keep, bias_row,
            TESTED, CAUSAL, s_layout, o_layout, p_layout, dtype, MASKED)
    return p, m_i, l_i, alpha


@gluon.jit
def _keeps(masks, slot, rows, WARPGROUP: gl.constexpr, ROWS: gl.constexpr,
           s_layout: gl.constexpr, MASK_KIND: gl.constexpr):
    """Which pairs of this warpgroup's rows by the key block in ``slot`` the mask keeps, in
    the score layout: [ROWS, BLOCK_N], or [1, BLOCK_N] for a row shared by every query row.
    A [1, BLOCK_N] row of shared memory reads 16 two-byte (mask bytes) or 16-byte (interval
    words) loads per thread, against 32 two-byte loads for a tile's rows (offline, sm_90a)."""
    if MASK_KIND == MASK_TILE:
        keep = masks.index(slot).slice(WARPGROUP * ROWS, ROWS, dim=0).load(s_layout) != 0
    elif MASK_KIND == MASK_ROW:
        keep = masks.index(slot).load(s_layout) != 0
    else:
        start, end = _interval_bounds(_interval_words(masks, slot, s_layout))
        keep = (start <= rows[:, None]) & (rows[:, None] < end)
    return keep


@gluon.jit
def _interval_words(masks, slot, s_layout: gl.constexpr):
    """The [1, BLOCK_N] int64 interval words of the key block in ``slot``, in the score
    layout."""
    BLOCK_N: gl.constexpr = masks.shape[2] // 2
    return reinterpret(masks.index(slot), gl.int64, [1, BLOCK_N],
                       gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=64,
                                            rank=2)).load(s_layout)


@gluon.jit
def _interval_bounds(words):
    """(start, end) of interval words: the low half of a word is the key's first row, the high
    half one past its last."""
    return (words & 0xFFFFFFFF).to(gl.int32), (words >> 32).to(gl.int32)


@gluon.jit
def _hidden_outside_intervals(s, words, rows):
    """``s`` with -inf where row ``rows`` is outside the key's [start, end) (``words``): two
    compares and one select per score. Written as ``gl.where`` of the two compares' and, LLVM
    splits the select in two (sm_90a: 128 ISETP and 128 FSEL per thread and block, here 128
    and 64)."""
    start, end = _interval_bounds(words)
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.le.s32 p, $2, $4; setp.lt.and.s32 p, $4, $3, p; "
        "selp.f32 $0, $1, 0fFF800000, p; }",
        "=r,r,r,r,r", [s, start, end, rows[:, None]], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _overlapped_tile(ring, num_blocks, unmasked_blocks, first_col, shift, acc, m_i, l_i, q_tile,
                     q_free, kv, work, qk_scale, rows, seqlen_k, diagonal, masks, lists, row,
                     count, biases, WARPGROUP: gl.constexpr, CONSUMERS: gl.constexpr,
                     MASK_KIND: gl.constexpr, HAS_BIAS: gl.constexpr, s_layout: gl.constexpr,
                     o_layout: gl.constexpr, p_layout: gl.constexpr):
    """A tile's key blocks with each block's PV product in flight during the next block's
    softmax (``_key_blocks``): block 0's scores alone, the blocks after it, then the last
    block's PV product. Returns (O, m_i, l_i)."""
    ROWS: gl.constexpr = q_tile.shape[0]
    BLOCK_N: gl.constexpr = work.BLOCK_N
    CAUSAL: gl.constexpr = work.CAUSAL
    MASKED: gl.constexpr = MASK_KIND != NO_MASK
    dtype: gl.constexpr = q_tile.dtype
    # Key block 0: its scores alone (no PV product yet), always tested per pair.
    slot = kv.wait_keys(ring)
    _take_turn(WARPGROUP)
    s_token = warpgroup_mma(q_tile, kv.keys.index(slot).permute((1, 0)),
                            gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                            use_acc=False, is_async=True)
    _pass_turn(WARPGROUP, CONSUMERS)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_token,))
    keep = hidden_before(shift, BLOCK_N, work.DOCUMENTS, HAS_BIAS, s_layout)
    if MASKED:
        keep = _keeps(masks, slot, rows, WARPGROUP, ROWS, s_layout, MASK_KIND)
    bias_row = biases.scores_bias(slot, ring, WARPGROUP, HAS_BIAS, s_layout)
    kv.free_keys(slot)
    p, m_i, l_i, alpha = fold_scores(s, m_i, l_i, qk_scale, rows, first_col, seqlen_k,
                                     diagonal, keep, bias_row, True, CAUSAL, s_layout,
                                     o_layout, p_layout, dtype, MASKED)

    acc, p, m_i, l_i = _key_blocks(
        1, unmasked_blocks, ring, acc, p, m_i, l_i, q_tile, kv, qk_scale, rows,
        seqlen_k, diagonal, masks, lists, row, count, biases, WARPGROUP, CONSUMERS,
        MASK_KIND, False, CAUSAL, HAS_BIAS, s_layout, o_layout, p_layout)
    acc, p, m_i, l_i = _key_blocks(
        gl.maximum(unmasked_blocks, 1), num_blocks, ring, acc, p, m_i, l_i, q_tile, kv,
        qk_scale, rows, seqlen_k, diagonal, masks, lists, row, count, biases,
        WARPGROUP, CONSUMERS, MASK_KIND, True, CAUSAL, HAS_BIAS, s_layout, o_layout,
        p_layout)
    # Every score product has retired: the loader may bring the next tile's Q while the
    # last PV product and the epilogue run.
    mbarrier.arrive(q_free.index(WARPGROUP), count=1)

    # The last block's PV product.
    slot = kv.wait_values(ring + num_blocks - 1)
    _take_turn(WARPGROUP)
    o_token = warpgroup_mma(p, kv.values.index(slot), acc, is_async=True)
    _pass_turn(WARPGROUP, CONSUMERS)
    acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(o_token, p))
    kv.free_values(slot)
    return acc, m_i, l_i


@gluon.jit
def _consumer(q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists, biases,
              o_desc, lse_ptr, out_rows, qk_scale, WARPGROUP: gl.constexpr,
              MASK_KIND: gl.constexpr, HAS_BIAS: gl.constexpr, OVERLAP: gl.constexpr):
    CONSUMERS: gl.constexpr = q_tiles.shape[0]
    ROWS: gl.constexpr = q_tiles.shape[1]
    MASKED: gl.constexpr = MASK_KIND != NO_MASK
    BLOCK_D: gl.constexpr = q_tiles.shape[2]
    BLOCK_N: gl.constexpr = work.BLOCK_N
    CAUSAL: gl.constexpr = work.CAUSAL
    dtype: gl.constexpr = q_tiles.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1], instr_shape=[16, BLOCK_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_tile = q_tiles.index(WARPGROUP)
    o_tile = o_tiles.index(WARPGROUP)
    lse_rows = work.seqlen_q  # the LSE's rows per (batch, head): every packed row

    ring = 0  # key blocks consumed so far, over this program's tiles
    if WARPGROUP == CONSUMERS - 1:  # warpgroup 0 issues first (the last arrival is not awaited)
        _pass_turn(WARPGROUP, CONSUMERS)
    for visit in range(work.visits()):  # this program's tiles so far
        batch, q_head, kv_head, q_start, bh, q_base, k_base, seqlen_q, seqlen_k = \
            work.coordinates(work.tile(visit))
        _, seqlen_k, shift = document_keys(k_base, seqlen_k, work.DOCUMENTS, HAS_BIAS)
        diagonal = seqlen_k - seqlen_q  # bottom-right causal: row r sees keys <= r + diagonal
        if MASKED:
            row, _, _ = lists.row(batch, q_head, q_start // work.TILE_ROWS)
            count, unmasked_blocks = lists.counts(row)
            num_blocks = gl.maximum(count, 1)
            first_col = lists.block(row, 0, count) * BLOCK_N
        else:
            row = 0
            count = 0
            num_blocks, unmasked_blocks = work.key_blocks(q_start, seqlen_q, seqlen_k)
            first_col = 0
        first_row = q_start + WARPGROUP * ROWS
        rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        m_i = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([ROWS, BLOCK_D], gl.float32, o_layout)

        mbarrier.wait(q_ready.index(WARPGROUP), visit & 1)
        if OVERLAP:
            acc, m_i, l_i = _overlapped_tile(
                ring, num_blocks, unmasked_blocks, first_col, shift, acc, m_i, l_i, q_tile,
                q_free, kv, work, qk_scale, rows, seqlen_k, diagonal, masks, lists, row, count,
                biases, WARPGROUP, CONSUMERS, MASK_KIND, HAS_BIAS, s_layout, o_layout,
                p_layout)
        else:
            # Key block 0 is always tested per pair (no packed documents: the entry asserts it).
            acc, m_i, l_i = _serial_key_blocks(
                0, 1, ring, acc, m_i, l_i, q_tile, kv, qk_scale, rows, seqlen_k, diagonal,
                masks, lists, row, count, biases, WARPGROUP, CONSUMERS, MASK_KIND, True,
                CAUSAL, HAS_BIAS, s_layout, o_layout, p_layout)
            acc, m_i, l_i = _serial_key_blocks(
                1, unmasked_blocks, ring, acc, m_i, l_i, q_tile, kv, qk_scale, rows,
                seqlen_k, diagonal, masks, lists, row, count, biases, WARPGROUP, CONSUMERS,
                MASK_KIND, False, CAUSAL, HAS_BIAS, s_layout, o_layout, p_layout)
            acc, m_i, l_i = _serial_key_blocks(
                gl.maximum(unmasked_blocks, 1), num_blocks, ring, acc, m_i, l_i, q_tile, kv,
                qk_scale, rows, seqlen_k, diagonal, masks, lists, row, count, biases,
                WARPGROUP, CONSUMERS, MASK_KIND, True, CAUSAL, HAS_BIAS, s_layout, o_layout,
                p_layout)
            mbarrier.arrive(q_free.index(WARPGROUP), count=1)
        ring += num_blocks

        out, lse = finish_rows(acc, m_i, l_i, o_layout)
        gl.store(lse_ptr + bh.to(gl.int64) * lse_rows + q_base + rows, lse,
                 mask=rows < seqlen_q)
        if work.DOCUMENTS:
            # A sequence's last rows: a TMA box would write the next sequence's rows too.
            if first_row + ROWS > seqlen_q:
                out_rows.store(out.to(dtype), q_base, first_row, seqlen_q, q_head, o_layout)
            else:
                _store_tile(o_tile, out.to(dtype), o_desc, batch, q_base + first_row, q_head)
        else:
            _store_tile(o_tile, out.to(dtype), o_desc, batch, first_row, q_head)
    tma.store_wait(pendings=0)


@gluon.jit
def _store_tile(o_tile, out, o_desc, batch, first_row, q_head):
    """Write a warpgroup's output rows from ``first_row`` through its staging tile and TMA
    (rows past the tensor's end are not written)."""
    tma.store_wait(pendings=0)  # the previous tile's output has left the staging tile
    o_tile.store(out)
    fence_async_shared()
    tma_store(o_desc, [batch, first_row, q_head, 0], copy_view(o_tile))


@gluon.jit
def first_consumer(q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists, biases,
                    o_desc, lse_ptr, out_rows, qk_scale, MASK_KIND: gl.constexpr,
                    HAS_BIAS: gl.constexpr, OVERLAP: gl.constexpr):
    _consumer(q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists, biases, o_desc,
              lse_ptr, out_rows, qk_scale, 0, MASK_KIND, HAS_BIAS, OVERLAP)


@gluon.jit
def second_consumer(q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists, biases,
                     o_desc, lse_ptr, out_rows, qk_scale, MASK_KIND: gl.constexpr,
                     HAS_BIAS: gl.constexpr, OVERLAP: gl.constexpr):
    _consumer(q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists, biases, o_desc,
              lse_ptr, out_rows, qk_scale, 1, MASK_KIND, HAS_BIAS, OVERLAP)


@gluon.jit
def third_consumer(q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists, biases,
                   o_desc, lse_ptr, out_rows, qk_scale, MASK_KIND: gl.constexpr,
                   HAS_BIAS: gl.constexpr, OVERLAP: gl.constexpr):
    _consumer(q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists, biases, o_desc,
              lse_ptr, out_rows, qk_scale, 2, MASK_KIND, HAS_BIAS, OVERLAP)
