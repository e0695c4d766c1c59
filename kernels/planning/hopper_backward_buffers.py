"""The Hopper backward's buffers and the two Triton launches around its kernel.

One float32 scratch buffer (``runtime.scratch.Scratch``: kept per stream below its size cap)
holds, each view 256-byte aligned:

* the loader's rows: (2, B x Hq, Lq rounded up to the kernel's query block), first LSE x log2 e
  (+inf where a row saw no key, and past Lq: P = 0 there), then delta, the rows' sum of dO * O
  (0 past Lq). Padded, every query block's rows start 16-byte aligned, as TMA needs;
* the bias gradient's float32 rows where they are summed or cast after the kernel;
* the accumulators the kernel adds into, which start at zero: dQ's in dQ's own (B, Lq, Hq, D)
  order, with split heads dK's and dV's in (B, Lk, Hk, D) order, and the deterministic
  calls' locks (int32 zeroes are float32 zeroes).

Two planned launches (``PlannedLaunch``, kept per strides, so a call makes no plan) surround the
kernel: ``_loader_rows_kernel`` writes the rows, reading dO and O in their dtype, and zeroes the
accumulators; ``_backward_finish_kernel`` casts the accumulators into dq (and dk, dv) and sums
the bias rows into the gradient. Each replaced torch op (three zeroes, two copies, a sum, a
cast) and the per-call plans of the two launches cost the H200 host 10-40 us apiece.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..runtime.arith import ceil_div, next_power_of_2
from ..runtime.launch import PlannedLaunch
from ..runtime.scratch import Scratch
from ..triton_device.backward_finish import _backward_finish_kernel
from ..triton_device.backward_rows import _loader_rows_kernel
from .dbias import DbiasPlan
from .inputs import AttnShape

LOADER_ROWS_BLOCK = 64  # query rows per program of the loader rows' launch
ZERO_BLOCK = 1024  # float32 words a loader program zeroes per store
ZERO_WORDS_PER_PROGRAM = 16 * 1024  # at most, before the launch adds programs (64 KiB each)
# (batch, row, head)s per program of the casts. H200, B2 H16 D128 float32 to bf16, the spread
# dQ: 16 rows 105 us at L8192, 184 at L16384; 32 rows 110 and 194; 128 rows 682 and 1391.
CAST_ROWS = 16
BIAS_KEYS = 1024  # keys per program of the bias rows' sum
VIEW_ALIGN = 64  # float32 words: every view starts 256-byte aligned


class BackwardViews(NamedTuple):
    """One call's views of the scratch buffer (``rows`` of the loader; the accumulators; the
    bias gradient's rows, or None where the kernel writes the gradient itself)."""

    rows: torch.Tensor
    dq_acc: torch.Tensor
    dk_acc: torch.Tensor | None
    dv_acc: torch.Tensor | None
    locks: torch.Tensor | None
    bias_rows: torch.Tensor | None
    zeroed: torch.Tensor  # every accumulator and lock, zeroed by the loader rows' launch


def sums_bias_rows(dbias: DbiasPlan | None, shape: AttnShape) -> bool:
    """Whether the finishing launch makes the gradient from float32 rows (B, H, 1, Lk), H a
    multiple of the bias's heads: summed over groups of heads, and over the batch where the
    bias has one. False where the kernel's rows are the gradient (its shape and dtype)."""
    if dbias is None or not dbias.reduce_m or dbias.buffer_dtype != torch.float32:
        return False
    if dbias.buffer_shape == dbias.bias_shape and dbias.bias_dtype == torch.float32:
        return False
    batch, heads, one, keys = dbias.buffer_shape
    bias_batch, bias_heads, bias_rows, bias_keys = dbias.bias_shape
    return (one == 1 and bias_rows == 1 and keys == bias_keys == shape.seqlen_k
            and batch == shape.batch and bias_batch in (1, batch) and heads % bias_heads == 0)


