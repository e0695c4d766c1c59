"""Where and how the bias gradient is accumulated, chosen from the bias's broadcast shape.

The bias gradient is ``dS`` (the gradient of the softmax input) summed over every axis the bias
broadcasts along. No plan ever allocates (B, Hq, Lq, Lk):

* key axis broadcast (bias ``(.., .., Lq or 1, 1)``): such a bias adds the same value to every
  key of a row, and softmax is invariant to that shift, so its gradient is exactly zero. It is
  returned as zeros with no kernel work. (Summing dS over keys would instead return the rounding
  error of the stored output, since sum_j dS_ij = dO_i . (O_i - rounded O_i).)
* query axis broadcast (bias ``(.., .., 1, Lk)``, flash-dmattn's default): the dkdv kernel owns
  whole key columns and sums dS over queries in registers, and over its GQA group's query heads
  when they read one bias head (a bias with 1 or Hk heads). It writes a (B, Hk or Hq, 1, Lk)
  buffer once per element; when that is the bias's own shape, in the bias dtype, so the buffer
  is the gradient and no reduction or cast follows (each is a torch op of host time). Where
  dkdv splits the group's heads over programs, they write a row per query head to scratch and
  the last share of each key block sums its group's rows into that buffer instead.
* full (Lq, Lk) bias: tiles are written into the bias's own shape. When every element has one
  contributor they are stored in the bias dtype directly; otherwise added into an fp32
  accumulator of the bias's shape. By default the dq kernel writes them: its programs run in
  parallel over query heads and its (query, key) tiles lie along the bias's contiguous key
  axis, so a tile is stored as whole rows; several contributors (query heads sharing a bias
  head, a batch- or head-shared bias) are always other dq programs and add atomically. The
  dkdv kernel instead walks a GQA group's query heads in one program over (key, query) tiles,
  i.e. across the bias's rows: at B1 H8/2 L2048 its kernel took 0.54-1.58 ms where a one-row
  bias's took 0.23-0.36 on an H100. It still writes them when
  ``deterministic=True`` leaves several contributors: in-program repeats (the group's heads)
  use load-add-store, contributions from other programs one launch per colliding
  (batch, kv-head) slice, in a fixed order.

Partials are O(B·Hq·L), the same order as LSE; the reductions in torch are deterministic.

The modes (``DbiasMode``) are defined in ``triton_device.dbias_modes``, beside the integer
constants the kernels compare their ``DBIAS_MODE`` with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.arith import contiguous_strides
from ..triton_device.dbias_modes import DbiasMode
from .inputs import AttnShape
from .operands import Layout


@dataclass(frozen=True)
class DbiasPlan:
    """How one call signature's bias gradient is made; it holds no tensors, so a plan serves
    every call of its signature: each allocates its own buffer."""

    mode: DbiasMode
    buffer_shape: tuple[int, ...]  # what the kernel writes into: partial, accumulator or grad
    buffer_dtype: torch.dtype
    target: Layout  # the buffer seen as a (B, heads, Lq, Lk) broadcast view
    bias_shape: tuple[int, ...]
    bias_dtype: torch.dtype
    serialize_batch: bool = False  # DKDV_TILES_ORDERED: one dkdv launch per batch ...
    serialize_heads: bool = False  # ... and/or per kv head

    @property
    def is_zero(self) -> bool:
        return self.mode is DbiasMode.ZERO

    @property
    def reduce_m(self) -> bool:
        """dkdv sums dS over queries before writing."""
        return self.mode in (DbiasMode.DKDV_ROWS, DbiasMode.DKDV_GROUP_ROWS)

    @property
    def sum_group(self) -> bool:
        """... and over its GQA group's query heads: one buffer row per kv head."""
        return self.mode is DbiasMode.DKDV_GROUP_ROWS

    @property
    def in_dq(self) -> bool:
        return self.mode in (DbiasMode.DQ_TILES, DbiasMode.DQ_TILES_ATOMIC)

    @property
    def atomic(self) -> bool:
        return self.mode is DbiasMode.DQ_TILES_ATOMIC

    @property
    def dkdv_tiles(self) -> bool:
        """dkdv writes full-size tiles, summing a group's heads in order."""
        return self.mode is DbiasMode.DKDV_TILES_ORDERED

    @property
    def packed(self) -> bool:
        return self.mode in (DbiasMode.PACKED_SUMMED_ROWS, DbiasMode.PACKED_ROWS)

    def allocate(self, device) -> torch.Tensor:
        # Summed rows and packed rows are stored once per element whether or not their tiles
        # are active; tiles of a full-size gradient are written only where active, so the rest
        # must be zero.
        if self.reduce_m or self.packed:
            return torch.empty(self.buffer_shape, dtype=self.buffer_dtype, device=device)
        return torch.zeros(self.buffer_shape, dtype=self.buffer_dtype, device=device)

    def finish(self, buffer: torch.Tensor) -> torch.Tensor:
        return finish_gradient(buffer, self.bias_shape, self.bias_dtype)


