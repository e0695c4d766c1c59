"""The forward's host side: plan a call (its Problem, Schedule and mask activity) and carry out
the Schedule's forward launch: the Triton kernel (``triton_device.forward_kernels``), or where
the schedule takes the Hopper route, ``hopper_forward``'s launch."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..runtime.arith import LOG2E, ceil_div, contiguous_strides
from ..runtime.device import capability, multiprocessors
from ..runtime.launch import PlannedLaunch, dot_options, is_interpreted
from ..runtime.routes import note_route
from ..runtime.scratch import Scratch
from ..triton_device.forward_kernels import _attn_fwd_kernel
from . import tuning
from .activity import (ActivityMap, ListCompaction, block_list_strides, call_activity,
                       shared_granularity, tile_activity)
from .documents import document_tiles
from .gather_decode import GatherDecodePlan, mask_kind
from .hopper_forward import list_tile
from .hopper_forward_launch import HopperForwardLaunch
from .inputs import CheckedInputs, operand_args, operand_pointer
from .operands import ABSENT, ForwardPointers, Layout, SeqStrides, seq_strides, sizes_of
from .problem import Problem, problem_of, tma_strides
from .schedule import Schedule, activity_tiles, schedule


def interpreted() -> bool:
    """Whether the kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return is_interpreted(_attn_fwd_kernel)


def call_problem(checked: CheckedInputs, query: torch.Tensor, is_causal: bool,
                 deterministic: bool = False, bias_grad: bool = False,
                 activity: ActivityMap | None = None, intervals_per_call: bool = False,
                 forward_only: bool = False, key: torch.Tensor | None = None,
                 value: torch.Tensor | None = None, kept_keys: int | None = None) -> Problem:
    """The Problem of a call with these checked inputs. Without ``key`` and ``value`` (a
    mask prepared ahead of the call) the problem does not take TMA operands."""
    on_interpreter = interpreted()
    device = query.device
    operands = (query, key, value)
    return problem_of(checked, query.dtype, device, on_interpreter,
                      multiprocessors(device, on_interpreter), is_causal, deterministic,
                      bias_grad, activity, intervals_per_call, forward_only,
                      capability(device, on_interpreter),
                      key is not None and value is not None and tma_strides(*operands),
                      kept_keys)


def mask_activity(checked: CheckedInputs, sched: Schedule,
                  with_backward: bool) -> ActivityMap:
    """The mask's activity map, in tiles that divide the forward's list tiles (the Hopper
    forward's too: three warpgroups' are 192 rows) and, with ``with_backward``, the backward's
    too, so that every kernel's lists come from it."""
    hopper = sched.forward.hopper
    tiles = (activity_tiles(sched.problem, sched.forward) if with_backward
             else (sched.forward.list_tile,
                   *((list_tile(hopper),) if hopper is not None and checked.mask is not None
                     else ())))
    sub_rows, sub_cols = shared_granularity(tiles)
    return tile_activity(checked.mask, checked.shape, sub_rows, sub_cols,
                         sched.problem.is_causal)


def plan_schedule(checked: CheckedInputs, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, is_causal: bool, deterministic: bool, bias_grad: bool,
                  options: dict, activity: ActivityMap | None = None,
                  with_backward: bool = False, intervals_per_call: bool = False,
                  kept_keys: int | None = None) -> Schedule:
    """The call's Schedule. A mask without a prepared ``activity`` map is read here (the
    schedule's tiles do not depend on the map; its stages and skips read the map's counts),
    unless the forward reads it itself (``scan_keys``). ``intervals_per_call``: the mask is
    ``KeyIntervals`` that the call reads (not prepared)."""
    problem = call_problem(checked, query, is_causal, deterministic, bias_grad, activity,
                           intervals_per_call, forward_only=not with_backward, key=key,
                           value=value, kept_keys=kept_keys)
    sched = schedule(problem, options)
    if checked.mask is not None and activity is None and not sched.forward.reads_mask_itself:
        activity = mask_activity(checked, sched, with_backward)
        sched = schedule(replace(problem, activity=activity), options)
    return sched


