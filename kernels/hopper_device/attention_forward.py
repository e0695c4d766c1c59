"""The attention forward for Hopper: one loader warp and two consumer warpgroups per program,
a persistent grid.

A work tile is 2 x ROWS query rows of one (batch, query head); consumer warpgroup w owns rows
[w * ROWS, (w + 1) * ROWS) of it. Each program walks its share of the tiles (``_tile_at``).
The loader warp issues the TMA copies: a tile's two Q tiles, then its key blocks' K and V into
a ring of STAGES slots that runs on across tiles. Every slot has a ``ready`` barrier (its copy
landed; the copy's byte count completes it) and a ``free`` barrier (both warpgroups have read
it: two arrivals); each Q tile has the same pair, freed once its warpgroup's last score
product retired, so the next tile's Q arrives during the last PV product and the epilogue.
The output leaves through its own staging tiles. Per key block j a consumer warpgroup issues
S_j = Q K_j^T and O += P_{j-1} V_{j-1} as asynchronous wgmma back to back, waits for S_j
alone, folds S_j into the online softmax, then waits for the PV product and rescales O. The two
warpgroups take turns to issue their products (a named barrier each: ``_take_turn``), so
that one's softmax runs while the other's products hold the tensor cores.

Every operand goes through a rank-4 TMA descriptor over the caller's (B, L, H, D) tensor: a
tile is [1, rows, 1, BLOCK_D] at (batch, first row, head, 0). Rows past a sequence's end and
columns past the head dim arrive as zeros and are never written back, so any length, any head
dim a descriptor can address, strided views and GQA (key head = query head // group) need no
copy and no bounds test on a load. Shared tiles are allocated rank-2 and viewed rank-4 only
for the copies (``ring.copy_view``).

With HAS_BIAS (a bias of one row per (batch, head)), the loader copies each key block's bias
row beside K (``ring.fill_biased``), and the consumers add it, x log2 e, to the scaled scores
(``softmax.fold_scores``).

The roles live beside this module: ``ring`` (the K/V slots and their barriers, as one value),
``tiles`` (the tile scheduler and each tile's key-block walk), ``softmax`` (the online softmax
and the rows' finish). This module holds the loader, the consumers and the entry point.
"""


from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from . import named_barriers
from .gluon_compat import reinterpret, tma_load, tma_store
from .bias import BiasRows
from .output_rows import OutputRows
from .ring import KeyValueRing, copy_view
from .softmax import finish_rows, fold_scores
from .tiles import BlockLists, WorkTiles

CONSUMER_WARPS = gl.constexpr(4)  # one warpgroup
CONSUMER_THREADS = gl.constexpr(128)
# What a masked tile tests per pair (MASK_KIND), each read through TMA into a slot beside K:
NO_MASK = gl.constexpr(0)
MASK_TILE = gl.constexpr(1)  # bool bytes, one row per query row: [2 x ROWS, BLOCK_N] a slot
MASK_ROW = gl.constexpr(2)  # bool bytes, one row for every query row: [1, BLOCK_N] a slot
# KeyIntervals, an int32 (start, end) pair per key, copied as [1, 2 x BLOCK_N] int32 (newer
# Triton refuses 64-bit descriptors) and read as [1, BLOCK_N] int64 words.
INTERVAL_WORDS = gl.constexpr(3)
# A TMA box's first element must be 16-byte aligned (a box of bias keys starting elsewhere
# faults, "illegal instruction", H200): 8 two-byte or 4 four-byte bias keys.
BIAS_KEY_ALIGN = gl.constexpr(8)


@gluon.jit
def _document_keys(k_base, seqlen_k, DOCUMENTS: gl.constexpr, HAS_BIAS: gl.constexpr):
    """(the packed key of block 0's first column, keys from it, hidden keys before the
    sequence's first) of a tile's keys. With DOCUMENTS and HAS_BIAS a sequence's key blocks
    start at the BIAS_KEY_ALIGN boundary at or before its first key, so that every bias box is
    aligned; the ``shift`` keys before it fall in block 0, which is always tested per pair,
    and are hidden there (``_hidden_before``). Otherwise the sequence's own keys, no shift."""
    shift = 0
    if DOCUMENTS and HAS_BIAS:
        shift = k_base % BIAS_KEY_ALIGN
    return k_base - shift, seqlen_k + shift, shift


