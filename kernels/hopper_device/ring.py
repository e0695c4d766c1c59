"""The key/value ring: STAGES shared slots for K blocks and as many for V blocks, each with a
``ready`` barrier (its copy landed: the copy's byte count completes it) and a ``free`` barrier
(every consumer warpgroup has read it: one arrival each). Ring position p (the key blocks a program
has loaded so far, counted over all its tiles) lives in slot p % STAGES, on lap p // STAGES; a
barrier's phase parity on lap n is n & 1. The loader waits for a slot's ``free`` barrier one
lap behind (a barrier that has completed no phase passes a wait for the parity of the phase
before phase 0, so the ring's first lap does not wait), the consumers for its ``ready``
barrier on the lap itself. A masked forward keeps a tile of mask bytes beside each K slot,
copied on K's ``ready`` barrier and freed with it (``fill_tested``); a biased one the block's
bias row too (``fill_biased``).

The backward's ring (``QueryRing``) works the same way over query blocks: Q, dO, their rows'
LSE and delta (and a tested block's mask bytes) per slot, one ``ready`` barrier for all."""


from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .gluon_compat import aggregate, tma_load


@gluon.jit
def copy_view(tile):
    """A rank-2 [rows, cols] shared tile as the [1, rows, 1, cols] box its descriptor copies
    (an NVMMA layout's bytes depend only on the rows and the contiguous dim, which the two
    views share)."""
    return tile.reshape([1, tile.shape[0], 1, tile.shape[1]])


@gluon.jit
def plane_view(tile):
    """A rank-2 [rows, cols] shared tile as the [1, 1, rows, cols] box of a descriptor over a
    (B, H, rows, cols) tensor (a mask's bytes, dQ's float32 accumulator)."""
    return tile.reshape([1, 1, tile.shape[0], tile.shape[1]])


@gluon.jit
def box_view(tile, RANK: gl.constexpr):
    """A rank-2 [rows, cols] shared tile as the box of a rank-RANK descriptor over (B, H,
    rows, cols) (RANK 4) or (B, H, cols) (RANK 3, one row: KeyIntervals' words)."""
    if RANK == 4:
        view = plane_view(tile)
    else:
        view = tile.reshape([1, 1, tile.shape[1]])
    return view


