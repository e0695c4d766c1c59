"""The Hopper forward's launch for one call signature (``HopperForwardLaunch``): the kernel's
tiles, descriptors and scalars fixed once, and the geometry of a broadcast mask or bias as a
descriptor reads it (``mask_geometry``). Which calls take it: ``hopper_forward``."""

from __future__ import annotations

import torch

from ..runtime.arith import LOG2E, ceil_div
from ..runtime.launch import DescriptorLaunch
from ..runtime.tma import TmaSpec
from . import tuning
from .documents import tile_bound
from .hopper_forward import (INTERVAL_WORDS, MASK_ROW, MASK_TILE, NO_MASK, TILE_ORDERS,
                             attention_forward, full_bias, mask_kind)
from .problem import Problem

try:
    from triton.experimental.gluon import language as gl
except ImportError:  # a Triton without Gluon: no launch is planned (``GLUON_MISSING``)
    gl = None


def block_head_dim(head_dim: int) -> int:
    """The head dim of the kernel's tiles: 64 or 128 (columns past the head dim read as 0)."""
    return 64 if head_dim <= 64 else 128


def gluon_dtype(dtype: torch.dtype):
    """The Gluon element type of a 16-bit torch dtype."""
    return gl.float16 if dtype == torch.float16 else gl.bfloat16


def nvmma_spec(box: list, element) -> TmaSpec:
    """The TMA spec of ``box`` tiles of ``element``s in their default shared layout, over a
    tensor as it is laid out."""
    return TmaSpec(box, gl.NVMMASharedLayout.get_default_for(box, element))