@gluon.jit
def _hidden_before(shift, BLOCK_N: gl.constexpr, DOCUMENTS: gl.constexpr,
                   HAS_BIAS: gl.constexpr, s_layout: gl.constexpr):
    """Block 0's keep for ``_document_keys``' shift: [1, BLOCK_N], 0 on the ``shift`` keys
    before the sequence's first; None where there is no shift."""
    keep = None
    if DOCUMENTS and HAS_BIAS:
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = (cols >= shift).to(gl.int8)[None, :]
    return keep


@gluon.jit
def _loader(q_desc, k_desc, v_desc, mask_desc, bias_desc, q_tiles, masks, biases, q_ready,
            q_free, kv, work, lists, bias_heads, MASK_KIND: gl.constexpr,
            HAS_BIAS: gl.constexpr):
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    MASKED: gl.constexpr = MASK_KIND != NO_MASK
    ring = 0  # key blocks loaded so far, over this program's tiles: the ring's position
    for visit in range(work.visits()):  # this program's tiles loaded so far
        batch, q_head, kv_head, q_start, _, q_base, k_base, seqlen_q, seqlen_k = \
            work.coordinates(work.tile(visit))
        k_base, seqlen_k, _ = _document_keys(k_base, seqlen_k, work.DOCUMENTS, HAS_BIAS)
        if MASKED:
            row, mask_batch, mask_head = lists.row(batch, q_head, q_start // work.ROWS2)
            count, full = lists.counts(row)
            num_blocks = gl.maximum(count, 1)
        else:
            num_blocks, _ = work.key_blocks(q_start, seqlen_q, seqlen_k)
        # A barrier that has completed no phase passes a wait for the parity of the phase
        # before phase 0: the first tile's Q does not wait.
        for w in gl.static_range(2):
            mbarrier.wait(q_free.index(w), (visit & 1) ^ 1)
            mbarrier.expect(q_ready.index(w), q_desc.block_type.nbytes)
            tma_load(q_desc, [batch, q_base + q_start + w * ROWS, q_head, 0], q_ready.index(w),
                     copy_view(q_tiles.index(w)))
        for j in range(num_blocks):
            if MASKED:
                block = lists.block(row, j, count)
                first_key = block * work.BLOCK_N
                if MASK_KIND == MASK_TILE:
                    mask_at = (mask_batch, mask_head, q_start, first_key)
                elif MASK_KIND == MASK_ROW:
                    mask_at = (mask_batch, mask_head, 0, first_key)
                else:
                    mask_at = (mask_batch, mask_head, 2 * first_key)
                if HAS_BIAS:
                    kv.fill_biased(ring + j, k_desc, v_desc, batch, first_key, kv_head,
                                   mask_desc, masks, mask_at, (j == 0) | (j >= full),
                                   bias_desc, biases, bias_heads.at(batch, q_head, first_key))
                else:
                    kv.fill_tested(ring + j, k_desc, v_desc, batch, first_key, kv_head,
                                   mask_desc, masks, mask_at, (j == 0) | (j >= full))
            elif HAS_BIAS:
                first_key = k_base + j * work.BLOCK_N
                kv.fill_biased(ring + j, k_desc, v_desc, batch, first_key, kv_head, None, None,
                               None, False, bias_desc, biases,
                               bias_heads.at(batch, q_head, first_key))
            else:
                kv.fill(ring + j, k_desc, v_desc, batch, k_base + j * work.BLOCK_N, kv_head)
        ring += num_blocks


@gluon.jit
def _take_turn(WARPGROUP: gl.constexpr):
    """Wait until this warpgroup may issue its products: its named barrier completes once the
    other warpgroup's 128 threads have arrived on it (``_pass_turn``), FlashAttention-3's warp
    scheduler barriers. H200, against a pair of mbarriers: 0.96-0.99x the time on dense D128
    and biased forwards, the same bits (one process, CUDA graphs)."""
    named_barriers.sync(named_barriers.FIRST_FREE + WARPGROUP, 2 * CONSUMER_THREADS)


@gluon.jit
def _pass_turn(WARPGROUP: gl.constexpr):
    named_barriers.arrive(named_barriers.FIRST_FREE + 1 - WARPGROUP, 2 * CONSUMER_THREADS)


@gluon.jit
def _key_blocks(first, stop, ring, acc, p, m_i, l_i, q_tile, kv, qk_scale, rows,
                seqlen_k, diagonal, masks, lists, row, count, biases,
                WARPGROUP: gl.constexpr, MASK_KIND: gl.constexpr, TESTED: gl.constexpr,
                CAUSAL: gl.constexpr, HAS_BIAS: gl.constexpr, s_layout: gl.constexpr,
                o_layout: gl.constexpr, p_layout: gl.constexpr):
    """Key blocks [first, stop) of a tile whose block 0 sits at ring position ``ring``: per
    block j, issue S_j and block j - 1's PV product, fold S_j while PV runs, then rescale.
    ``p`` enters as block first - 1's and leaves as block stop - 1's. With a MASK_KIND the
    blocks are positions of the tile's list ``row`` (``lists``); TESTED blocks are tested per
    pair (with a MASK_KIND, by what ``masks`` holds for them too). With HAS_BIAS, the block's
    bias row (in ``biases``' slot beside K) joins the scores."""
    ROWS: gl.constexpr = q_tile.shape[0]
    BLOCK_N: gl.constexpr = kv.keys.shape[1]
    MASKED: gl.constexpr = MASK_KIND != NO_MASK
    for j in range(first, stop):
        if MASKED and TESTED:
            first_col = lists.block(row, j, count) * BLOCK_N
        else:
            first_col = j * BLOCK_N
        slot, prev_slot = kv.wait_step(ring + j)
        _take_turn(WARPGROUP)
        s_token = warpgroup_mma(q_tile, kv.keys.index(slot).permute((1, 0)),
                                gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                                use_acc=False, is_async=True)
        o_token = warpgroup_mma(p, kv.values.index(prev_slot), acc, is_async=True)
        _pass_turn(WARPGROUP)
        # wgmma groups retire in issue order: one left outstanding is the PV product.
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_token,))
        # The mask bytes are read after the wait: read before it (beside the score product)
        # they cost as much or more (H200: 1556-1767 against 1569-1683 us on three masks).
        keep = None
        if MASKED and TESTED:
            keep = _keeps(masks, slot, rows, WARPGROUP, ROWS, s_layout, MASK_KIND)
        bias_row = _bias_row(biases, slot, HAS_BIAS, s_layout)
        kv.free_keys(slot)
        p_next, m_i, l_i, alpha = fold_scores(
            s, m_i, l_i, qk_scale, rows, first_col, seqlen_k, diagonal, keep, bias_row, TESTED,
            CAUSAL, s_layout, o_layout, p_layout, q_tile.dtype)
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
def _bias_row(biases, slot, HAS_BIAS: gl.constexpr, s_layout: gl.constexpr):
    """With HAS_BIAS, the [1, BLOCK_N] bias row beside K in ``slot``, in the score layout (16
    two-byte shared loads per thread, as a mask row); else None."""
    bias_row = None
    if HAS_BIAS:
        bias_row = biases.index(slot).load(s_layout)
    return bias_row


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
    else:  # the low half of a word is the key's first row, the high half one past its last
        BLOCK_N: gl.constexpr = masks.shape[2] // 2
        words = reinterpret(masks.index(slot), gl.int64, [1, BLOCK_N],
                            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=64,
                                                 rank=2)).load(s_layout)
        start = (words & 0xFFFFFFFF).to(gl.int32)
        end = (words >> 32).to(gl.int32)
        keep = (start <= rows[:, None]) & (rows[:, None] < end)
    return keep


