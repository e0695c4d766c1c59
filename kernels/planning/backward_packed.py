"""The packed decode backward's host side (route ``packed``): one launch over key shares of
whole (batch, kv head) groups. The kernel, and why it exists, are in
``backward_packed_kernels``."""

from __future__ import annotations

import torch

from ..runtime.arith import LOG2E, contiguous_strides
from ..runtime.launch import PlannedLaunch, dot_options
from ..runtime.routes import note_route
from ..runtime.scratch import Scratch
from ..triton_device.backward_packed_kernels import attn_bwd_packed_kernel
from .backward_schedule import BackwardSchedule
from .dbias import DbiasMode
from .inputs import operand_pointer
from .operands import (ABSENT, BackwardLayouts, BackwardStrides, NO_LISTS, PackedPointers,
                       SeqStrides, seq_strides, sizes_of)


class PackedBackwardPlan:
    """A Schedule's packed backward for one forward plan and gradient signature; the same
    ``run`` as ``backward.BackwardPlan``."""

    route = "packed"  # as kernels.record_routes names it

    def __init__(self, fwd, bwd: BackwardSchedule, grad_out, query, key, value, dq, dk, dv,
                 activity=None):
        shape = fwd.shape
        problem = fwd.schedule.problem
        launch = bwd.packed
        tile = launch.tile
        pairs = shape.batch * shape.heads_kv
        self.schedule = bwd
        self.splits = launch.key_splits
        self.device = fwd.device
        self.dbias = bwd.dbias
        writes_dbias = self.dbias is not None and self.dbias.packed
        strides = BackwardStrides(
            q=seq_strides(query), k=seq_strides(key), v=seq_strides(value),
            do=seq_strides(grad_out), out=SeqStrides(*contiguous_strides(fwd.out_shape)[:3]),
            dq=seq_strides(dq), dk=seq_strides(dk), dv=seq_strides(dv))
        layouts = BackwardLayouts(
            mask=fwd.mask_layout or ABSENT, bias=fwd.bias_layout or ABSENT,
            dbias=self.dbias.target if writes_dbias else ABSENT, q_lists=NO_LISTS,
            kv_lists=NO_LISTS)
        self.launch = PlannedLaunch(
            attn_bwd_packed_kernel, (self.splits, pairs), PackedPointers,
            (strides, layouts, sizes_of(shape), fwd.softmax_scale * LOG2E, fwd.softmax_scale),
            HEAD_DIM=shape.head_dim, BLOCK_D=problem.block_d, BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            HAS_MASK=fwd.mask_layout is not None, HAS_BIAS=fwd.bias_layout is not None,
            BIAS_ROW=fwd.bias_one_row and problem.bias.shared_by(shape.group_size),
            DBIAS_MODE=(self.dbias.mode if writes_dbias else DbiasMode.NONE).code,
            IS_CAUSAL=fwd.is_causal, **dot_options(fwd.dtype, problem.interpreted),
            SPLIT_KEYS=self.splits > 1,
            SKIP_DEAD_BLOCKS=launch.skips_dead_blocks,
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        )
        split = self.splits > 1
        self._scratch = Scratch(
            fwd.device,
            *(((self.splits, pairs, tile.block_m, problem.block_d), torch.float32),
              ((pairs,), torch.int32)) if split else ())

    def run(self, grad_out, query, key, value, out, lse, mask, bias, dq, dk, dv,
            activity=None):
        """Fill ``dq``, ``dk``, ``dv``; return the bias gradient (or None). The packed launch
        walks no lists, so it reads no activity map (``activity`` is unused)."""
        note_route("backward", self.route)
        dq_part, counts = self._scratch.buffers() or (lse, lse)
        dbias = self.dbias.allocate(self.device) if self.dbias is not None else lse
        self.launch(query, key, value, out, grad_out, lse, dq, dk, dv, dq_part, counts,
                    operand_pointer(mask, lse), operand_pointer(bias, lse), dbias)
        return self.dbias.finish(dbias) if self.dbias is not None else None
