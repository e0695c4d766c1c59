"""A bias of one row per (batch, head) as the Hopper kernels read it: the backward's consumers
load it and write its gradient's rows (``BiasRow``); the forward's loader copies it beside K
(``BiasRows``: where a block's row is)."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .gluon_compat import aggregate
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
    """Where the forward's loader finds a key block's bias row: a descriptor over the bias as
    (Bb, Hb, 1, Lk) with [1, 1, 1, BLOCK_N] boxes; query head h reads bias head h //
    ``head_div``, and batch b reads batch b x ``batches`` (0 where the bias is shared)."""
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