@gluon.jit
def _consumer(q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists, biases,
              o_desc, lse_ptr, out_rows, qk_scale, WARPGROUP: gl.constexpr,
              MASK_KIND: gl.constexpr, HAS_BIAS: gl.constexpr):
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
    if WARPGROUP == 1:  # warpgroup 0 issues first (and the last arrival is never waited for)
        _pass_turn(WARPGROUP)
    for visit in range(work.visits()):  # this program's tiles so far
        batch, q_head, kv_head, q_start, bh, q_base, k_base, seqlen_q, seqlen_k = \
            work.coordinates(work.tile(visit))
        _, seqlen_k, shift = _document_keys(k_base, seqlen_k, work.DOCUMENTS, HAS_BIAS)
        diagonal = seqlen_k - seqlen_q  # bottom-right causal: row r sees keys <= r + diagonal
        if MASKED:
            row, _, _ = lists.row(batch, q_head, q_start // work.ROWS2)
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

        # Key block 0: its scores alone (no PV product yet), always tested per pair.
        mbarrier.wait(q_ready.index(WARPGROUP), visit & 1)
        slot = kv.wait_keys(ring)
        _take_turn(WARPGROUP)
        s_token = warpgroup_mma(q_tile, kv.keys.index(slot).permute((1, 0)),
                                gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                                use_acc=False, is_async=True)
        _pass_turn(WARPGROUP)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_token,))
        keep = _hidden_before(shift, BLOCK_N, work.DOCUMENTS, HAS_BIAS, s_layout)
        if MASKED:
            keep = _keeps(masks, slot, rows, WARPGROUP, ROWS, s_layout, MASK_KIND)
        bias_row = _bias_row(biases, slot, HAS_BIAS, s_layout)
        kv.free_keys(slot)
        p, m_i, l_i, alpha = fold_scores(s, m_i, l_i, qk_scale, rows, first_col, seqlen_k,
                                         diagonal, keep, bias_row, True, CAUSAL, s_layout,
                                         o_layout, p_layout, dtype)

        acc, p, m_i, l_i = _key_blocks(
            1, unmasked_blocks, ring, acc, p, m_i, l_i, q_tile, kv, qk_scale, rows,
            seqlen_k, diagonal, masks, lists, row, count, biases, WARPGROUP, MASK_KIND, False,
            CAUSAL, HAS_BIAS, s_layout, o_layout, p_layout)
        acc, p, m_i, l_i = _key_blocks(
            gl.maximum(unmasked_blocks, 1), num_blocks, ring, acc, p, m_i, l_i, q_tile, kv,
            qk_scale, rows, seqlen_k, diagonal, masks, lists, row, count, biases,
            WARPGROUP, MASK_KIND, True, CAUSAL, HAS_BIAS, s_layout, o_layout, p_layout)
        # Every score product has retired: the loader may bring the next tile's Q while the
        # last PV product and the epilogue run.
        mbarrier.arrive(q_free.index(WARPGROUP), count=1)

        # The last block's PV product.
        slot = kv.wait_values(ring + num_blocks - 1)
        _take_turn(WARPGROUP)
        o_token = warpgroup_mma(p, kv.values.index(slot), acc, is_async=True)
        _pass_turn(WARPGROUP)
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(o_token, p))
        kv.free_values(slot)
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
def _first_consumer(q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists, biases,
                    o_desc, lse_ptr, out_rows, qk_scale, MASK_KIND: gl.constexpr,
                    HAS_BIAS: gl.constexpr):
    _consumer(q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists, biases, o_desc,
              lse_ptr, out_rows, qk_scale, 0, MASK_KIND, HAS_BIAS)


