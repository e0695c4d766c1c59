"""The backward's host side: carry out a Schedule's backward launches.

A ``BackwardPlan`` is worked out once per forward plan and gradient signature from the
Schedule's backward part: the active-tile lists (from the forward's activity map, never the
mask), grids and every scalar argument. A repeat backward only allocates and launches: dq (it
also stores delta) then dkdv, or both as one fused launch (route ``fused``). Where dq splits
the keys or dkdv its GQA group's heads, the split programs merge their partials within the
launch (``_partials``), so no merge launch follows. Route ``packed`` (decode) is
``backward_packed``'s.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import replace

import torch

from ..runtime.arith import LOG2E, ceil_div, contiguous_strides
from ..runtime.launch import PlannedLaunch, dot_options
from ..runtime.routes import note_route
from ..runtime.scratch import Scratch, graph_capturing
from ..triton_device.backward_dkdv_kernels import attn_bwd_dkdv_kernel
from ..triton_device.backward_kernels import attn_bwd_dq_kernel, attn_bwd_fused_kernel
from . import tuning
from .activity import ActivityMap, BlockLists, ListCompaction, block_list_strides, call_activity
from .backward_packed import PackedBackwardPlan
from .backward_schedule import (BackwardRoute, BackwardSchedule, backward_tiles,
                                compared_dkdv_tiles, packed_tile, packed_tile_heads, takes_packed,
                                wide_tile_possible)
from .dbias import DbiasMode, broadcast_args
from .grids import edge_slots, grid_chunk_rows
from .hopper_backward import HopperBackwardPlan
from .inputs import operand_pointer
from .operands import (ABSENT, BackwardLayouts, BackwardStrides, DkdvPointers, DqPointers,
                       FusedPointers, SeqStrides, seq_strides, sizes_of)
from .problem import Problem
from .schedule import schedule
from .tuning import Tile


def backward_lists(activity: ActivityMap | None, dkdv: Tile,
                   dq: Tile) -> tuple[BlockLists | None, BlockLists | None]:
    """(dkdv lists, keys on rows; dq lists) from the activity map, or (None, None) without one."""
    if activity is None:
        return None, None
    return (activity.lists(dkdv.block_n, dkdv.block_m, transposed=True),
            activity.lists(dq.block_m, dq.block_n, transposed=False))


def prepare_backward_lists(activity: ActivityMap, problem: Problem) -> None:
    """Build (and keep in ``activity``) both backward kernels' lists ahead of the call, count
    the share of partial tiles in dkdv's, which picks its pipeline depth, the active pairs of
    dkdv's tiles and the Hopper backward's, and for decode shapes the share of live key
    blocks, which picks how the packed launch skips."""
    # Counting reads back to the host, which a CUDA graph capture forbids; left uncounted, the
    # share counts as mostly partial (``backward_schedule.dkdv_stages``), the wide dkdv tile's
    # work as no more than the narrow one's (``backward_schedule.wide_tile_adds_work``), and a
    # captured Hopper backward keeps whole groups (``hopper_backward.captured_split``).
    counting = not graph_capturing(problem.device)
    problem = replace(problem, activity=activity)
    if counting and not problem.interpreted:
        tiles = compared_dkdv_tiles() if wide_tile_possible(problem) else ()
        hopper = tuning.HOPPER_BACKWARD.block_m, tuning.HOPPER_BACKWARD.block_n
        if hopper[0] % activity.sub_rows == 0 and hopper[1] % activity.sub_cols == 0:
            tiles = (*tiles, hopper)
        if tiles:
            activity.count_active_areas(tuple(dict.fromkeys(tiles)))
    dkdv, dq = backward_tiles(problem)
    backward_lists(activity, dkdv, dq)
    if counting:
        activity.count_partial_share(dkdv.block_n, dkdv.block_m, transposed=True)
        if takes_packed(replace(problem, bias_grad=False)):
            activity.count_live_share(packed_tile(problem).block_n,
                                      packed_tile_heads(problem, activity.active.shape[1]))


class BackwardPlan:
    """A Schedule's general backward (routes ``fused`` and ``dq+dkdv``) for one forward plan
    and one gradient signature (grad_out's strides and dtype), worked out once: lists, grids and
    every scalar argument. The forward plan keeps its backward plans, so a repeat backward only
    allocates and launches."""

    def __init__(self, fwd, bwd: BackwardSchedule, grad_out, query, key, value, dq, dk, dv,
                 activity: ActivityMap | None = None):
        self.route = str(bwd.route)  # fused or dq+dkdv, as kernels.record_routes names it
        shape = fwd.shape
        problem = fwd.schedule.problem
        block_d = problem.block_d
        sms = problem.multiprocessors
        launches = bwd.general
        cfg_kv, cfg_q = launches.dkdv, launches.dq
        self.schedule = bwd
        self.device = fwd.device
        self.dbias = bwd.dbias
        # A forward plan with lists per call gives the call's map (``activity``): its tables
        # set the strides here and are not kept; their compactions are.
        self.lists_per_call = fwd.lists_per_call
        activity = fwd.lists_activity(activity)
        kv_lists, q_lists = backward_lists(activity, cfg_kv, cfg_q)
        self.kv_table = self.q_table = self.compactions = None
        if self.lists_per_call:
            map_form = (activity.active.shape, activity.sub_rows, activity.sub_cols)
            self.compactions = (ListCompaction(*map_form, cfg_kv.block_n, cfg_kv.block_m, True),
                                ListCompaction(*map_form, cfg_q.block_m, cfg_q.block_n, False))
        elif kv_lists is not None:
            self.kv_table, self.q_table = kv_lists.table, q_lists.table

        key_blocks = ceil_div(shape.seqlen_k, cfg_kv.block_n)
        rows_grid = (ceil_div(shape.seqlen_q, cfg_q.block_m), shape.batch * shape.heads_q)
        self.splits = launches.dq_key_splits
        dq_programs = rows_grid[0] * rows_grid[1] * self.splits
        batches_per_launch = 1 if launches.dkdv_launch_per_batch else shape.batch
        heads_per_launch = 1 if launches.dkdv_launch_per_head else shape.heads_kv
        pairs = batches_per_launch * heads_per_launch
        self.head_shares = launches.dkdv_head_shares
        self.group_rows = launches.dkdv_group_rows
        group_rows_shape = (shape.batch, shape.heads_q, 1, shape.seqlen_k)

        strides = BackwardStrides(
            q=seq_strides(query), k=seq_strides(key), v=seq_strides(value),
            do=seq_strides(grad_out), out=SeqStrides(*contiguous_strides(fwd.out_shape)[:3]),
            dq=seq_strides(dq), dk=seq_strides(dk), dv=seq_strides(dv))
        plan = self.dbias
        layouts = BackwardLayouts(
            mask=fwd.mask_layout or ABSENT, bias=fwd.bias_layout or ABSENT,
            dbias=plan.target if plan else ABSENT,
            q_lists=block_list_strides(q_lists, shape.batch),
            kv_lists=block_list_strides(kv_lists, shape.batch))
        dbias_mode = (plan.mode if plan else DbiasMode.NONE).code
        # With group rows, dkdv writes a one-row gradient per query head into scratch rows of
        # (B, Hq, 1, Lk) and the last share of each key block sums its group's rows.
        dkdv_layouts, dkdv_dbias_mode = layouts, dbias_mode
        if self.group_rows:
            dkdv_layouts = layouts._replace(
                dbias=broadcast_args(group_rows_shape, group_rows_shape, 1))
            dkdv_dbias_mode = DbiasMode.DKDV_ROWS.code
        sizes = sizes_of(shape)
        scales = (fwd.softmax_scale * LOG2E, fwd.softmax_scale)
        common = dict(HEAD_DIM=shape.head_dim, BLOCK_D=block_d,
                      HAS_MASK=fwd.mask_layout is not None, HAS_BIAS=fwd.bias_layout is not None,
                      BIAS_ROW=fwd.bias_one_row, IS_CAUSAL=fwd.is_causal,
                      **dot_options(fwd.dtype, problem.interpreted))
        # The kernels' EDGE_SLOTS: list entries read from each end to find the interior span.
        kv_edge_slots = edge_slots(cfg_kv.block_n, cfg_kv.block_m)
        q_edge_slots = edge_slots(cfg_q.block_m, cfg_q.block_n)
        self.fused = self.dq = None
        self.dkdv = []
        if bwd.route is BackwardRoute.FUSED:
            dkdv_programs = key_blocks * pairs * self.head_shares
            self.fused = PlannedLaunch(
                attn_bwd_fused_kernel, (dkdv_programs + dq_programs,), FusedPointers,
                (strides, dkdv_layouts, sizes, *scales, dkdv_programs, self.head_shares,
                 rows_grid[0], rows_grid[1], self.splits),
                KV_BLOCK_M=cfg_kv.block_m, KV_BLOCK_N=cfg_kv.block_n,
                Q_BLOCK_M=cfg_q.block_m, Q_BLOCK_N=cfg_q.block_n, DBIAS_MODE=dkdv_dbias_mode,
                KV_EDGE_SLOTS=kv_edge_slots, Q_EDGE_SLOTS=q_edge_slots,
                SPLIT_KEYS=self.splits > 1, SPLIT_HEADS=self.head_shares > 1,
                GROUP_ROWS=self.group_rows,
                num_warps=cfg_kv.num_warps, num_stages=cfg_kv.num_stages, **common,
            )
        else:
            # One dkdv launch, or one per colliding (batch, kv head) slice in a fixed order for
            # a deterministic gradient of a shared bias.
            dkdv_rows = pairs * self.head_shares
            self.dkdv = [
                PlannedLaunch(
                    attn_bwd_dkdv_kernel, (key_blocks * dkdv_rows,), DkdvPointers,
                    (strides, dkdv_layouts, sizes, *scales, batch_start, head_start,
                     heads_per_launch,
                     grid_chunk_rows(dkdv_rows, key_blocks, self.head_shares, fwd.is_causal,
                                     sms),
                     self.head_shares),
                    BLOCK_M=cfg_kv.block_m, BLOCK_N=cfg_kv.block_n, DBIAS_MODE=dkdv_dbias_mode,
                    EDGE_SLOTS=kv_edge_slots, SPLIT_HEADS=self.head_shares > 1,
                    GROUP_ROWS=self.group_rows,
                    num_warps=cfg_kv.num_warps, num_stages=cfg_kv.num_stages, **common,
                )
                for batch_start in range(0, shape.batch, batches_per_launch)
                for head_start in range(0, shape.heads_kv, heads_per_launch)
            ]
            self.dq = PlannedLaunch(
                attn_bwd_dq_kernel, (rows_grid[0] * rows_grid[1], 1, self.splits), DqPointers,
                (strides, layouts, sizes, *scales,
                 grid_chunk_rows(rows_grid[1], rows_grid[0], shape.group_size, fwd.is_causal,
                                 sms)),
                BLOCK_M=cfg_q.block_m, BLOCK_N=cfg_q.block_n, EDGE_SLOTS=q_edge_slots,
                SPLIT_KEYS=self.splits > 1, DBIAS_MODE=dbias_mode,
                num_warps=cfg_q.num_warps, num_stages=cfg_q.num_stages, **common,
            )
        # delta (written by dq, read by dkdv; the fused launch needs none), dq's split-K
        # partials, dk's and dv's head-share partials and the group's bias-gradient rows live
        # within one call; the split programs' counters start at zero and are left at zero.
        dq_part_shape = (self.splits, shape.batch * shape.heads_q, shape.seqlen_q, block_d)
        kv_part_shape = (self.head_shares, shape.batch * shape.heads_kv, shape.seqlen_k, block_d)
        shares = self.head_shares > 1
        split = self.splits > 1
        specs = {"delta": None if self.fused else (fwd.lse_shape, torch.float32),
                 "dq_part": (dq_part_shape, torch.float32) if split else None,
                 "dq_count": ((rows_grid[0] * rows_grid[1],), torch.int32) if split else None,
                 "dk_part": (kv_part_shape, torch.float32) if shares else None,
                 "dv_part": (kv_part_shape, torch.float32) if shares else None,
                 "kv_count": ((key_blocks * pairs,), torch.int32) if shares else None,
                 "dbias_rows": (group_rows_shape, torch.float32) if self.group_rows else None}
        self._scratch_names = [name for name, spec in specs.items() if spec is not None]
        self._scratch = Scratch(fwd.device, *(specs[name] for name in self._scratch_names))

    def run(self, grad_out, query, key, value, out, lse, mask, bias, dq, dk, dv,
            activity: ActivityMap | None = None):
        """Fill ``dq``, ``dk``, ``dv``; return the bias gradient (or None). ``activity``: the
        call's own map, for a forward plan with lists per call (both kernels' lists are
        compacted from it here)."""
        note_route("backward", self.route)
        scratch = dict(zip(self._scratch_names, self._scratch.buffers()))
        # Pointer arguments a launch does not read get any tensor (lse).
        dq_part, dq_count = scratch.get("dq_part", lse), scratch.get("dq_count", lse)
        dk_part, dv_part = scratch.get("dk_part", lse), scratch.get("dv_part", lse)
        kv_count = scratch.get("kv_count", lse)
        mask, bias = operand_pointer(mask, lse), operand_pointer(bias, lse)
        kv_table, q_table = self.kv_table, self.q_table
        if self.lists_per_call:
            activity = call_activity(activity)
            kv_table, q_table = (activity.compacted(c).table for c in self.compactions)
        q_table = lse if q_table is None else q_table
        kv_table = lse if kv_table is None else kv_table
        dbias = self.dbias.allocate(self.device) if self.dbias is not None else lse
        # With group rows, dkdv writes a row per query head and sums each group's into dbias.
        dkdv_dbias = scratch.get("dbias_rows", dbias)
        if self.fused is not None:
            self.fused(query, key, value, out, grad_out, lse, lse, dq, dq_part, dk, dv, dk_part,
                       dv_part, mask, bias, dkdv_dbias, q_table, kv_table, dq_count, kv_count,
                       dbias)
        else:
            delta = scratch["delta"]
            self.dq(query, key, value, out, grad_out, lse, delta, dq, dq_part, mask, bias,
                    dbias, q_table, dq_count)
            for dkdv in self.dkdv:
                dkdv(query, key, value, grad_out, grad_out, lse, delta, dk, dv, dk_part, dv_part,
                     mask, bias, dkdv_dbias, kv_table, kv_count, dbias)
        return self.dbias.finish(dbias) if self.dbias is not None else None


def _triton_fallback(fwd, problem, grad_out, query, key, value, dq, dk, dv, activity):
    """A maker of the Triton backward that the schedule picks for ``problem`` (the backward's:
    its gradient signature) without a forced route, for the Hopper backward's calls whose
    addresses a descriptor cannot take."""
    def make():
        options = {name: value for name, value in fwd.options.items() if name != "backward"}
        bwd = schedule(problem, options).backward
        plan_class = PackedBackwardPlan if bwd.route is BackwardRoute.PACKED else BackwardPlan
        return plan_class(fwd, bwd, grad_out, query, key, value, dq, dk, dv, activity)
    return make


class _Scheduling:
    """How many ``scheduled_as_captured`` blocks are open, process-wide: autograd runs a CUDA
    backward on a thread of its own, not the caller's, so a thread-local flag set by the
    caller is never seen there (on an H200 the warm-up's captured schedules were never made)."""
    lock = threading.Lock()
    open_blocks = 0


@contextmanager
def scheduled_as_captured():
    """Within this, backwards are scheduled as a CUDA graph capture schedules them
    (``Problem.captured``) and run eagerly, so that their plans and kernels exist before a
    capture needs them (``kernels.warmup(graphs=True)``). It holds for the whole process: a
    backward another thread runs meanwhile takes the captured schedule too (a different plan,
    the same results)."""
    with _Scheduling.lock:
        _Scheduling.open_blocks += 1
    try:
        yield
    finally:
        with _Scheduling.lock:
            _Scheduling.open_blocks -= 1


def attention_backward(fwd, grad_out, query, key, value, out, lse, mask, bias,
                       deterministic: bool, bias_needs_grad: bool,
                       activity: ActivityMap | None = None,
                       document_offsets: tuple | None = None):
    """Launch the backward of a forward run with plan ``fwd`` (a ``forward.ForwardPlan``) on
    these saved tensors. Returns (dq, dk, dv, dbias or None).

    With a mask, both kernels' lists come from the forward's activity map (made fine enough
    for the backward's tiles), never from the mask itself: the plan's, or the forward call's
    own ``activity`` for a plan with lists per call. ``document_offsets``: the forward
    call's (``call_plan.CallPlan.document_offsets``), for a Hopper backward over unprepared
    packed documents.
    """
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    # A backward captured into a CUDA graph may be scheduled by GPU time alone
    # (``tuning.HOPPER_BACKWARD_SPLIT_CAPTURED``): its plan is kept apart from the eager one.
    captured = tuning.HOPPER_BACKWARD_SPLIT_CAPTURED and (
        graph_capturing(query.device) or _Scheduling.open_blocks > 0)
    signature = (grad_out.stride(), grad_out.dtype, bool(deterministic), bool(bias_needs_grad),
                 captured)
    plan = fwd.backward_plans.get(signature)
    if plan is None:
        bwd = fwd.schedule.backward
        problem = fwd.schedule.problem
        if (problem.deterministic, problem.bias_grad, problem.captured) != signature[2:]:
            # The forward was planned for another backward (e.g. a bias whose requires_grad
            # changed between forward and backward, or a captured one): schedule this one.
            problem = replace(problem, deterministic=bool(deterministic),
                              bias_grad=bool(bias_needs_grad), captured=captured)
            bwd = schedule(problem, fwd.options).backward
        if bwd.route is BackwardRoute.HOPPER:
            plan = HopperBackwardPlan(fwd, problem, bwd, _triton_fallback(
                fwd, problem, grad_out, query, key, value, dq, dk, dv, activity))
        else:
            plan_class = (PackedBackwardPlan if bwd.route is BackwardRoute.PACKED
                          else BackwardPlan)
            plan = plan_class(fwd, bwd, grad_out, query, key, value, dq, dk, dv, activity)
        fwd.backward_plans[signature] = plan
    # Only the Hopper backward walks packed documents (its table per call where unprepared)
    documents = (document_offsets,) if isinstance(plan, HopperBackwardPlan) else ()
    dbias = plan.run(grad_out, query, key, value, out, lse, mask, bias, dq, dk, dv, activity,
                     *documents)
    return dq, dk, dv, dbias
