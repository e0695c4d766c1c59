"""A bias as the Hopper kernels read it: the backward's consumers load a bias of one row per
(batch, head) and write its gradient's rows (``BiasRow``); the forward's loader copies a
block's row beside K, or each warpgroup's tile of a full bias into a slot of its own
(``BiasRows``: where a block's row or tile is; ``ForwardBias``: the shared slots)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .gluon_compat import aggregate, tma_load
from .ring import plane_view
from .softmax import LOG2E


@aggregate
class BiasRow:
    """A bias of one row per (batch, head), added to the scores of every query row (flash-
    dmattn's (B, Hk, 1, Lk) form; its head and batch axes may broadcast), and the float32 or
    bias-dtype rows its gradient goes to: per (batch, key head) summed over the GQA group
    (``GROUP_SUM``), or per (batch, query head). Strides in elements; the gradient's keys are
    contiguous."""
    ptr: gl.tensor
    stride_b: gl.tensor
    stride_h: gl.tensor
    stride_k: gl.tensor
    head_div: gl.tensor
    grad_ptr: gl.tensor
    grad_stride_b: gl.tensor
    grad_stride_h: gl.tensor
    GROUP_SUM: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, ptr, stride_b, stride_h, stride_k, head_div, grad_ptr, grad_stride_b,
                 grad_stride_h, GROUP_SUM):
        self.ptr = ptr
        self.stride_b = stride_b
        self.stride_h = stride_h
        self.stride_k = stride_k
        self.head_div = head_div
        self.grad_ptr = grad_ptr
        self.grad_stride_b = grad_stride_b
        self.grad_stride_h = grad_stride_h
        self.GROUP_SUM = gl.constexpr(GROUP_SUM)

    @gluon.jit
    def load(self, batch, q_head, keys, seqlen_k):
        """The bias of ``keys`` for query head ``q_head``, times log2 e, in float32 (0 past
        Lk)."""
        row = (self.ptr + batch.to(gl.int64) * self.stride_b
               + (q_head // self.head_div).to(gl.int64) * self.stride_h)
        values = gl.load(row + keys.to(gl.int64) * self.stride_k, mask=keys < seqlen_k,
                         other=0.0)
        return values.to(gl.float32) * LOG2E

    @gluon.jit
    def store_grad(self, batch, head, keys, seqlen_k, grad):
        """Write ``grad`` (float32, one per key) as row (batch, head) of the gradient."""
        row = (self.grad_ptr + batch.to(gl.int64) * self.grad_stride_b
               + head.to(gl.int64) * self.grad_stride_h)
        gl.store(row + keys, grad.to(self.grad_ptr.dtype.element_ty), mask=keys < seqlen_k)


@aggregate
class BiasRows:
    """Where the forward's loader finds a key block's bias: a descriptor over the bias as
    (Bb, Hb, 1, Lk) with [1, 1, 1, BLOCK_N] boxes, or for a full bias (Bb, Hb, Lq, Lk) with
    [1, 1, ROWS, BLOCK_N] boxes; query head h reads bias head h // ``head_div``, and batch b
    reads batch b x ``batches`` (0 where the bias is shared)."""
    head_div: gl.tensor
    batches: gl.tensor

    @gluon.constexpr_function
    def __init__(self, head_div, batches):
        self.head_div = head_div
        self.batches = batches

    @gluon.jit
    def at(self, batch, q_head, first_key):
        """The box coordinates of the row of ``q_head``'s keys from ``first_key``."""
        return (batch * self.batches, q_head // self.head_div, 0, first_key)

    @gluon.jit
    def plane(self, batch, q_head):
        """(batch, head) of the bias that ``q_head`` of ``batch`` reads: a full bias's
        plane."""
        return batch * self.batches, q_head // self.head_div


@aggregate
class ForwardBias:
    """The forward's bias in shared memory. A bias row (not TILE): one [1, BLOCK_N] row per K
    slot (``rows``), copied on K's ready barrier (``ring.KeyValueRing.fill_biased``). A full
    bias (TILE): per consumer warpgroup one [ROWS, BLOCK_N] tile (``tiles``), a ring of one
    slot with its own ``ready`` and ``free`` barriers (one arrival each): key block position p
    (counted as the K/V ring counts them) is its lap p, so its phase parity is p & 1. Two
    slots of a [128, 128] tile would not fit beside head dim 128's ring (192 KB + 64 KB); one
    per warpgroup does (+ 32 KB), and a warpgroup frees its slot as soon as its scores have
    read it, a whole block before it needs the next. Stand-ins fill the unused fields."""
    rows: gl.shared_memory_descriptor
    tiles: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    free: gl.shared_memory_descriptor
    TILE: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, rows, tiles, ready, free, TILE):
        self.rows = rows
        self.tiles = tiles
        self.ready = ready
        self.free = free
        self.TILE = gl.constexpr(TILE)

    @gluon.jit
    def fill_tiles(self, position, bias_desc, batch, head, first_row, first_key):
        """Loader: each warpgroup's [ROWS, BLOCK_N] tile of the key block at ``position`` (of
        plane (``batch``, ``head``), from key ``first_key``; warpgroup w's rows from
        ``first_row`` + w x ROWS), once that warpgroup has read its last one."""
        CONSUMERS: gl.constexpr = self.tiles.shape[0]
        ROWS: gl.constexpr = self.tiles.shape[1]
        for w in gl.static_range(CONSUMERS):
            mbarrier.wait(self.free.index(w), (position & 1) ^ 1)
            mbarrier.expect(self.ready.index(w), bias_desc.block_type.nbytes)
            tma_load(bias_desc, [batch, head, first_row + w * ROWS, first_key],
                     self.ready.index(w), plane_view(self.tiles.index(w)))

    @gluon.jit
    def scores_bias(self, slot, position, WARPGROUP: gl.constexpr, HAS_BIAS: gl.constexpr,
                    s_layout: gl.constexpr):
        """Consumer: with HAS_BIAS, the bias of the key block at ``position`` (K's ``slot``) in
        the score layout, in its dtype: [1, BLOCK_N] (a row: 16 two-byte shared loads per
        thread, as a mask row) or this warpgroup's [ROWS, BLOCK_N] tile, whose slot it then
        frees; else None."""
        bias = None
        if HAS_BIAS:
            if self.TILE:
                mbarrier.wait(self.ready.index(WARPGROUP), position & 1)
                bias = self.tiles.index(WARPGROUP).load(s_layout)
                mbarrier.arrive(self.free.index(WARPGROUP), count=1)
            else:
                bias = self.rows.index(slot).load(s_layout)
        return bias
