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
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from .attention_forward import INTERVAL_WORDS, MASK_TILE, NO_MASK
from .bias import BiasRow
from .dq_columns import spread_columns
from .gluon_compat import (reinterpret, store_wait_written, thread_barrier, tma_atomic_add,
                           tma_load, tma_store)
from .ring import QueryRing, copy_view, plane_view
from .output_rows import OutputRows
from .tiles import BlockLists, KeyBlockWork, document_key_block

CONSUMER_WARPS = gl.constexpr(4)  # one warpgroup
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
    for g in range(work.group):
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


@gluon.jit
def _consumer(k_tile, v_tile, ds_tiles, ds_ready, stage, kv_ready, ring, work, lists,
              mask_desc, mask_batch_stride, mask_head_stride, bias, dq_desc, dq_locks, dk_desc,
              dv_desc, dk_rows, dv_rows, qk_scale, softmax_scale, WARPGROUP: gl.constexpr,
              MASK_KIND: gl.constexpr, DETERMINISTIC: gl.constexpr, HAS_BIAS: gl.constexpr,
              BIAS_GRAD: gl.constexpr, DQ_SPREAD: gl.constexpr):
    MASKED: gl.constexpr = MASK_KIND != NO_MASK
    BLOCK_M: gl.constexpr = work.BLOCK_M
    KEYS: gl.constexpr = work.BLOCK_N // 2  # this warpgroup's keys
    BLOCK_D: gl.constexpr = k_tile.shape[1]
    dtype: gl.constexpr = k_tile.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1], instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1], instr_shape=[16, BLOCK_D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # one value per query row
    batch, kv_head, first_key = work.coordinates()
    seqlen_q = work.seqlen_q
    seqlen_k = work.seqlen_k
    diagonal = seqlen_k - seqlen_q
    my_first_key = first_key + WARPGROUP * KEYS
    keys = my_first_key + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
    k_mine = k_tile.slice(WARPGROUP * KEYS, KEYS, dim=0)
    v_mine = v_tile.slice(WARPGROUP * KEYS, KEYS, dim=0)
    HALF_D: gl.constexpr = BLOCK_D // 2
    k_half = k_tile.slice(WARPGROUP * HALF_D, HALF_D, dim=1)
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1], instr_shape=[16, HALF_D, 16])
    dk = gl.zeros([KEYS, BLOCK_D], gl.float32, acc_layout)
    dv = gl.zeros([KEYS, BLOCK_D], gl.float32, acc_layout)
    QUARTER_D: gl.constexpr = HALF_D // 2
    # dQ's float32 partials (two quarters of D), then dK and dV.
    mbarrier.wait(kv_ready.index(0), 0)

    key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # one value per key
    if BIAS_GRAD:  # dS summed over the rows (and, with GROUP_SUM, the group's heads)
        bias_grad = gl.zeros([KEYS], gl.float32, key_layout)
    position = 0
    for g in range(work.group):
        q_head = kv_head * work.group + g
        if HAS_BIAS:
            bias_row = bias.load(batch, q_head, work.packed_key(keys),
                                 work.packed_key(seqlen_k))
        if BIAS_GRAD:
            if not bias.GROUP_SUM:
                bias_grad = gl.zeros([KEYS], gl.float32, key_layout)
        # The loader's walk (with a mask, the head's list, full query blocks first).
        row, mask_batch, mask_head, walk_start, walk_stop, full = work.head_walk(
            lists, batch, q_head, first_key, MASKED)
        if MASK_KIND == INTERVAL_WORDS:  # this warpgroup's keys' (start, end), per head
            words = gl.load(mask_desc + mask_batch.to(gl.int64) * mask_batch_stride
                            + mask_head.to(gl.int64) * mask_head_stride + keys,
                            mask=keys < seqlen_k, other=0)
            starts = (words & 0xFFFFFFFF).to(gl.int32)
            ends = (words >> 32).to(gl.int32)
        for j in range(walk_start, walk_stop):
            m = work.query_block(lists, row, j, walk_stop, MASKED)
            if MASKED:
                tested = j >= full
            first_row = m * BLOCK_M
            slot = ring.wait(position)
            q_tile = ring.queries.index(slot)
            do_tile = ring.grads.index(slot)
            st_token = warpgroup_mma(k_mine, q_tile.permute((1, 0)),
                                     gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout),
                                     use_acc=False, is_async=True)
            dpt_token = warpgroup_mma(v_mine, do_tile.permute((1, 0)),
                                      gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout),
                                      use_acc=False, is_async=True)
            lse = ring.lse.index(slot).load(row_layout)  # log2 e x LSE, +inf: P = 0
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st_token,))
            scores = st * qk_scale  # in log2 units, as LSE
            if HAS_BIAS:
                scores = scores + bias_row[:, None]
            # Pairs are tested only in blocks with a key past Lk or past a row's diagonal, and
            # in a mask's partial blocks (their bytes came with Q: zeros past either length).
            edge = (my_first_key + KEYS > seqlen_k) | (work.CAUSAL & (
                my_first_key + KEYS - 1 > first_row + diagonal))
            if MASKED:
                edge = edge | tested
            if work.DOCUMENTS:  # rows before the sequence's first or past its last: others'
                edge = edge | (first_row < work.q_shift) | (first_row + BLOCK_M > seqlen_q)
            if edge:
                cols = first_row + gl.arange(0, BLOCK_M, layout=row_layout)
                visible = keys[:, None] < seqlen_k
                if work.DOCUMENTS:
                    visible = visible & ((cols >= work.q_shift) & (cols < seqlen_q))[None, :]
                if work.CAUSAL:
                    visible = visible & (keys[:, None] <= cols[None, :] + diagonal)
                if MASK_KIND == MASK_TILE:  # the slot's [BLOCK_M, BLOCK_N] bytes, transposed
                    keep = ring.masks.index(slot).slice(WARPGROUP * KEYS, KEYS, dim=1).permute(
                        (1, 0)).load(s_layout) != 0
                    visible = visible & (keep | (j < full))
                elif MASK_KIND == INTERVAL_WORDS:  # key k is seen by rows [start, end)
                    keep = (starts[:, None] <= cols[None, :]) & (cols[None, :] < ends[:, None])
                    visible = visible & (keep | (j < full))
                p = gl.where(visible, gl.exp2(scores - lse[None, :]), 0.0)
            else:
                p = gl.exp2(scores - lse[None, :])
            delta = ring.delta.index(slot).load(row_layout)
            dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt_token,))
            ds = p * (dpt - delta[None, :])
            if BIAS_GRAD:
                bias_grad += gl.sum(ds, axis=1)
            p_op = gl.convert_layout(p.to(dtype), op_layout)
            ds_low = ds.to(dtype)
            ds_op = gl.convert_layout(ds_low, op_layout)
            # dS^T of both warpgroups meets in one [BLOCK_N, BLOCK_M] tile (two alternate, so
            # a warpgroup a step ahead never writes the tile the other still reads).
            ds_both = ds_tiles.index(position % 2)
            ds_both.slice(WARPGROUP * KEYS, KEYS, dim=0).store(ds_low)
            fence_async_shared()
            thread_barrier()  # every warp's dS^T is written before the one arrival
            mbarrier.arrive(ds_ready.index(position % 2), count=1)
            # dV's product runs while the other warpgroup's dS^T arrives; dK's, issued last,
            # while dQ's partial goes to the staging tiles and its reduce-adds.
            dv = warpgroup_mma(p_op, do_tile, dv, is_async=True)
            # dQ's columns [w * HALF_D, (w + 1) * HALF_D) over all BLOCK_N keys: dS K_half.
            mbarrier.wait(ds_ready.index(position % 2), (position // 2) & 1)
            dq_token = warpgroup_mma(ds_both.permute((1, 0)), k_half,
                                     gl.zeros([BLOCK_M, HALF_D], gl.float32, dq_layout),
                                     use_acc=False, is_async=True)
            dk = warpgroup_mma(ds_op, q_tile, dk, is_async=True)
            # The products complete in order: dV's and dQ's, not yet dK's.
            dv, p_op, dq = warpgroup_mma_wait(num_outstanding=1, deps=(dv, p_op, dq_token))
            # The previous step's reduce has read the staging tile.
            tma.store_wait(pendings=0)
            # Two swizzled quarters of D (a swizzled box spans at most 128 bytes): stores
            # into an unswizzled [64, 64] float32 tile conflicted 8 ways.
            low, high = (dq * softmax_scale).reshape([BLOCK_M, 2, QUARTER_D]).permute(
                (0, 2, 1)).split()
            if DQ_SPREAD:  # no bank conflicts (``dq_columns``)
                low = spread_columns(low)
                high = spread_columns(high)
            stage.index(0).store(low)
            stage.index(1).store(high)
            fence_async_shared()
            if DETERMINISTIC:  # key block kb adds after every warpgroup of blocks 0..kb-1
                lock = dq_locks + ((batch * work.heads_q + q_head)
                                   * gl.cdiv(seqlen_q, BLOCK_M) + m)
                turn = 2 * (first_key // work.BLOCK_N)
                seen = gl.load(lock, volatile=True)
                while seen < turn:
                    seen = gl.load(lock, volatile=True)
            # (With DOCUMENTS the rows of other sequences in the block add zeros: P = dS = 0.)
            packed_row = work.packed_row(first_row)
            tma_atomic_add(dq_desc, [batch, q_head, packed_row, WARPGROUP * HALF_D],
                           plane_view(stage.index(0)))
            tma_atomic_add(dq_desc,
                           [batch, q_head, packed_row, WARPGROUP * HALF_D + QUARTER_D],
                           plane_view(stage.index(1)))
            if DETERMINISTIC:  # the adds are written before the next block's turn
                store_wait_written()
                thread_barrier()
                gl.atomic_add(lock, 1, sem="release", scope="gpu")
            dk, ds_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ds_op))
            ring.release(slot)  # Q and dO are read: the loader may refill the slot
            position += 1
        if BIAS_GRAD:
            if not bias.GROUP_SUM:
                bias.store_grad(batch, q_head, work.packed_key(keys),
                                work.packed_key(seqlen_k), bias_grad)
    if BIAS_GRAD:
        if bias.GROUP_SUM:
            bias.store_grad(batch, kv_head, work.packed_key(keys), work.packed_key(seqlen_k),
                            bias_grad)
    dk = dk * softmax_scale
    if work.DOCUMENTS:
        if my_first_key + KEYS > seqlen_k:
            # A sequence's last keys: a TMA box would write the next sequence's rows, which
            # another program writes.
            dk_rows.store(dk.to(dtype), work.k_base, my_first_key, seqlen_k, kv_head,
                          acc_layout)
            dv_rows.store(dv.to(dtype), work.k_base, my_first_key, seqlen_k, kv_head,
                          acc_layout)
        else:
            _store_keys(stage, dk, dv, dk_desc, dv_desc, batch, work.packed_key(my_first_key),
                        kv_head)
    else:
        _store_keys(stage, dk, dv, dk_desc, dv_desc, batch, my_first_key, kv_head)


@gluon.jit
def _store_keys(stage, dk, dv, dk_desc, dv_desc, batch, first_key, kv_head):
    """dK (scaled) and dV of this warpgroup's keys from ``first_key`` through its staging
    tile and TMA: rows past Lk and columns past the head dim are not written."""
    KEYS: gl.constexpr = dk.shape[0]
    BLOCK_D: gl.constexpr = dk.shape[1]
    dtype: gl.constexpr = dk_desc.dtype
    tma.store_wait(pendings=0)
    out_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KEYS, BLOCK_D], dtype)
    out_tile = reinterpret(stage, dtype, [KEYS, BLOCK_D], out_layout)  # as many bytes
    out_tile.store(dk.to(dtype))
    fence_async_shared()
    tma_store(dk_desc, [batch, first_key, kv_head, 0], copy_view(out_tile))
    tma.store_wait(pendings=0)
    out_tile.store(dv.to(dtype))
    fence_async_shared()
    tma_store(dv_desc, [batch, first_key, kv_head, 0], copy_view(out_tile))
    tma.store_wait(pendings=0)