class ForwardPlan:
    """A Schedule's forward launch for one call signature (shapes, strides, dtypes, device,
    mask and bias layout, causality, scale, what the backward will need, options), planned
    once: the interface keeps plans by signature, so that a repeat call only allocates its
    outputs and launches. The backward reads the problem's layout from here too and keeps its
    own plans in ``backward_plans``.

    ``lists_per_call``: every call brings its own activity map (``run``'s ``activity``; an
    unprepared ``KeyIntervals`` mask, read per call), and the plan keeps no map, list or other
    tensor of the call that made it. Otherwise the lists come from the schedule's map (a
    prepared mask's) and are kept here. With the schedule's ``scan_keys`` there is neither:
    every call brings its intervals' (start, end) tensors as ``run``'s ``mask``."""

    def __init__(self, checked: CheckedInputs, query, key, value, sched: Schedule,
                 options: dict, lists_per_call: bool = False):
        problem, fwd = sched.problem, sched.forward
        shape = problem.shape
        self.options = options
        self.shape, self.dtype, self.device = shape, query.dtype, query.device
        self.is_causal, self.softmax_scale = problem.is_causal, problem.softmax_scale
        self.mask_layout = operand_args(checked.mask) if checked.mask is not None else None
        self.scan_keys = fwd.scan_keys
        # The forward reads the call's mask as given: KeyIntervals' start and end (their
        # layout), or the bool mask; no activity map, no lists.
        self.mask_as_given = fwd.reads_mask_itself
        intervals_as_given = self.mask_as_given and problem.interval_pair
        if intervals_as_given:  # the layout of the intervals' start and end as given
            self.mask_layout = Layout(*checked.mask.interval_pair[0].stride(), checked.mask.head_div)
        self.bias_layout = operand_args(checked.bias) if checked.bias is not None else None
        self.bias_shape = problem.bias.shape if problem.bias is not None else None
        self.lists_per_call = lists_per_call
        activity = problem.activity
        lists = None
        if checked.mask is not None and not self.mask_as_given:
            lists = activity.lists(*fwd.list_tile, transposed=False)
        self.compaction = self.hopper_compaction = None
        self.hopper_table = None
        masked_hopper = fwd.hopper is not None and checked.mask is not None and not fwd.documents
        if masked_hopper and not lists_per_call:
            self.hopper_table = activity.lists(*list_tile(fwd.hopper), transposed=False).table
        if lists_per_call and not self.mask_as_given:
            # Kept: the compaction of a call's map (of this map's shape and tile) into the
            # forward's list, and the table's strides; not the map or the table.
            self.compaction = ListCompaction(activity.active.shape, activity.sub_rows,
                                             activity.sub_cols, *fwd.list_tile, False)
            if masked_hopper:
                self.hopper_compaction = ListCompaction(
                    activity.active.shape, activity.sub_rows, activity.sub_cols,
                    *list_tile(fwd.hopper), False)
            activity = None
            sched = replace(sched, problem=replace(problem, activity=None))
        self.schedule, self.activity = sched, activity
        self.list_table = lists.table if lists is not None and not lists_per_call else None
        self.backward_plans: dict = {}  # kept here by planning.backward, per grad signature

        pack = fwd.group_pack
        row_blocks = ceil_div(shape.seqlen_q, fwd.query_rows)
        num_bh = shape.batch * shape.heads_q
        self.splits = fwd.key_splits
        self.out_shape = (shape.batch, shape.seqlen_q, shape.heads_q, shape.head_dim)
        self.lse_shape = (shape.batch, shape.heads_q, shape.seqlen_q)
        self.part_shape = (self.splits, num_bh, shape.seqlen_q, problem.block_d)
        out_strides = SeqStrides(*contiguous_strides(self.out_shape)[:3])
        self.main = PlannedLaunch(
            _attn_fwd_kernel, (row_blocks * (num_bh // pack), 1, self.splits),
            ForwardPointers,
            (seq_strides(query), seq_strides(key), seq_strides(value), out_strides,
             self.mask_layout or ABSENT, self.bias_layout or ABSENT, block_list_strides(lists, shape.batch),
             sizes_of(shape), problem.softmax_scale * LOG2E, fwd.chunk_rows),
            HEAD_DIM=shape.head_dim, BLOCK_D=problem.block_d,
            BLOCK_M=fwd.block_m, BLOCK_N=fwd.tile.block_n, GROUP_PACK=pack,
            HAS_MASK=problem.mask is not None, HAS_BIAS=problem.bias is not None,
            BIAS_ROW=fwd.bias_row, IS_CAUSAL=problem.is_causal,
            **dot_options(query.dtype, problem.interpreted), SPLIT_KEYS=self.splits > 1,
            EDGE_SLOTS=fwd.edge_slots, SCAN_KEYS=self.scan_keys,
            SCAN_CHUNK=tuning.FORWARD_SCAN_CHUNK,
            num_warps=fwd.tile.num_warps, num_stages=fwd.tile.num_stages,
        )
        # Split-K partials and their tiles' arrival counters, and an LSE for calls that
        # neither return nor save one, are scratch.
        parts = (((self.part_shape, torch.float32), (self.part_shape[:3], torch.float32),
                  ((self.main.grid[0],), torch.int32))
                 if self.splits > 1 else ())
        self._scratch = Scratch(query.device, *parts)
        self._scratch_with_lse = Scratch(query.device, (self.lse_shape, torch.float32), *parts)
        self.hopper = self.hopper_documents = self.document_tiling = None
        # A prepared mask of packed documents: their offsets and causality, for the backward's
        # key blocks (``HopperBackwardPlan``); the plan is the prepared intervals' own. A plan
        # of unprepared ones (lists per call) keeps neither: each call brings its offsets.
        self.documents = (checked.mask.documents if problem.documents is not None
                          and not lists_per_call else None)
        # The documents' own causality, for either kernel that walks them
        self.document_causal = (checked.mask.documents[2] if problem.documents is not None
                                else None)
        if fwd.documents:
            causal = self.document_causal
            self.hopper = HopperForwardLaunch(problem, fwd.hopper, None, checked.bias,
                                              fwd.tile_order, sequences=problem.documents,
                                              causal=causal)
            # (rows, keys per block, causality) of ``document_tiles``' table
            self.document_tiling = (fwd.hopper.tile_rows, fwd.hopper.block_n, causal)
            if self.documents is not None:  # kept: the prepared intervals' own table
                self.hopper_documents = self.call_documents(self.documents[:2])
        elif fwd.hopper is not None:
            self.hopper = HopperForwardLaunch(problem, fwd.hopper, checked.mask, checked.bias,
                                              fwd.tile_order)
        self.gather = None
        if fwd.gather is not None:
            mask = checked.mask
            scan_rows = 1 if mask.view.stride(2) == 0 else shape.seqlen_q
            kind = mask_kind(mask.interval_pair if intervals_as_given else mask.view)
            self.gather = GatherDecodePlan(problem, fwd.gather, query, key, value,
                                           self.mask_layout, self.bias_layout, kind, scan_rows)

    def call_documents(self, offsets: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        """(the tile table, cu_q, cu_k) that the Hopper forward walks packed documents by,
        for int32 ``offsets`` (cu_q, cu_k): ``document_tiles`` on their device, no read-back."""
        cu_q, cu_k = offsets
        rows, block_n, causal = self.document_tiling
        return document_tiles(cu_q, cu_k, self.shape.seqlen_q, rows, block_n, causal), cu_q, cu_k

    @property
    def bias_one_row(self) -> bool:
        return self.bias_shape is not None and self.bias_shape[2] == 1

    def lists_activity(self, activity: ActivityMap | None) -> ActivityMap | None:
        """The map a call's lists come from: the call's own ``activity`` where the plan takes
        lists per call, else the plan's (None without a mask)."""
        return call_activity(activity) if self.lists_per_call else self.activity

    def run(self, query, key, value, mask_operand, bias, keep_lse: bool = True,
            activity: ActivityMap | None = None, kept_lists: tuple | None = None,
            document_offsets: tuple | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out (B, Lq, Hq, D), lse (B, Hq, Lq) float32, or None without ``keep_lse``) for
        tensors of this plan's signature; ``mask_operand`` is what the kernel reads of the call's
        mask (``call_plan.MaskOperand``: the bool mask, a KeyIntervals mask's words, or None) and
        ``bias`` the bias, either may be None; ``activity``: the call's own activity map, for a
        plan with ``lists_per_call``; ``kept_lists``: on the gather route, the kept-key lists
        that intervals read as given came with (``KeyIntervals._kept_lists``), or None;
        ``document_offsets``: the offsets (cu_q, cu_k) of unprepared packed documents, for a
        plan that walks them (its table is made per call), else None. With ``scan_keys``,
        ``mask_operand`` is the intervals' (start, end) as given, of the plan's layout."""
        if self.gather is not None:
            note_route("forward", "gather")
            return self.gather.run(query, key, value, mask_operand, bias, keep_lse,
                                   lists=kept_lists)
        # ``new_empty`` takes dtype and device from ``query`` (the plan's own): 2.9 us of host
        # per call against 3.9 for ``torch.empty`` with both named, on the H100 host.
        out = query.new_empty(self.out_shape)
        kept = None if keep_lse else self._scratch_with_lse.buffers()
        lse = (torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
               if keep_lse else kept[0])
        walks_documents = self.document_tiling is not None
        hopper_mask = None if mask_operand is None or walks_documents else mask_operand
        if self.hopper is not None and self.hopper.takes(
                query, key, value, *(() if hopper_mask is None else (hopper_mask,)),
                *(() if bias is None else (bias,))):
            note_route("forward", "hopper")
            documents = self.hopper_documents
            if walks_documents and documents is None:  # unprepared: this call's table
                documents = self.call_documents(document_offsets)
            table = self.hopper_table
            if self.hopper_compaction is not None:  # compacted from the call's map
                table = call_activity(activity).compacted(self.hopper_compaction).table
            self.hopper(query, key, value, out, lse, hopper_mask, table, bias, documents)
            return out, (lse if keep_lse else None)
        table = self.list_table
        mask, mask_end = mask_operand, None
        if self.scan_keys:
            mask, mask_end = mask_operand
        elif self.lists_per_call:  # compacted from the call's map on first use
            table = call_activity(activity).compacted(self.compaction).table
        note_route("forward", "triton")
        parts = self._scratch.buffers() if keep_lse else kept[1:]
        out_part, lse_part, counts = parts if parts else (lse, lse, lse)
        self.main(query, key, value, out, lse, operand_pointer(mask, out),
                  operand_pointer(bias, out),
                  lse if table is None else table, out_part, lse_part,
                  counts, operand_pointer(mask_end, out))
        return out, (lse if keep_lse else None)
