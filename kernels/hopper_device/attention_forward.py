"""The attention forward for Hopper: one loader warp and CONSUMERS (two or three) consumer
warpgroups per program, a persistent grid.

A work tile is CONSUMERS x ROWS query rows of one (batch, query head); consumer warpgroup w
owns rows [w * ROWS, (w + 1) * ROWS) of it. Each program walks its share of the tiles
(``tiles.WorkTiles``). The loader warp issues the TMA copies: a tile's Q tiles, one per
warpgroup, then its key blocks' K and V into a ring of STAGES slots that runs on across tiles.
Every slot has a ``ready`` barrier (its copy landed; the copy's byte count completes it) and a
``free`` barrier (every warpgroup has read it: one arrival each); each Q tile has the same
pair, freed once its warpgroup's last score product retired, so the next tile's Q arrives
during the last PV product and the epilogue.
The output leaves through its own staging tiles. Per key block j a consumer warpgroup issues
S_j = Q K_j^T and O += P_{j-1} V_{j-1} as asynchronous wgmma back to back, waits for S_j
alone, folds S_j into the online softmax, then waits for the PV product and rescales O. The
warpgroups take turns, round robin, to issue their products (a named barrier each:
``forward_consumer._take_turn``), so that one's softmax runs while another's products hold
the tensor cores. Without OVERLAP a warpgroup retires each block's PV product before the next
block's scores (``forward_consumer._serial_key_blocks``): fewer live registers, the overlap left
to the other warpgroups. Three warpgroups (FlashAttention-3's choice at head dim 64) take
masks of one key row (MASK_ROW, INTERVAL_WORDS), not a mask tile (a 192-row TMA box is not a
power of two), and no packed documents yet.

Every operand goes through a rank-4 TMA descriptor over the caller's (B, L, H, D) tensor: a
tile is [1, rows, 1, BLOCK_D] at (batch, first row, head, 0). Rows past a sequence's end and
columns past the head dim arrive as zeros and are never written back, so any length, any head
dim a descriptor can address, strided views and GQA (key head = query head // group) need no
copy and no bounds test on a load. Shared tiles are allocated rank-2 and viewed rank-4 only
for the copies (``ring.copy_view``).

With HAS_BIAS (a bias of one row per (batch, head)), the loader copies each key block's bias
row beside K (``ring.fill_biased``), and the consumers add it, x log2 e, to the scaled scores
(``softmax.fold_scores``). With BIAS_TILE (a full bias, a row per query row) it copies each
warpgroup's [ROWS, BLOCK_N] tile of the block into a slot of that warpgroup's, which the
warpgroup frees once its scores have read it (``bias.ForwardBias``).

The roles live beside this module: ``ring`` (the K/V slots and their barriers, as one value),
``tiles`` (the tile scheduler and each tile's key-block walk), ``softmax`` (the online softmax
and the rows' finish), ``forward_consumer`` (the consumer warpgroups). This module holds the
loader and the entry point.
"""


from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .bias import BiasRows, ForwardBias
from .forms import CONSUMER_WARPS, INTERVAL_WORDS, MASK_ROW, MASK_TILE, NO_MASK
from .forward_consumer import document_keys, first_consumer, second_consumer, third_consumer
from .gluon_compat import tma_load
from .output_rows import OutputRows
from .ring import KeyValueRing, copy_view
from .tiles import BlockLists, WorkTiles