@gluon.jit
def _first_consumer(k_tile, v_tile, ds_tiles, ds_ready, stage, kv_ready, ring, work, lists,
                    mask_desc, mask_batch_stride, mask_head_stride, bias, dq_desc, dq_locks,
                    dk_desc, dv_desc, dk_rows, dv_rows, qk_scale, softmax_scale,
                    MASK_KIND: gl.constexpr, DETERMINISTIC: gl.constexpr,
                    HAS_BIAS: gl.constexpr, BIAS_GRAD: gl.constexpr, DQ_SPREAD: gl.constexpr):
    _consumer(k_tile, v_tile, ds_tiles, ds_ready, stage, kv_ready, ring, work, lists, mask_desc,
              mask_batch_stride, mask_head_stride, bias, dq_desc, dq_locks, dk_desc, dv_desc,
              dk_rows, dv_rows, qk_scale, softmax_scale, 0, MASK_KIND, DETERMINISTIC, HAS_BIAS,
              BIAS_GRAD, DQ_SPREAD)


@gluon.jit
def _second_consumer(k_tile, v_tile, ds_tiles, ds_ready, stage, kv_ready, ring, work, lists,
                     mask_desc, mask_batch_stride, mask_head_stride, bias, dq_desc, dq_locks,
                     dk_desc, dv_desc, dk_rows, dv_rows, qk_scale, softmax_scale,
                     MASK_KIND: gl.constexpr, DETERMINISTIC: gl.constexpr,
                     HAS_BIAS: gl.constexpr, BIAS_GRAD: gl.constexpr, DQ_SPREAD: gl.constexpr):
    _consumer(k_tile, v_tile, ds_tiles, ds_ready, stage, kv_ready, ring, work, lists, mask_desc,
              mask_batch_stride, mask_head_stride, bias, dq_desc, dq_locks, dk_desc, dv_desc,
              dk_rows, dv_rows, qk_scale, softmax_scale, 1, MASK_KIND, DETERMINISTIC, HAS_BIAS,
              BIAS_GRAD, DQ_SPREAD)


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
                       DQ_SPREAD: gl.constexpr, STAGES: gl.constexpr,
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
    if DOCUMENTS:
        kv_head, key_block, q_base, k_base, q_shift, seqlen_q, seqlen_k = document_key_block(
            documents, cu_q, cu_k, heads_kv, BLOCK_N, LOADER_ROW_ALIGN)
    else:  # stand-ins never read
        kv_head, key_block, q_base, k_base, q_shift = group, group, group, group, group
    work = KeyBlockWork(seqlen_q, seqlen_k, heads_q, heads_kv, group, order_group, kv_head,
                        key_block, q_base, k_base, q_shift, BLOCK_M, BLOCK_N, CAUSAL,
                        GROUPED_ORDER, DOCUMENTS)
    dk_rows = OutputRows(dk_ptr, dkv_row_stride, head_dim)
    dv_rows = OutputRows(dv_ptr, dkv_row_stride, head_dim)

    # The argument tuples are written inline: a tuple assigned to a name first turns its
    # constexprs into runtime values (Triton 3.6).
    gl.warp_specialize(
        [(_first_consumer, (k_tile, v_tile, ds_tiles, ds_ready, first_stage, kv_ready, ring,
                            work, lists, mask_desc, mask_batch_stride, mask_head_stride, bias,
                            dq_desc, dq_locks, dk_desc, dv_desc, dk_rows, dv_rows, qk_scale,
                            softmax_scale, MASK_KIND, DETERMINISTIC, HAS_BIAS, BIAS_GRAD,
                            DQ_SPREAD)),
         (_second_consumer, (k_tile, v_tile, ds_tiles, ds_ready, second_stage, kv_ready, ring,
                             work, lists, mask_desc, mask_batch_stride, mask_head_stride,
                             bias, dq_desc, dq_locks, dk_desc, dv_desc, dk_rows, dv_rows,
                             qk_scale, softmax_scale, MASK_KIND, DETERMINISTIC, HAS_BIAS,
                             BIAS_GRAD, DQ_SPREAD)),
         (_loader, (q_desc, k_desc, v_desc, do_desc, rows_desc, mask_desc, k_tile, v_tile,
                    kv_ready, ring, work, lists, MASK_KIND))],
        [CONSUMER_WARPS, 1], [CONSUMER_REGS, LOADER_REGS])