class HopperForwardLaunch:
    """The Hopper forward of one call signature: its grid, tiles' shared layouts and scalars,
    fixed once. A call makes the descriptors from its tensors and launches. With a bool mask
    (``mask``: its ``BroadcastOperand``) the plan also fixes the mask descriptor's shape and
    strides and the list table's strides; a call brings the table (``BlockLists.table`` of
    ``list_tile``) and the mask. With a bias row (``bias``: its ``BroadcastOperand``) it fixes
    the bias descriptor's shape and strides; a call brings the bias. With ``sequences``
    (packed documents, no mask: the number of sequences the offsets pack; ``causal``: whether
    each sequence is) the tiles are each sequence's (``documents.document_tiles``), and a call
    brings the table and the offsets."""

    def __init__(self, problem: Problem, tile: tuning.HopperTile, mask=None, bias=None,
                 order: str = "heads", sequences: int | None = None,
                 causal: bool | None = None):
        shape = problem.shape
        block_d = block_head_dim(shape.head_dim)
        element = gluon_dtype(problem.dtype)
        self.q_spec = nvmma_spec([1, tile.rows, 1, block_d], element)
        self.kv_spec = nvmma_spec([1, tile.block_n, 1, block_d], element)
        row_tiles = ceil_div(shape.seqlen_q, tile.tile_rows)
        batch_heads = shape.batch * shape.heads_q
        self.documents = sequences is not None
        if self.documents:
            if mask is not None or shape.batch != 1:
                raise ValueError("packed documents take no mask and one batch")
            row_tiles = tile_bound(shape.seqlen_q, sequences, tile.tile_rows)
        num_tiles = row_tiles * batch_heads
        self.kind = mask_kind(problem) if not self.documents else NO_MASK
        self.masked = mask is not None
        if self.masked:
            words = self.kind == INTERVAL_WORDS
            # KeyIntervals' int64 words are read as int32 pairs: newer Triton refuses 64-bit
            # descriptors.
            view = mask.view.view(torch.int32) if words else mask.view
            mask_shape, mask_strides, mask_head_div, mask_batches = mask_geometry(
                view, shape.heads_q, words)
            box = {MASK_TILE: [tile.tile_rows, tile.block_n], MASK_ROW: [1, tile.block_n],
                   INTERVAL_WORDS: [2 * tile.block_n]}[self.kind]
            mask_box = [1, 1, *box]
            mask_layout = (
                gl.NVMMASharedLayout.get_default_for(mask_box, gl.uint8)
                if self.kind == MASK_TILE else
                gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32 if words else 8,
                                     rank=len(mask_box)))
            self.mask_spec = TmaSpec(mask_box, mask_layout, mask_shape, mask_strides)
            # Query head h reads list head h // mask.head_div (the map's heads are the mask's
            # own) and mask head h // mask_head_div (1 head where its stride is 0).
            self.mask_scalars = (mask.head_div, mask_head_div, mask_batches)
        bias_tile = full_bias(problem) and bias is not None
        self.launch = DescriptorLaunch(
            attention_forward, (min(num_tiles, problem.multiprocessors),),
            (shape.seqlen_q, shape.seqlen_k, shape.heads_q, shape.group_size,
             problem.softmax_scale * LOG2E, row_tiles, batch_heads, num_tiles,
             TILE_ORDERS[order]),
            num_warps=4, CAUSAL=problem.is_causal if causal is None else causal,
            MASK_KIND=self.kind,
            HAS_BIAS=bias is not None, DOCUMENTS=self.documents, STAGES=tile.stages,
            CONSUMERS=tile.consumers, OVERLAP=tile.overlap, CONSUMER_REGS=tile.consumer_regs,
            LOADER_REGS=tile.loader_regs, BIAS_TILE=bias_tile)
        self.batch = shape.batch
        self.out_row_stride = shape.heads_q * shape.head_dim  # the output is contiguous
        self.head_dim = shape.head_dim
        self.unmasked_args = (0, 0, 0, 1, 1, 0)  # list strides and divisors, never read
        # The bias's descriptor geometry over its (B, H, Lq, Lk) broadcast view: (Bb, Hb, 1,
        # Lk) for a row, (Bb, Hb, Lq, Lk) for a full bias, its strides, query heads per bias
        # head and 1 if its batch is read; boxes of a row or a warpgroup's rows.
        self.biased = bias is not None
        if self.biased:
            bias_shape, bias_strides, bias_head_div, bias_batches = mask_geometry(
                bias.view, shape.heads_q)
            self.bias_scalars = (bias_head_div, bias_batches)
            if bias_tile:
                box = [1, 1, tile.rows, tile.block_n]
                layout = gl.NVMMASharedLayout.get_default_for(box, element)
            else:
                box = [1, 1, 1, tile.block_n]
                layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=4)
            self.bias_spec = TmaSpec(box, layout, bias_shape, bias_strides)

    @staticmethod
    def takes(*tensors: torch.Tensor) -> bool:
        """Whether every tensor's address suits a descriptor (16-byte aligned)."""
        return all(t.data_ptr() % 16 == 0 for t in tensors)

    def __call__(self, query, key, value, out, lse, mask=None, table=None, bias=None,
                 documents=None) -> None:
        """Write ``out`` (B, Lq, Hq, D), contiguous, and ``lse`` (B, Hq, Lq) float32; a masked
        plan's call brings the bool ``mask`` and its lists' ``table``, a biased plan's the
        ``bias``, a plan of packed documents ``documents``: (``document_tiles``' table,
        cu_q, cu_k)."""
        k_desc = self.kv_spec(key)
        if self.masked:
            base = mask.view(torch.int32 if self.kind == INTERVAL_WORDS else torch.uint8)
            mask_desc = self.mask_spec(base)
            shared = table.shape[0] == 1 and self.batch > 1
            list_args = (table, 0 if shared else table.stride(0), table.stride(1),
                         table.stride(2), *self.mask_scalars)
        else:  # stand-ins the kernel never reads
            mask_desc, list_args = k_desc, (lse, *self.unmasked_args)
        if self.documents:
            document_args = (*documents, out, self.out_row_stride, self.head_dim)
        else:  # stand-ins the kernel never reads
            document_args = (lse, lse, lse, lse, 0, 0)
        self.launch(self.q_spec(query), k_desc, self.kv_spec(value), self.q_spec(out), lse,
                    mask_desc, *list_args,
                    *self._bias_args(bias, k_desc), *document_args)

    def _bias_args(self, bias, stand_in) -> tuple:
        """(the bias rows' descriptor, query heads per bias head, 1 if its batch is read), or
        stand-ins never read."""
        if not self.biased:
            return (stand_in, 1, 0)
        return (self.bias_spec(bias), *self.bias_scalars)


def mask_geometry(view: torch.Tensor, heads_q: int,
                   words: bool = False) -> tuple[list, list, int, int]:
    """(shape, strides, query heads per mask head, 1 if the batch is read else 0) of the
    descriptor over a mask's (B, H, Lq, Lk) broadcast view: (Bm, Hm, Lq or 1, Lk) for a bool
    mask; for KeyIntervals' words (``words``: their query stride is 0, dropped) (Bm, Hm, Lk),
    or (Bm, Hm, 2 x Lk) for the words viewed as int32 pairs, strides in the view's elements.
    An axis of stride 0 or length 1 becomes one of length 1, read at index 0, its stride a
    stand-in multiple of 16 bytes."""
    sizes, strides = list(view.shape), list(view.stride())
    if words:
        sizes, strides = sizes[:2] + sizes[3:], strides[:2] + strides[3:]
    stand_in = 16 * max(1, sizes[-1])  # 16 elements of any dtype: a multiple of 16 bytes
    for axis in range(len(sizes) - 1):
        if strides[axis] == 0 or sizes[axis] == 1:
            sizes[axis], strides[axis] = 1, stand_in
    strides[-1] = 1
    return sizes, strides, heads_q // sizes[1], int(sizes[0] > 1)
