"""The packed decode backward's host side (route ``packed``): one launch over key shares of
whole (batch, kv head) groups. The kernel, and why it exists, are in
``backward_packed_kernels``."""

from __future__ import annotations

import torch

from ._dbias import DbiasMode
from ._launch import (ABSENT_OPERAND, LOG2E, PlannedLaunch, contiguous_strides, dot_options,
                      operand_pointer, strides3)
from ._scratch import Scratch
from .backward_packed_kernels import attn_bwd_packed_kernel
from .schedule import BackwardSchedule


class PackedBackwardPlan:
    """A Schedule's packed backward for one forward plan and gradient signature; the same
    ``run`` as ``backward.BackwardPlan``."""

    def __init__(self, fwd, bwd: BackwardSchedule, grad_out, query, key, value, dq, dk, dv):
        shape = fwd.shape
        problem = fwd.schedule.problem
        tile = bwd.packed
        pairs = shape.batch * shape.heads_kv
        self.schedule = bwd
        self.splits = bwd.packed_key_splits
        self.device = fwd.device
        self.dbias = bwd.dbias
        writes_dbias = self.dbias is not None and self.dbias.packed
        self.launch = PlannedLaunch(
            attn_bwd_packed_kernel, (self.splits, pairs),
            (*(fwd.mask or ABSENT_OPERAND).as_args(), *(fwd.bias or ABSENT_OPERAND).as_args(),
             *(self.dbias.target if writes_dbias else ABSENT_OPERAND).as_args(),
             *strides3(query), *strides3(key), *strides3(value), *strides3(grad_out),
             *contiguous_strides(fwd.out_shape)[:3], *strides3(dq), *strides3(dk),
             *strides3(dv), shape.heads_q, shape.group_size, shape.seqlen_q, shape.seqlen_k,
             fwd.softmax_scale * LOG2E, fwd.softmax_scale),
            HEAD_DIM=shape.head_dim, BLOCK_D=problem.block_d, BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            HAS_MASK=fwd.mask is not None, HAS_BIAS=fwd.bias is not None,
            BIAS_ROW=fwd.bias_one_row and problem.bias.shared_by(shape.group_size),
            DBIAS_SUM_ROWS=writes_dbias and self.dbias.mode is DbiasMode.PACKED_SUMMED_ROWS,
            DBIAS_PER_ROW=writes_dbias and self.dbias.mode is DbiasMode.PACKED_ROWS,
            IS_CAUSAL=fwd.is_causal, **dot_options(fwd.dtype, problem.interpreted),
            SPLIT_KEYS=self.splits > 1,
            SKIP_DEAD_BLOCKS=bwd.packed_skips_dead_blocks,
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        )
        split = self.splits > 1
        self._scratch = Scratch(
            fwd.device,
            *(((self.splits, pairs, tile.block_m, problem.block_d), torch.float32),
              ((pairs,), torch.int32)) if split else ())

    def run(self, grad_out, query, key, value, out, lse, mask, bias, dq, dk, dv):
        """Fill ``dq``, ``dk``, ``dv``; return the bias gradient (or None)."""
        dq_part, counts = self._scratch.buffers() or (lse, lse)
        dbias = self.dbias.allocate(self.device) if self.dbias is not None else lse
        self.launch(query, key, value, out, grad_out, lse, dq, dk, dv, dq_part, counts,
                    operand_pointer(mask, lse), operand_pointer(bias, lse), dbias)
        return self.dbias.finish(dbias) if self.dbias is not None else None