def finish_gradient(buffer: torch.Tensor, bias_shape: tuple[int, ...], bias_dtype) -> torch.Tensor:
    """Turn a kernel's ``buffer`` into the gradient, in the bias's own shape and dtype."""
    t = buffer
    if tuple(t.shape) != bias_shape:
        t = reduce_partial(t, bias_shape)
    return t if t.dtype == bias_dtype else t.to(bias_dtype)


def reduce_partial(partial: torch.Tensor, bias_shape) -> torch.Tensor:
    """Sum a (B, H, X, Y) fp32 partial, H a multiple of bH, down to the bias shape
    (bB, bH, bM, bN)."""
    b, hq, x, y = partial.shape
    bb, bh, bm, bn = bias_shape
    # Axes of size 1 need no sum (each one would be a launch and a copy).
    t = partial.view(b, bh, hq // bh, x, y)
    t = t.sum(2) if hq > bh else t.squeeze(2)
    if bb == 1 and b > 1:
        t = t.sum(0, keepdim=True)
    if bm == 1 and x > 1:
        t = t.sum(2, keepdim=True)
    if bn == 1 and y > 1:
        t = t.sum(3, keepdim=True)
    return t


def broadcast_args(buffer_shape: tuple[int, ...], view_shape: tuple[int, ...],
                    head_div: int) -> Layout:
    """Kernel args of a contiguous buffer of ``buffer_shape`` expanded to ``view_shape``
    (stride 0 along the expanded axes, as ``Tensor.expand`` gives)."""
    strides = contiguous_strides(buffer_shape)
    return Layout(*(0 if size == 1 and to != 1 else stride
                         for size, to, stride in zip(buffer_shape, view_shape, strides)),
                       head_div)


def plan_dbias(bias_shape: tuple[int, ...], head_div: int, shape: AttnShape, bias_dtype,
               deterministic: bool, interpreted: bool = False) -> DbiasPlan:
    """The plan for a bias of ``bias_shape`` whose query head h reads bias head
    h // ``head_div``. ``interpreted``: the kernels run under Triton's interpreter, whose
    float32 -> bfloat16 cast truncates instead of rounding to nearest (up to 1 ulp instead of
    1/2: at the |dbias| ~ 40 of a summed row that is 0.25), so summed rows stay float32 there
    and torch rounds them."""
    bb, bh, bm, bn = bias_shape
    common = dict(bias_shape=tuple(bias_shape), bias_dtype=bias_dtype)
    if bn == 1:
        return DbiasPlan(DbiasMode.ZERO, tuple(bias_shape), bias_dtype,
                         broadcast_args(bias_shape, bias_shape, 1), **common)
    if bm == 1 and shape.seqlen_q > 1:
        # Query heads of a group share a gradient row unless the bias has a head per query.
        sum_group = bh != shape.heads_q or shape.group_size == 1
        rows = (shape.batch, shape.heads_kv if sum_group else shape.heads_q, 1, shape.seqlen_k)
        final = rows == tuple(bias_shape) and not (interpreted and bias_dtype == torch.bfloat16)
        return DbiasPlan(DbiasMode.DKDV_GROUP_ROWS if sum_group else DbiasMode.DKDV_ROWS,
                         rows, bias_dtype if final else torch.float32,
                         broadcast_args(rows, rows, 1), **common)

    view_shape = (shape.batch, bh, shape.seqlen_q, shape.seqlen_k)
    target = broadcast_args(bias_shape, view_shape, head_div)
    contributors = (shape.batch // bb) * (shape.heads_q // bh)
    if contributors == 1:
        return DbiasPlan(DbiasMode.DQ_TILES, tuple(bias_shape), bias_dtype, target, **common)
    if not deterministic:
        return DbiasPlan(DbiasMode.DQ_TILES_ATOMIC, tuple(bias_shape), torch.float32, target,
                         **common)
    # Deterministic: dkdv sums a group's heads in order; other programs' slices serialize.
    return DbiasPlan(DbiasMode.DKDV_TILES_ORDERED, tuple(bias_shape), torch.float32, target,
                     serialize_batch=bb == 1 and shape.batch > 1,
                     serialize_heads=bh == 1 and shape.heads_kv > 1, **common)


def per_query_head_rows(plan: DbiasPlan, shape: AttnShape) -> DbiasPlan:
    """``plan`` (rows summed over the GQA group, ``sum_group``) written instead as a float32
    row per (batch, query head), which ``finish`` sums over the group: for programs that each
    walk one query head of a group (the Hopper backward's split heads)."""
    rows = (shape.batch, shape.heads_q, 1, shape.seqlen_k)
    return DbiasPlan(DbiasMode.DKDV_ROWS, rows, torch.float32, broadcast_args(rows, rows, 1),
                     plan.bias_shape, plan.bias_dtype)


# The packed backward's bias gradient (``backward_packed``): its programs own whole (batch, kv
# head) groups of rows and whole key blocks, so each element of its (B, heads, rows, Lk) buffer
# has one writer and is stored once, never accumulated:
# * PACKED_SUMMED_ROWS: every row of a program's tile reads one bias row (a bias with 1 or Hk
#   heads and one query row, or any such bias at Lq = 1): the tile's dS is summed over its rows,
#   one buffer row per (batch, kv head).
# * PACKED_ROWS: each tile row has its own bias element (a bias with a head per query head, or
#   MHA, and a query axis of Lq): dS is stored as it is.


def plan_packed_dbias(bias_shape: tuple[int, ...], shape: AttnShape, bias_dtype,
                      interpreted: bool = False) -> DbiasPlan | None:
    """The packed backward's plan for a bias of ``bias_shape`` whose key axis is not broadcast,
    or None where its rows neither all share one gradient row nor each own one (with G > 1
    and Lq > 1, a (B, Hk, Lq, Lk) bias sums each query's G head rows, a (B, Hq, 1, Lk) one each
    head's Lq rows): such calls take the general backward. ``interpreted`` as in
    ``plan_dbias``."""
    _, bh, bm, _ = bias_shape
    rows = 1 if bm == 1 else shape.seqlen_q
    mha = shape.group_size == 1
    # The tile's heads (one GQA group) share a bias head, or each has its own.
    sum_rows = (bh != shape.heads_q or mha) and rows == 1
    if not (sum_rows or ((bh == shape.heads_q or mha) and rows == shape.seqlen_q)):
        return None
    heads = shape.heads_kv if sum_rows else shape.heads_q
    buffer = (shape.batch, heads, rows, shape.seqlen_k)
    final = buffer == tuple(bias_shape) and not (sum_rows and interpreted
                                                 and bias_dtype == torch.bfloat16)
    view = (shape.batch, shape.heads_q, shape.seqlen_q, shape.seqlen_k)
    return DbiasPlan(DbiasMode.PACKED_SUMMED_ROWS if sum_rows else DbiasMode.PACKED_ROWS,
                     buffer, bias_dtype if final else torch.float32,
                     broadcast_args(buffer, view, shape.heads_q // heads),
                     tuple(bias_shape), bias_dtype)