@gluon.jit
def _second_consumer(q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists, biases,
                     o_desc, lse_ptr, out_rows, qk_scale, MASK_KIND: gl.constexpr,
                     HAS_BIAS: gl.constexpr):
    _consumer(q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists, biases, o_desc,
              lse_ptr, out_rows, qk_scale, 1, MASK_KIND, HAS_BIAS)


@gluon.jit(do_not_specialize=["list_batch_stride", "list_head_stride", "list_row_stride",
                              "list_head_div", "mask_head_div", "mask_batches", "bias_head_div",
                              "bias_batches", "seqlen_q",
                              "seqlen_k", "heads_q", "group", "row_tiles", "batch_heads",
                              "num_tiles", "tile_order", "out_row_stride", "head_dim"])
def attention_forward(q_desc, k_desc, v_desc, o_desc, lse_ptr, mask_desc, list_table,
                      list_batch_stride, list_head_stride, list_row_stride, list_head_div,
                      mask_head_div, mask_batches, bias_desc, bias_head_div, bias_batches,
                      documents, cu_q, cu_k, out_ptr, out_row_stride, head_dim,
                      seqlen_q, seqlen_k, heads_q, group,
                      qk_scale, row_tiles, batch_heads, num_tiles, tile_order,
                      CAUSAL: gl.constexpr,
                      MASK_KIND: gl.constexpr, HAS_BIAS: gl.constexpr, DOCUMENTS: gl.constexpr,
                      STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                      LOADER_REGS: gl.constexpr):
    """A persistent grid of at most one program per multiprocessor walks the ``num_tiles`` =
    ``row_tiles`` x ``batch_heads`` work tiles (``tiles.WorkTiles``) in ``tile_order``
    (``tiles.ORDER_HEADS`` or ``tiles.ORDER_BALANCED``). ``lse_ptr``: (B, Hq, Lq)
    float32, natural log. With a MASK_KIND, each tile walks its row of the activity lists
    ``list_table`` (``tiles.BlockLists``) and ``mask_desc`` reads what its tested blocks test:
    a bool mask's bytes as a (Bm, Hm, Lq, Lk) uint8 tensor (MASK_TILE; MASK_ROW: (Bm, Hm, 1,
    Lk)) or KeyIntervals' (start, end) pairs as (Bm, Hm, 2 x Lk) int32 (INTERVAL_WORDS). A
    batch-shared mask has Bm = 1 and ``mask_batches`` 0; query head h reads list head
    h // ``list_head_div`` and mask head h // ``mask_head_div``. Without a mask both are unused
    stand-ins. With HAS_BIAS, ``bias_desc`` reads a bias of one row per (batch, head) as
    (Bb, Hb, 1, Lk) in [1, 1, 1, BLOCK_N] boxes (``bias.BiasRows``: query head h reads bias head
    h // ``bias_head_div``, batch b batch b x ``bias_batches``); without it, a stand-in.
    With DOCUMENTS (no mask; batch 1), the tiles are those of ``documents`` over the
    sequences that ``cu_q`` and ``cu_k`` (int32 offsets) pack (``tiles.WorkTiles``), and a
    sequence's last rows are written through ``out_ptr`` (the output, ``out_row_stride``
    elements a packed row, heads of ``head_dim``); ``seqlen_q`` and ``seqlen_k`` are the packed
    lengths. Without it all five are unread stand-ins.
    Launch with num_warps = 4 (the first consumer warpgroup; the second and the loader warp
    are workers)."""
    gl.static_assert(not DOCUMENTS or MASK_KIND == NO_MASK, "documents take no mask")
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)

    q_tiles = gl.allocate_shared_memory(dtype, [2, ROWS, BLOCK_D], q_layout)
    o_tiles = gl.allocate_shared_memory(dtype, [2, ROWS, BLOCK_D], q_layout)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
    # Beside each K slot, what a tested block's pairs read (MASK_KIND).
    if MASK_KIND == MASK_TILE:
        tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
            [2 * ROWS, BLOCK_N], gl.uint8)
        masks = gl.allocate_shared_memory(gl.uint8, [STAGES, 2 * ROWS, BLOCK_N], tile_layout)
    elif MASK_KIND == MASK_ROW:
        masks = gl.allocate_shared_memory(
            gl.uint8, [STAGES, 1, BLOCK_N],
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2))
    elif MASK_KIND == INTERVAL_WORDS:
        masks = gl.allocate_shared_memory(
            gl.int32, [STAGES, 1, 2 * BLOCK_N],
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
    else:
        masks = k_ring
    if HAS_BIAS:  # beside each K slot, the block's bias row
        biases = gl.allocate_shared_memory(
            dtype, [STAGES, 1, BLOCK_N],
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2))
    else:
        biases = k_ring
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(q_ready.index(w), count=1)
        mbarrier.init(q_free.index(w), count=1)
    for slot in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(slot), count=1)
        mbarrier.init(v_ready.index(slot), count=1)
        mbarrier.init(k_free.index(slot), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(v_free.index(slot), count=2)
    kv = KeyValueRing(k_ring, v_ring, k_ready, k_free, v_ready, v_free, STAGES)
    work = WorkTiles(seqlen_q, seqlen_k, heads_q, group, row_tiles, batch_heads, num_tiles,
                     tile_order, documents, cu_q, cu_k, 2 * ROWS, BLOCK_N, CAUSAL, DOCUMENTS)
    out_rows = OutputRows(out_ptr, out_row_stride, head_dim)
    lists = BlockLists(list_table, list_batch_stride, list_head_stride, list_row_stride,
                       list_head_div, mask_head_div, mask_batches)
    bias_heads = BiasRows(bias_head_div, bias_batches)

    # The argument tuples are written inline: a tuple assigned to a name first turns its
    # constexprs into runtime values (Triton 3.6). The aggregates keep theirs as fields.
    gl.warp_specialize(
        [(_first_consumer, (q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists,
                            biases, o_desc, lse_ptr, out_rows, qk_scale, MASK_KIND,
                            HAS_BIAS)),
         (_second_consumer, (q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists,
                             biases, o_desc, lse_ptr, out_rows, qk_scale, MASK_KIND,
                             HAS_BIAS)),
         (_loader, (q_desc, k_desc, v_desc, mask_desc, bias_desc, q_tiles, masks, biases,
                    q_ready, q_free, kv, work, lists, bias_heads, MASK_KIND, HAS_BIAS))],
        [CONSUMER_WARPS, 1], [CONSUMER_REGS, LOADER_REGS])
