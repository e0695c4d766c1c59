"""The Hopper backward's dQ writer (``attention_backward`` with DQ_WRITER): one warp that
issues the reduce-adds of the float32 dQ partials the two consumer warpgroups stage, so that
they fence, arrive and go on (FlashAttention-3's dQ writer)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .attention_forward import NO_MASK
from .gluon_compat import tma_atomic_add
from .ring import plane_view


@gluon.jit
def dq_writer(first_stage, second_stage, dq_full, dq_empty, dq_desc, work, lists,
              MASK_KIND: gl.constexpr):
    """With DQ_WRITER, one warp issues dQ's reduce-adds (FA3's dQ writer): per step, once a
    consumer warpgroup has staged its half of the partial (``dq_full``), its two quarters
    of D go to the float32 accumulator, and once TMA has read them the warpgroup may stage
    the next (``dq_empty``). It walks the consumers' query blocks in their order."""
    MASKED: gl.constexpr = MASK_KIND != NO_MASK
    QUARTER_D: gl.constexpr = first_stage.shape[2]
    batch, kv_head, first_key = work.coordinates()
    position = 0
    for g in range(work.group):
        q_head = kv_head * work.group + g
        row, _, _, walk_start, walk_stop, _ = work.head_walk(lists, batch, q_head, first_key,
                                                             MASKED)
        for j in range(walk_start, walk_stop):
            first_row = work.query_block(lists, row, j, walk_stop, MASKED) * work.BLOCK_M
            mbarrier.wait(dq_full.index(0), position & 1)
            tma_atomic_add(dq_desc, [batch, q_head, first_row, 0],
                           plane_view(first_stage.index(0)))
            tma_atomic_add(dq_desc, [batch, q_head, first_row, QUARTER_D],
                           plane_view(first_stage.index(1)))
            mbarrier.wait(dq_full.index(1), position & 1)
            tma_atomic_add(dq_desc, [batch, q_head, first_row, 2 * QUARTER_D],
                           plane_view(second_stage.index(0)))
            tma_atomic_add(dq_desc, [batch, q_head, first_row, 3 * QUARTER_D],
                           plane_view(second_stage.index(1)))
            tma.store_wait(pendings=2)  # the first warpgroup's quarters are read
            mbarrier.arrive(dq_empty.index(0), count=1)
            tma.store_wait(pendings=0)
            mbarrier.arrive(dq_empty.index(1), count=1)
            position += 1
