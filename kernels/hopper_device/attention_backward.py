"""The attention backward for Hopper (dense, stage 1): one loader warp and two consumer
warpgroups per program, in FlashAttention-3's form.

The role pieces live beside the forward's: ``ring.QueryRing`` (the loader's Q, dO, LSE and
delta slots), ``tiles.KeyBlockWork`` (a program's key block and the query blocks it walks),
``bias.BiasRow``. A program owns one key block of ``BLOCK_N`` = 2 x 64 keys of one (batch, key
head): its K and V tiles arrive once, and consumer warpgroup w owns keys [w * 64, (w + 1) * 64)
of them, with their dK and dV accumulators in registers for the whole program. The program
walks every query head of the key head's GQA group and, per head, the query blocks of
``BLOCK_M`` = 64 rows that see the key block (with causality, from the first row on or below
the block's first key). The loader warp brings each query block's Q and dO tiles, and its
rows' scaled LSE and delta, through TMA into a ring of STAGES slots (one ``ready`` barrier for
the four copies, a ``free`` barrier both warpgroups arrive on). Per query block a warpgroup
computes, with asynchronous wgmma:

- S^T = K_w Q^T and dP^T = V_w dO^T ([64 keys, 64 queries], both from shared memory);
- P^T = exp2(S^T * qk_scale - LSE * log2 e) and dS^T = P^T * (dP^T - delta); only blocks with
  a key past Lk or past a row's diagonal test pairs (hidden ones give 0);
- dV_w += P^T dO and dK_w += dS^T Q, P^T and dS^T as register operands;
- dQ's columns [w * D / 2, (w + 1) * D / 2) over all BLOCK_N keys: both warpgroups write dS^T
  into one [BLOCK_N, BLOCK_M] shared tile (two alternate, behind an mbarrier both arrive on),
  and each multiplies it, transposed, by its half of K's columns. The [64, D / 2] float32
  partial goes to the warpgroup's staging tiles as two swizzled quarters of D, from which TMA
  reduce-adds add it to the float32 dQ accumulator in global memory (FA3's path). Per key
  block and query block that is one D-wide partial, not one per warpgroup: half the
  reduce-adds (H200, B2 H16 L8192 D128: 307 -> 443 TFLOP/s), and the stores into swizzled
  quarters conflict 2-way where an unswizzled [64, 64] float32 tile's conflicted 8-way
  (443 -> 480). With DQ_SPREAD (head dim 128) a quarter's columns are reordered so that its
  stores do not conflict (``dq_columns``); the accumulator holds them in that order.

The products are issued dV's, dQ's, then dK's: dV's covers the wait for the other
warpgroup's dS^T, and dQ's partial is staged and its reduce-adds issued while dK's runs
(H200, one process: 1.01-1.09x the order dV, dK, dQ on dense.yaml). Issuing dV's product
before dS^T is shared, or double-buffering dQ's staging (32 KB more shared memory), measured
0.96-1.00x and 0.96-1.02x of this order (same process, eight dense grids).

The host builds the loader's rows (LSE x log2 e, +inf where a row saw no key, and delta, the
rows' sum of dO * O, padded to whole query blocks) and a zeroed float32 ``dq_acc`` (in dQ's
(B, Lq, Hq, D) order, the descriptor over its (B, Hq, Lq, D) view), and converts ``dq_acc`` to
dQ's dtype. dK is scaled by softmax_scale once, at the end; dQ's
partials before their reduce-adds. Q, K, V, dO, dK and dV go through rank-4 TMA descriptors
over the caller's (B, L, H, D) tensors: rows past a length and columns past the head dim
arrive as zeros and are not written.

With a mask (MASK_KIND: a bool mask of a row per query row, or KeyIntervals' words), a key
block walks, per query head, the query blocks of its activity list (``tiles.BlockLists`` of
[BLOCK_N keys, BLOCK_M rows] tiles: the full ones first, untested, then the partial ones). For
a bool mask's partial block the loader copies the mask's [BLOCK_M, BLOCK_N] bytes beside Q,
and the consumers read their 64 keys of it transposed, in the score layout; KeyIntervals
depend on the key alone, so each warpgroup loads its 64 keys' (start, end) once per query
head and tests start <= row < end.

With DETERMINISTIC (no mask), key block kb adds its partial of a query block after blocks
0..kb-1 have (a lock per query block: both warpgroups' adds written, then a release
increment), so dQ's sums run in one order.

With a bias row (``BiasRow``: (.., .., 1, Lk), one value per key and head), each warpgroup
loads its keys' bias once per query head and adds it to the scores, and with BIAS_GRAD sums
dS^T over the rows it walks (and, with GROUP_SUM, over the group's heads) in registers,
writing each gradient row once: no atomics, the same sums whatever the schedule.

With SPLIT_HEADS (``kernel_options['backward_split_heads']``, by default for key-ordered
top-W intervals) a program walks one query head of its key block's group, not all of them one
after another: the grid is (key blocks) x B x Hq, and dK and dV, partials of one head, are
reduce-added through the staging tiles into float32 accumulators (``dk_desc`` and ``dv_desc``
then see them as (B, Hk, Lk, D) with dQ's boxes), converted by the host; the bias gradient is a
row per query head (BIAS_GROUP_SUM off), summed over the group by the host.

With DOCUMENTS (``kernel_options['backward_documents']``: sequences packed end to end, no
mask) a program owns one key block of one sequence (``tiles.document_key_block``) and walks
that sequence's query blocks only, in its own coordinates: no key block spans two documents
and no pair is tested against intervals. Query block 0 starts at the 4-row boundary at or
before the sequence's first row (the rows' TMA box must start 16-byte aligned), so blocks
holding rows of another sequence test those rows and hide them (P = dS = 0; their dQ rows get
zeros added). A sequence's last keys' dK and dV are written from registers
(``output_rows.OutputRows``): a TMA box would write the next sequence's keys.

Not yet: a bool mask of one row for every query row, a bias with a row per query, and an
ordered dQ with a mask (a key block's rank among those walking a query block is not known to
its program).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .backward_consumer import first_consumer, second_consumer
from .bias import BiasRow
from .forms import CONSUMER_WARPS, MASK_TILE, NO_MASK
from .gluon_compat import tma_load
from .ring import QueryRing, copy_view
from .output_rows import OutputRows
from .tiles import BlockLists, KeyBlockWork, document_key_block

# The loader's float32 rows box must start 16-byte aligned (TMA faults otherwise).
LOADER_ROW_ALIGN = gl.constexpr(4)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, do_desc, rows_desc, mask_desc, k_tile, v_tile, kv_ready,
            ring, work, lists, MASK_KIND: gl.constexpr):
    MASKED: gl.constexpr = MASK_KIND != NO_MASK
    batch, kv_head, first_key = work.coordinates()
    mbarrier.expect(kv_ready.index(0), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    packed_key = work.packed_key(first_key)
    tma_load(k_desc, [batch, packed_key, kv_head, 0], kv_ready.index(0), copy_view(k_tile))
    tma_load(v_desc, [batch, packed_key, kv_head, 0], kv_ready.index(0), copy_view(v_tile))
    position = 0
    first_g, stop_g = work.group_heads()
    for g in range(first_g, stop_g):
        q_head = kv_head * work.group + g
        lse_row = batch * work.heads_q + q_head
        delta_row = lse_row + work.batch_heads() * work.group  # past the B x Hq LSE rows
        # With a mask, the head's list: full query blocks, then tested ones.
        row, mask_batch, mask_head, walk_start, walk_stop, full = work.head_walk(
            lists, batch, q_head, first_key, MASKED)
        for j in range(walk_start, walk_stop):
            m = work.query_block(lists, row, j, walk_stop, MASKED)
            if MASK_KIND == MASK_TILE:  # a tested block's bytes come with Q (KeyIntervals'
                # words the consumers load themselves)
                ring.fill(position, q_desc, do_desc, rows_desc, batch, m * work.BLOCK_M, q_head,
                          lse_row, delta_row, mask_desc,
                          (mask_batch, mask_head, m * work.BLOCK_M, first_key), j >= full)
            else:
                ring.fill(position, q_desc, do_desc, rows_desc, batch,
                          work.packed_row(m * work.BLOCK_M), q_head, lse_row, delta_row, None,
                          None, False)
            position += 1



@gluon.jit(do_not_specialize=["list_batch_stride", "list_head_stride", "list_row_stride",
                              "list_head_div", "mask_head_div", "mask_batches",
                              "mask_batch_stride", "mask_head_stride", "bias_stride_b",
                              "bias_stride_h", "bias_stride_k", "bias_head_div",
                              "bias_grad_stride_b", "bias_grad_stride_h", "seqlen_q",
                              "seqlen_k", "heads_q", "heads_kv", "group", "order_group",
                              "dkv_row_stride", "head_dim"])
def attention_backward(q_desc, k_desc, v_desc, do_desc, dq_desc, dk_desc, dv_desc, rows_desc,
                       mask_desc, list_table, list_batch_stride, list_head_stride,
                       list_row_stride, list_head_div, mask_head_div, mask_batches,
                       mask_batch_stride, mask_head_stride, bias_ptr, bias_stride_b,
                       bias_stride_h, bias_stride_k, bias_head_div, bias_grad_ptr,
                       bias_grad_stride_b, bias_grad_stride_h, dq_locks, documents, cu_q, cu_k,
                       dk_ptr, dv_ptr, dkv_row_stride, head_dim, seqlen_q, seqlen_k, heads_q,
                       heads_kv, group, order_group, qk_scale, softmax_scale,
                       CAUSAL: gl.constexpr, GROUPED_ORDER: gl.constexpr, DOCUMENTS: gl.constexpr,
                       MASK_KIND: gl.constexpr, DETERMINISTIC: gl.constexpr, HAS_BIAS: gl.constexpr,
                       BIAS_GRAD: gl.constexpr, BIAS_GROUP_SUM: gl.constexpr,
                       DQ_SPREAD: gl.constexpr, SPLIT_HEADS: gl.constexpr, STAGES: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    """Grid (cdiv(Lk, BLOCK_N) x B x Hk,), ordered as ``tiles.KeyBlockWork`` says
    (``order_group``: its (batch, key head)s per group with GROUPED_ORDER). ``rows_desc``: a [1,
    BLOCK_M] box over float32 rows (2 x B x Hq, Lq rounded up to BLOCK_M): first every (batch,
    query head)'s LSE times log2 e (+inf where a row saw no key, and past Lq), then its delta (0
    past Lq). ``dq_desc`` adds into a zeroed float32 accumulator seen as (B, Hq, Lq, D) with [1,
    1, BLOCK_M, BLOCK_D / 4] boxes (with DQ_SPREAD every 32 columns in ``dq_columns``' order);
    ``dk_desc`` and ``dv_desc`` write (B, Lk, Hk, D) in q's dtype with a box of half a key
    block. ``qk_scale`` = softmax_scale x log2 e.
    With a mask, each key block walks its query blocks from the activity lists' table
    (``tiles.BlockLists``: per (mask batch, mask head, key block) a row of (count, full count,
    query blocks...)), and ``mask_desc`` is, for MASK_TILE, a descriptor of a bool mask's bytes
    ([1, 1, BLOCK_M, BLOCK_N] boxes over (Bm, Hm, Lq, Lk), axes of length 1 read at index 0),
    for INTERVAL_WORDS KeyIntervals' int64 words (start in the low half, end in the high; keys
    contiguous, ``mask_batch_stride`` and ``mask_head_stride`` in words); without one, the mask
    and list arguments are stand-ins never read. With DETERMINISTIC, ``dq_locks`` (zeroed int32,
    one per (batch x query head, query block)) orders dQ's reduce-adds: key block kb adds a
    query block's partial once both warpgroups of blocks 0..kb-1 have (each of them walks that
    query block: none is masked), so dQ is bitwise reproducible; without it, ``dq_locks`` is a
    stand-in never read. With DOCUMENTS (sequences packed end to end, batch 1, no mask, not
    DETERMINISTIC) a grid of ``documents``' bound of key blocks x Hk: each program takes its
    sequence's key block from that table (``tiles.document_key_block``: ``cu_q`` and ``cu_k``
    are the offsets) and walks that sequence's query blocks alone, in its own coordinates;
    the rows of other sequences in a query block are hidden (P = dS = 0), and a sequence's
    last keys' dK and dV are written from registers into ``dk_ptr`` and ``dv_ptr`` (rows of
    ``dkv_row_stride``, heads of ``head_dim``); without it those are stand-ins never read.
    Launch with num_warps = 4."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_D: gl.constexpr = q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    stage_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D // 4],
                                                                       gl.float32)
    k_tile = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_D], kv_layout)
    v_tile = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_D], kv_layout)
    queries = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], q_layout)
    grads = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], q_layout)
    # A slot's rows are rank 1 (the consumers read them as one value per query row); the
    # copies see them as the descriptor's [1, BLOCK_M] box.
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32,
                                                    rank=1)
    lse = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
    delta = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_layout)
    ds_tiles = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    # Per warpgroup, its half of dQ's float32 partial as two quarters of D; then dK and dV.
    first_stage = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, BLOCK_D // 4],
                                            stage_layout)
    second_stage = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, BLOCK_D // 4],
                                             stage_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready.index(0), count=1)
    for slot in gl.static_range(STAGES):
        mbarrier.init(ready.index(slot), count=1)
        mbarrier.init(free.index(slot), count=2)  # one arrival per consumer warpgroup
    for slot in gl.static_range(2):
        mbarrier.init(ds_ready.index(slot), count=2)  # both warpgroups' dS^T are written
    if MASK_KIND == MASK_TILE:
        masks = gl.allocate_shared_memory(
            gl.uint8, [STAGES, BLOCK_M, BLOCK_N],
            gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.uint8))
    else:
        masks = lse  # never read
    ring = QueryRing(queries, grads, lse, delta, masks, ready, free, STAGES)
    lists = BlockLists(list_table, list_batch_stride, list_head_stride, list_row_stride,
                       list_head_div, mask_head_div, mask_batches)
    bias = BiasRow(bias_ptr, bias_stride_b, bias_stride_h, bias_stride_k, bias_head_div,
                   bias_grad_ptr, bias_grad_stride_b, bias_grad_stride_h, BIAS_GROUP_SUM)
    gl.static_assert(not DOCUMENTS or (MASK_KIND == NO_MASK and not DETERMINISTIC),
                     "documents take no mask and add dQ in any order")
    gl.static_assert(not SPLIT_HEADS or not (DOCUMENTS or DETERMINISTIC or BIAS_GROUP_SUM),
                     "split heads add dK and dV in any order, and write a bias gradient row "
                     "per query head")
    if DOCUMENTS:
        kv_head, key_block, q_base, k_base, q_shift, seqlen_q, seqlen_k = document_key_block(
            documents, cu_q, cu_k, heads_kv, BLOCK_N, LOADER_ROW_ALIGN)
    else:  # stand-ins never read
        kv_head, key_block, q_base, k_base, q_shift = group, group, group, group, group
    work = KeyBlockWork(seqlen_q, seqlen_k, heads_q, heads_kv, group, order_group, kv_head,
                        key_block, q_base, k_base, q_shift, BLOCK_M, BLOCK_N, CAUSAL,
                        GROUPED_ORDER, DOCUMENTS, SPLIT_HEADS)
    dk_rows = OutputRows(dk_ptr, dkv_row_stride, head_dim)
    dv_rows = OutputRows(dv_ptr, dkv_row_stride, head_dim)

    # The argument tuples are written inline: a tuple assigned to a name first turns its
    # constexprs into runtime values (Triton 3.6).
    gl.warp_specialize(
        [(first_consumer, (k_tile, v_tile, ds_tiles, ds_ready, first_stage, kv_ready, ring,
                            work, lists, mask_desc, mask_batch_stride, mask_head_stride, bias,
                            dq_desc, dq_locks, dk_desc, dv_desc, dk_rows, dv_rows, qk_scale,
                            softmax_scale, MASK_KIND, DETERMINISTIC, HAS_BIAS, BIAS_GRAD,
                            DQ_SPREAD)),
         (second_consumer, (k_tile, v_tile, ds_tiles, ds_ready, second_stage, kv_ready, ring,
                             work, lists, mask_desc, mask_batch_stride, mask_head_stride,
                             bias, dq_desc, dq_locks, dk_desc, dv_desc, dk_rows, dv_rows,
                             qk_scale, softmax_scale, MASK_KIND, DETERMINISTIC, HAS_BIAS,
                             BIAS_GRAD, DQ_SPREAD)),
         (_loader, (q_desc, k_desc, v_desc, do_desc, rows_desc, mask_desc, k_tile, v_tile,
                    kv_ready, ring, work, lists, MASK_KIND))],
        [CONSUMER_WARPS, 1], [CONSUMER_REGS, LOADER_REGS])