class HopperBackwardBuffers:
    """The buffers and the two launches of one ``HopperBackwardPlan``: ``views`` for a call,
    ``fill_rows`` before the kernel, ``finish`` after it."""

    def __init__(self, shape: AttnShape, block_m: int, split_heads: bool, lock_count: int,
                 dbias: DbiasPlan | None, dq_spread: bool, device: torch.device):
        self.shape, self.dbias, self.dq_spread = shape, dbias, dq_spread
        self.padded_q = ceil_div(shape.seqlen_q, block_m) * block_m
        self.sums_bias = sums_bias_rows(dbias, shape)
        bh = shape.batch * shape.heads_q
        q_words = shape.batch * shape.seqlen_q * shape.heads_q * shape.head_dim
        kv_words = shape.batch * shape.seqlen_k * shape.heads_kv * shape.head_dim
        sizes = {"rows": 2 * bh * self.padded_q,
                 "bias_rows": math.prod(dbias.buffer_shape) if self.sums_bias else 0,
                 "dq_acc": q_words, "dk_acc": kv_words if split_heads else 0,
                 "dv_acc": kv_words if split_heads else 0, "locks": lock_count}
        self._spans, start = {}, 0
        for name, words in sizes.items():
            self._spans[name] = (start, words)
            start += ceil_div(words, VIEW_ALIGN) * VIEW_ALIGN
        self._zeroed = (self._spans["dq_acc"][0], start - self._spans["dq_acc"][0])
        self._scratch = Scratch(device, ((start,), torch.float32))
        self.split_heads = split_heads
        self._kept_views: tuple | None = None  # (the kept buffer, its views)
        self._row_launches: dict = {}
        self._finish_launches: dict = {}

    def views(self) -> BackwardViews:
        """The call's views of the scratch buffer (the stream's kept one, or its own); a kept
        buffer's views are made once (each slice and view a torch op of host time)."""
        (buffer,) = self._scratch.buffers()
        kept = self._kept_views
        if kept is not None and kept[0] is buffer:
            return kept[1]
        views = self._views_of(buffer)
        if self._scratch.keeps(buffer):
            self._kept_views = (buffer, views)
        return views

    def keeps(self, views: BackwardViews) -> bool:
        """Whether ``views`` are of a kept buffer, so a later call may get them again."""
        return self._kept_views is not None and self._kept_views[1] is views

    def _views_of(self, buffer: torch.Tensor) -> BackwardViews:
        shape = self.shape

        def view(name, *dims):
            start, words = self._spans[name]
            return buffer[start:start + words].view(dims) if words else None

        locks = view("locks", self._spans["locks"][1])
        bias_rows = view("bias_rows", *self.dbias.buffer_shape) if self.sums_bias else None
        kv = (shape.batch, shape.seqlen_k, shape.heads_kv, shape.head_dim)
        zero_start, zero_words = self._zeroed
        return BackwardViews(
            view("rows", 2, shape.batch * shape.heads_q, self.padded_q),
            view("dq_acc", shape.batch, shape.seqlen_q, shape.heads_q, shape.head_dim),
            view("dk_acc", *kv), view("dv_acc", *kv),
            None if locks is None else locks.view(torch.int32), bias_rows,
            buffer[zero_start:zero_start + zero_words])

    def bias_buffer(self, views: BackwardViews, device: torch.device) -> torch.Tensor | None:
        """What the kernel writes the bias gradient into: the views' float32 rows, or a buffer
        of its plan (the gradient itself where it is final)."""
        if self.dbias is None:
            return None
        return views.bias_rows if self.sums_bias else self.dbias.allocate(device)

    def fill_rows(self, grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  views: BackwardViews) -> None:
        """Write ``views.rows`` and zero ``views.zeroed``: one launch. ``grad_out``, ``out``:
        (B, Lq, Hq, D), last dim contiguous; ``lse``: (B, Hq, Lq) natural-log float32,
        contiguous."""
        key = (grad_out.stride(), out.stride())
        planned = self._row_launches.get(key)
        if planned is None:
            planned = self._row_launches[key] = self._rows_launch(grad_out.stride(),
                                                                  out.stride())
        planned(grad_out, out, lse, views.rows, views.zeroed)

    def _rows_launch(self, grad_strides: tuple, out_strides: tuple) -> PlannedLaunch:
        shape = self.shape
        bh = shape.batch * shape.heads_q
        zero_words = self._zeroed[1]
        blocks = max(ceil_div(self.padded_q, LOADER_ROWS_BLOCK),
                     ceil_div(zero_words, bh * ZERO_WORDS_PER_PROGRAM))
        chunk = ceil_div(ceil_div(zero_words, bh * blocks), ZERO_BLOCK) * ZERO_BLOCK
        return PlannedLaunch(
            _loader_rows_kernel, (bh, blocks), None,
            (*grad_strides[:3], *out_strides[:3], shape.heads_q, shape.seqlen_q, self.padded_q,
             bh, zero_words, chunk),
            num_warps=4, num_stages=1, HEAD_DIM=shape.head_dim,
            BLOCK_D=max(16, next_power_of_2(shape.head_dim)), BLOCK_M=LOADER_ROWS_BLOCK,
            ZERO_BLOCK=ZERO_BLOCK)

    def finish(self, views: BackwardViews, dq: torch.Tensor, dk: torch.Tensor,
               dv: torch.Tensor, bias_buffer: torch.Tensor | None) -> torch.Tensor | None:
        """Cast the accumulators into ``dq`` (with split heads ``dk`` and ``dv``; each (B, L,
        H, D), last dim contiguous) and return the bias gradient (or None): one launch, and
        the plan's own finish where the kernel wrote anything else than float32 rows."""
        key = (dq.stride(), dk.stride(), dv.stride())
        planned = self._finish_launches.get(key)
        if planned is None:
            planned = self._finish_launches[key] = self._finish_launch(*key)
        grad = None
        if self.sums_bias:
            grad = torch.empty(self.dbias.bias_shape, dtype=self.dbias.bias_dtype,
                               device=dq.device)
        split = self.split_heads
        planned(views.dq_acc, dq, views.dk_acc if split else views.dq_acc, dk if split else dq,
                views.dv_acc if split else views.dq_acc, dv if split else dq,
                views.bias_rows if grad is not None else views.dq_acc,
                grad if grad is not None else dq)
        if grad is None and bias_buffer is not None:
            return self.dbias.finish(bias_buffer)
        return grad

    def _finish_launch(self, dq_strides: tuple, dk_strides: tuple,
                       dv_strides: tuple) -> PlannedLaunch:
        shape = self.shape
        q_rows = shape.batch * shape.seqlen_q * shape.heads_q
        kv_rows = shape.batch * shape.seqlen_k * shape.heads_kv
        q_blocks = ceil_div(q_rows, CAST_ROWS)
        kv_blocks = ceil_div(kv_rows, CAST_ROWS) if self.split_heads else 0
        bias = (1, 1, 1, 1, 1)  # key blocks, row heads, bias heads, summed batches, group
        bias_blocks = 0
        if self.sums_bias:
            batch, heads = self.dbias.buffer_shape[:2]
            bias_batch, bias_heads = self.dbias.bias_shape[:2]
            key_blocks = ceil_div(shape.seqlen_k, BIAS_KEYS)
            bias = (key_blocks, heads, bias_heads, batch if bias_batch == 1 else 1,
                    heads // bias_heads)
            bias_blocks = bias_batch * bias_heads * key_blocks
        return PlannedLaunch(
            _backward_finish_kernel, (q_blocks + 2 * kv_blocks + bias_blocks,), None,
            (q_blocks, kv_blocks, q_rows, kv_rows, shape.seqlen_q, shape.seqlen_k,
             shape.heads_q, shape.heads_kv, *dq_strides[:3], *dk_strides[:3],
             *dv_strides[:3], *bias),
            num_warps=4, num_stages=1, DQ_SPREAD=self.dq_spread, HEAD_DIM=shape.head_dim,
            BLOCK_D=max(16, next_power_of_2(shape.head_dim)), BLOCK_R=CAST_ROWS,
            BLOCK_N=BIAS_KEYS)