@aggregate
class KeyValueRing:
    keys: gl.shared_memory_descriptor
    values: gl.shared_memory_descriptor
    keys_ready: gl.shared_memory_descriptor
    keys_free: gl.shared_memory_descriptor
    values_ready: gl.shared_memory_descriptor
    values_free: gl.shared_memory_descriptor
    STAGES: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, keys, values, keys_ready, keys_free, values_ready, values_free, STAGES):
        self.keys = keys
        self.values = values
        self.keys_ready = keys_ready
        self.keys_free = keys_free
        self.values_ready = values_ready
        self.values_free = values_free
        self.STAGES = gl.constexpr(STAGES)

    @gluon.jit
    def fill(self, position, k_desc, v_desc, batch, first_key, kv_head):
        """Loader: copy key block rows [first_key, first_key + BLOCK_N) of K and V into the slot
        of ``position`` once both consumers have freed it."""
        self.fill_tested(position, k_desc, v_desc, batch, first_key, kv_head, None, None, None,
                         False)

    @gluon.jit
    def fill_tested(self, position, k_desc, v_desc, batch, first_key, kv_head, mask_desc,
                    masks, mask_at, tested):
        """Loader: copy key block rows [first_key, first_key + BLOCK_N) of K and V into the slot
        of ``position`` once both consumers have freed it, and where ``tested`` also the box of
        ``mask_desc`` at ``mask_at`` (the block's mask bytes or interval words) into ``masks``'
        slot of this position, on K's ready barrier: the consumers read it before they free
        K's slot."""
        self.fill_biased(position, k_desc, v_desc, batch, first_key, kv_head, mask_desc, masks,
                         mask_at, tested, None, None, None)

    @gluon.jit
    def fill_biased(self, position, k_desc, v_desc, batch, first_key, kv_head, mask_desc,
                    masks, mask_at, tested, bias_desc, biases, bias_at):
        """``fill_tested``, and where ``bias_desc`` is not None the block's [1, BLOCK_N] row of
        a bias (its box at ``bias_at``) into ``biases``' slot of this position, on K's ready
        barrier whether the block is tested or not."""
        slot = position % self.STAGES
        parity = ((position // self.STAGES) & 1) ^ 1
        ready = self.keys_ready.index(slot)
        mbarrier.wait(self.keys_free.index(slot), parity)
        if tested:
            if bias_desc is None:
                mbarrier.expect(ready, k_desc.block_type.nbytes + mask_desc.block_type.nbytes)
            else:
                mbarrier.expect(ready, k_desc.block_type.nbytes + mask_desc.block_type.nbytes
                                + bias_desc.block_type.nbytes)
            tma_load(k_desc, [batch, first_key, kv_head, 0], ready,
                     copy_view(self.keys.index(slot)))
            tma_load(mask_desc, mask_at, ready,
                     box_view(masks.index(slot), len(mask_desc.block_type.shape)))
        else:
            if bias_desc is None:
                mbarrier.expect(ready, k_desc.block_type.nbytes)
            else:
                mbarrier.expect(ready, k_desc.block_type.nbytes + bias_desc.block_type.nbytes)
            tma_load(k_desc, [batch, first_key, kv_head, 0], ready,
                     copy_view(self.keys.index(slot)))
        if bias_desc is not None:
            tma_load(bias_desc, bias_at, ready, plane_view(biases.index(slot)))
        mbarrier.wait(self.values_free.index(slot), parity)
        mbarrier.expect(self.values_ready.index(slot), v_desc.block_type.nbytes)
        tma_load(v_desc, [batch, first_key, kv_head, 0], self.values_ready.index(slot),
                 copy_view(self.values.index(slot)))

    @gluon.jit
    def wait_step(self, position):
        """Consumer: wait for the K block at ``position`` and the V block at ``position - 1`` (a
        step's PV product trails its score product by one block); returns their slots. The
        slots are indexed where the products are issued (``keys.index(slot)``), after the
        warpgroups' turn: the address arithmetic stays out of the wait."""
        slot = position % self.STAGES
        prev_slot = (position - 1) % self.STAGES
        mbarrier.wait(self.keys_ready.index(slot), (position // self.STAGES) & 1)
        mbarrier.wait(self.values_ready.index(prev_slot), ((position - 1) // self.STAGES) & 1)
        return slot, prev_slot

    @gluon.jit
    def wait_keys(self, position):
        """Consumer: wait for the K block at ``position``; returns its slot."""
        slot = position % self.STAGES
        mbarrier.wait(self.keys_ready.index(slot), (position // self.STAGES) & 1)
        return slot

    @gluon.jit
    def wait_values(self, position):
        """Consumer: wait for the V block at ``position``; returns its slot."""
        slot = position % self.STAGES
        mbarrier.wait(self.values_ready.index(slot), (position // self.STAGES) & 1)
        return slot

    @gluon.jit
    def free_keys(self, slot):
        """Consumer: this warpgroup is done with the K block in ``slot``."""
        mbarrier.arrive(self.keys_free.index(slot), count=1)

    @gluon.jit
    def free_values(self, slot):
        """Consumer: this warpgroup is done with the V block in ``slot``."""
        mbarrier.arrive(self.values_free.index(slot), count=1)


@aggregate
class QueryRing:
    """STAGES slots of a query block's Q and dO tiles and its rows' LSE and delta. Ring
    position p (the query blocks this program has loaded so far) lives in slot p % STAGES on
    lap p // STAGES; its ``ready`` barrier completes when the four copies landed, its ``free``
    barrier when both consumer warpgroups are done with the slot (two arrivals). The loader
    waits one lap behind on ``free`` (a fresh barrier passes a wait for the parity before
    phase 0)."""
    queries: gl.shared_memory_descriptor
    grads: gl.shared_memory_descriptor
    lse: gl.shared_memory_descriptor
    delta: gl.shared_memory_descriptor
    masks: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    free: gl.shared_memory_descriptor
    STAGES: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, queries, grads, lse, delta, masks, ready, free, STAGES):
        self.queries = queries
        self.grads = grads
        self.lse = lse
        self.delta = delta
        self.masks = masks
        self.ready = ready
        self.free = free
        self.STAGES = gl.constexpr(STAGES)

    @gluon.jit
    def fill(self, position, q_desc, do_desc, rows_desc, batch, first_row, q_head, lse_row,
             delta_row, mask_desc, mask_at, tested):
        """Loader: copy query rows [first_row, first_row + BLOCK_M) of Q and dO, and their
        scaled LSE and delta (rows ``lse_row`` and ``delta_row`` of ``rows_desc``), into the
        slot of ``position`` once both consumers have freed it; where ``tested``, also the
        mask bytes of those rows by the program's key block (``mask_desc``'s box at
        ``mask_at``)."""
        slot = position % self.STAGES
        mbarrier.wait(self.free.index(slot), ((position // self.STAGES) & 1) ^ 1)
        # (The byte counts are written out: a sum assigned to a name is no longer constant.)
        if tested:
            mbarrier.expect(self.ready.index(slot),
                            q_desc.block_type.nbytes + do_desc.block_type.nbytes
                            + 2 * rows_desc.block_type.nbytes + mask_desc.block_type.nbytes)
            tma_load(mask_desc, mask_at, self.ready.index(slot),
                     plane_view(self.masks.index(slot)))
        else:
            mbarrier.expect(self.ready.index(slot),
                            q_desc.block_type.nbytes + do_desc.block_type.nbytes
                            + 2 * rows_desc.block_type.nbytes)
        tma_load(q_desc, [batch, first_row, q_head, 0], self.ready.index(slot),
                 copy_view(self.queries.index(slot)))
        tma_load(do_desc, [batch, first_row, q_head, 0], self.ready.index(slot),
                 copy_view(self.grads.index(slot)))
        tma_load(rows_desc, [lse_row, first_row], self.ready.index(slot),
                 self.lse.index(slot).reshape([1, self.lse.shape[1]]))
        tma_load(rows_desc, [delta_row, first_row], self.ready.index(slot),
                 self.delta.index(slot).reshape([1, self.delta.shape[1]]))

    @gluon.jit
    def wait(self, position):
        """Consumer: wait for the slot of ``position``; returns it."""
        slot = position % self.STAGES
        mbarrier.wait(self.ready.index(slot), (position // self.STAGES) & 1)
        return slot

    @gluon.jit
    def release(self, slot):
        """Consumer: this warpgroup is done with ``slot``."""
        mbarrier.arrive(self.free.index(slot), count=1)
