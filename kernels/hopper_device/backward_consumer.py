"""The Hopper backward's consumer warpgroups (``attention_backward`` describes the kernel):
per query block S^T, dP^T, P^T and dS^T, the products dV += P^T dO and dK += dS^T Q, dQ's
partial over both warpgroups' keys staged and reduce-added into the float32 accumulator; then
dK and dV written (with SPLIT_HEADS reduce-added into float32 accumulators). Warpgroup w owns
keys [w * 64, (w + 1) * 64) of the program's key block."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from .dq_columns import spread_columns
from .forms import CONSUMER_WARPS, INTERVAL_WORDS, MASK_TILE, NO_MASK
from .gluon_compat import (reinterpret, store_wait_written, thread_barrier, tma_atomic_add,
                           tma_store)
from .ring import copy_view, plane_view


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
    first_g, stop_g = work.group_heads()
    for g in range(first_g, stop_g):
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
    if work.SPLIT_HEADS:  # one query head's partials: added into float32 accumulators
        _add_rows(stage, dk, dk_desc, batch, kv_head, my_first_key)
        _add_rows(stage, dv, dv_desc, batch, kv_head, my_first_key)
        tma.store_wait(pendings=0)
    elif work.DOCUMENTS:
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
def _add_rows(stage, acc, desc, batch, head, first_row):
    """Reduce-add ``acc`` (float32 [rows, D], in the products' layout) into rows
    [first_row, first_row + rows) of (batch, head) of the float32 accumulator ``desc`` sees as
    (B, H, L, D), through the two staging tiles, a quarter of D per reduce-add as dQ's
    partials go: rows past L are not added."""
    HALF_D: gl.constexpr = acc.shape[1] // 2
    low, high = acc.reshape([acc.shape[0], 2, HALF_D]).permute((0, 2, 1)).split()
    _add_half(stage, low, desc, batch, head, first_row, 0)
    _add_half(stage, high, desc, batch, head, first_row, HALF_D)


@gluon.jit
def _add_half(stage, half, desc, batch, head, first_row, FIRST_COLUMN: gl.constexpr):
    QUARTER_D: gl.constexpr = half.shape[1] // 2
    low, high = half.reshape([half.shape[0], 2, QUARTER_D]).permute((0, 2, 1)).split()
    tma.store_wait(pendings=0)  # the staging tiles' last reduce-adds have read them
    stage.index(0).store(low)
    stage.index(1).store(high)
    fence_async_shared()
    tma_atomic_add(desc, [batch, head, first_row, FIRST_COLUMN], plane_view(stage.index(0)))
    tma_atomic_add(desc, [batch, head, first_row, FIRST_COLUMN + QUARTER_D],
                   plane_view(stage.index(1)))


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
def first_consumer(k_tile, v_tile, ds_tiles, ds_ready, stage, kv_ready, ring, work, lists,
                    mask_desc, mask_batch_stride, mask_head_stride, bias, dq_desc, dq_locks,
                    dk_desc, dv_desc, dk_rows, dv_rows, qk_scale, softmax_scale,
                    MASK_KIND: gl.constexpr, DETERMINISTIC: gl.constexpr,
                    HAS_BIAS: gl.constexpr, BIAS_GRAD: gl.constexpr, DQ_SPREAD: gl.constexpr):
    _consumer(k_tile, v_tile, ds_tiles, ds_ready, stage, kv_ready, ring, work, lists, mask_desc,
              mask_batch_stride, mask_head_stride, bias, dq_desc, dq_locks, dk_desc, dv_desc,
              dk_rows, dv_rows, qk_scale, softmax_scale, 0, MASK_KIND, DETERMINISTIC, HAS_BIAS,
              BIAS_GRAD, DQ_SPREAD)


@gluon.jit
def second_consumer(k_tile, v_tile, ds_tiles, ds_ready, stage, kv_ready, ring, work, lists,
                     mask_desc, mask_batch_stride, mask_head_stride, bias, dq_desc, dq_locks,
                     dk_desc, dv_desc, dk_rows, dv_rows, qk_scale, softmax_scale,
                     MASK_KIND: gl.constexpr, DETERMINISTIC: gl.constexpr,
                     HAS_BIAS: gl.constexpr, BIAS_GRAD: gl.constexpr, DQ_SPREAD: gl.constexpr):
    _consumer(k_tile, v_tile, ds_tiles, ds_ready, stage, kv_ready, ring, work, lists, mask_desc,
              mask_batch_stride, mask_head_stride, bias, dq_desc, dq_locks, dk_desc, dv_desc,
              dk_rows, dv_rows, qk_scale, softmax_scale, 1, MASK_KIND, DETERMINISTIC, HAS_BIAS,
              BIAS_GRAD, DQ_SPREAD)