@gluon.jit
def _loader(q_desc, k_desc, v_desc, mask_desc, bias_desc, q_tiles, masks, biases, q_ready,
            q_free, kv, work, lists, bias_heads, MASK_KIND: gl.constexpr,
            HAS_BIAS: gl.constexpr):
    BIAS_ROW: gl.constexpr = HAS_BIAS and not biases.TILE
    BIAS_TILE: gl.constexpr = HAS_BIAS and biases.TILE
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    CONSUMERS: gl.constexpr = q_tiles.shape[0]
    MASKED: gl.constexpr = MASK_KIND != NO_MASK
    ring = 0  # key blocks loaded so far, over this program's tiles: the ring's position
    for visit in range(work.visits()):  # this program's tiles loaded so far
        batch, q_head, kv_head, q_start, _, q_base, k_base, seqlen_q, seqlen_k = \
            work.coordinates(work.tile(visit))
        k_base, seqlen_k, _ = document_keys(k_base, seqlen_k, work.DOCUMENTS, HAS_BIAS)
        if MASKED:
            row, mask_batch, mask_head = lists.row(batch, q_head, q_start // work.TILE_ROWS)
            count, full = lists.counts(row)
            num_blocks = gl.maximum(count, 1)
        else:
            num_blocks, _ = work.key_blocks(q_start, seqlen_q, seqlen_k)
        # A barrier that has completed no phase passes a wait for the parity of the phase
        # before phase 0: the first tile's Q does not wait.
        for w in gl.static_range(CONSUMERS):
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
                if BIAS_ROW:
                    kv.fill_biased(ring + j, k_desc, v_desc, batch, first_key, kv_head,
                                   mask_desc, masks, mask_at, (j == 0) | (j >= full),
                                   bias_desc, biases.rows,
                                   bias_heads.at(batch, q_head, first_key))
                else:
                    kv.fill_tested(ring + j, k_desc, v_desc, batch, first_key, kv_head,
                                   mask_desc, masks, mask_at, (j == 0) | (j >= full))
            elif BIAS_ROW:
                first_key = k_base + j * work.BLOCK_N
                kv.fill_biased(ring + j, k_desc, v_desc, batch, first_key, kv_head, None, None,
                               None, False, bias_desc, biases.rows,
                               bias_heads.at(batch, q_head, first_key))
            else:
                first_key = k_base + j * work.BLOCK_N
                kv.fill(ring + j, k_desc, v_desc, batch, first_key, kv_head)
            if BIAS_TILE:  # after K and V: each warpgroup frees its tile a block ahead
                bias_batch, bias_head = bias_heads.plane(batch, q_head)
                biases.fill_tiles(ring + j, bias_desc, bias_batch, bias_head, q_start,
                                  first_key)
        ring += num_blocks


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
                      STAGES: gl.constexpr, CONSUMERS: gl.constexpr, OVERLAP: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                      BIAS_TILE: gl.constexpr):
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
    (Bb, Hb, 1, Lk) in [1, 1, 1, BLOCK_N] boxes, or with BIAS_TILE a full bias as (Bb, Hb, Lq,
    Lk) in [1, 1, ROWS, BLOCK_N] boxes (``bias.BiasRows``: query head h reads bias head
    h // ``bias_head_div``, batch b batch b x ``bias_batches``); without it, a stand-in.
    With DOCUMENTS (no mask; batch 1), the tiles are those of ``documents`` over the
    sequences that ``cu_q`` and ``cu_k`` (int32 offsets) pack (``tiles.WorkTiles``), and a
    sequence's last rows are written through ``out_ptr`` (the output, ``out_row_stride``
    elements a packed row, heads of ``head_dim``); ``seqlen_q`` and ``seqlen_k`` are the packed
    lengths. Without it all five are unread stand-ins.
    Launch with num_warps = 4 (the first consumer warpgroup; the other CONSUMERS - 1 and the
    loader warp are workers)."""
    gl.static_assert(not DOCUMENTS or MASK_KIND == NO_MASK, "documents take no mask")
    gl.static_assert(CONSUMERS == 2 or (CONSUMERS == 3 and MASK_KIND != MASK_TILE
                                        and not DOCUMENTS),
                     "two consumer warpgroups, or three without a mask tile or documents")
    gl.static_assert(OVERLAP or not DOCUMENTS, "the serial walk takes no packed documents")
    gl.static_assert(not BIAS_TILE or (HAS_BIAS and not DOCUMENTS),
                     "a full bias is a bias, over no packed documents")
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)

    q_tiles = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, BLOCK_D], q_layout)
    o_tiles = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, BLOCK_D], q_layout)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
    # Beside each K slot, what a tested block's pairs read (MASK_KIND).
    if MASK_KIND == MASK_TILE:
        tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
            [CONSUMERS * ROWS, BLOCK_N], gl.uint8)
        masks = gl.allocate_shared_memory(gl.uint8, [STAGES, CONSUMERS * ROWS, BLOCK_N],
                                          tile_layout)
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
    q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    if BIAS_TILE:  # a full bias: a [ROWS, BLOCK_N] tile per warpgroup, its own barriers
        bias_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1],
                                               mbarrier.MBarrierLayout())
        bias_free = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1],
                                              mbarrier.MBarrierLayout())
        for w in gl.static_range(CONSUMERS):
            mbarrier.init(bias_ready.index(w), count=1)
            mbarrier.init(bias_free.index(w), count=1)
        biases = ForwardBias(k_ring, gl.allocate_shared_memory(
            dtype, [CONSUMERS, ROWS, BLOCK_N],
            gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_N], dtype)), bias_ready,
            bias_free, True)
    elif HAS_BIAS:  # beside each K slot, the block's bias row
        biases = ForwardBias(gl.allocate_shared_memory(
            dtype, [STAGES, 1, BLOCK_N],
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)),
            k_ring, q_ready, q_free, False)
    else:
        biases = ForwardBias(k_ring, k_ring, q_ready, q_free, False)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(CONSUMERS):
        mbarrier.init(q_ready.index(w), count=1)
        mbarrier.init(q_free.index(w), count=1)
    for slot in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(slot), count=1)
        mbarrier.init(v_ready.index(slot), count=1)
        mbarrier.init(k_free.index(slot), count=CONSUMERS)  # one arrival per warpgroup
        mbarrier.init(v_free.index(slot), count=CONSUMERS)
    kv = KeyValueRing(k_ring, v_ring, k_ready, k_free, v_ready, v_free, STAGES)
    work = WorkTiles(seqlen_q, seqlen_k, heads_q, group, row_tiles, batch_heads, num_tiles,
                     tile_order, documents, cu_q, cu_k, CONSUMERS * ROWS, BLOCK_N, CAUSAL,
                     DOCUMENTS)
    out_rows = OutputRows(out_ptr, out_row_stride, head_dim)
    lists = BlockLists(list_table, list_batch_stride, list_head_stride, list_row_stride,
                       list_head_div, mask_head_div, mask_batches)
    bias_heads = BiasRows(bias_head_div, bias_batches)

    # The argument tuples are written inline: a tuple assigned to a name first turns its
    # constexprs into runtime values (Triton 3.6). The aggregates keep theirs as fields.
    if CONSUMERS == 3:
        gl.warp_specialize(
            [(first_consumer, (q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists,
                                biases, o_desc, lse_ptr, out_rows, qk_scale, MASK_KIND,
                                HAS_BIAS, OVERLAP)),
             (second_consumer, (q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists,
                                 biases, o_desc, lse_ptr, out_rows, qk_scale, MASK_KIND,
                                 HAS_BIAS, OVERLAP)),
             (third_consumer, (q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists,
                                biases, o_desc, lse_ptr, out_rows, qk_scale, MASK_KIND,
                                HAS_BIAS, OVERLAP)),
             (_loader, (q_desc, k_desc, v_desc, mask_desc, bias_desc, q_tiles, masks, biases,
                        q_ready, q_free, kv, work, lists, bias_heads, MASK_KIND, HAS_BIAS))],
            [CONSUMER_WARPS, CONSUMER_WARPS, 1], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize(
            [(first_consumer, (q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists,
                                biases, o_desc, lse_ptr, out_rows, qk_scale, MASK_KIND,
                                HAS_BIAS, OVERLAP)),
             (second_consumer, (q_tiles, o_tiles, masks, q_ready, q_free, kv, work, lists,
                                 biases, o_desc, lse_ptr, out_rows, qk_scale, MASK_KIND,
                                 HAS_BIAS, OVERLAP)),
             (_loader, (q_desc, k_desc, v_desc, mask_desc, bias_desc, q_tiles, masks, biases,
                        q_ready, q_free, kv, work, lists, bias_heads, MASK_KIND, HAS_BIAS))],
            [CONSUMER_WARPS, 1], [CONSUMER_REGS, LOADER_REGS])
