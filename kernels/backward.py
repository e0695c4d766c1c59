"""The backward's host side: tile configs, plans and launches of the backward kernels.

A ``BackwardPlan`` is worked out once per forward plan and gradient signature: the configs,
the active-tile lists (from the forward's activity map, never the mask), the bias-gradient
plan, grids and every scalar argument. A repeat backward only allocates and launches: dq
(it also stores delta) then dkdv, or on a grid of one wave both as one fused launch. Where dq
splits the keys or dkdv its GQA group's heads, the split programs merge their partials within
the launch (``_partials``), so no merge launch follows. A backward whose GQA group has at most
16 query rows (decode) takes one packed launch instead (``backward_packed``), unless its bias
gradient would need more than one writer per element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._blocks import ActivityMap, BlockLists, block_list_strides
from ._checks import AttnShape
from ._dbias import broadcast_args, plan_dbias
from ._launch import (ABSENT_OPERAND, LOG2E, PlannedLaunch, ceil_div, contiguous_strides,
                      dot_options, edge_slots, grid_chunk_rows, is_interpreted, key_splits,
                      multiprocessors, operand_pointer, padded_head_dim, strides3)
from ._scratch import Scratch, graph_capturing
from .backward_dkdv_kernels import attn_bwd_dkdv_kernel
from .backward_kernels import attn_bwd_dq_kernel, attn_bwd_fused_kernel
from .backward_packed import PackedBackwardPlan, count_live_blocks, packed_route


# dkdv's usual key block at 64 < D <= 128; the grid it gives decides ``small_grid``.
DKDV_BLOCK_N = 64


@dataclass(frozen=True)
class BackwardConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def backward_configs(block_d: int, dtype: torch.dtype, interpreted: bool, seqlen_q: int,
                     small_grid: bool = False) -> tuple[BackwardConfig, BackwardConfig]:
    """(dkdv, dq) tiles per head dim, from sweeps on an H100 (notes in results/notes.md).

    dkdv keeps a key block resident and walks query blocks; dq the reverse. ``small_grid``:
    dkdv with ``DKDV_BLOCK_N``-key blocks would have at most a quarter as many programs as the
    GPU has multiprocessors.
    """
    if interpreted:
        # Unequal tiles, so that the causal split logic is exercised with BLOCK_M != BLOCK_N.
        return BackwardConfig(16, 32, 4, 1), BackwardConfig(32, 16, 4, 1)
    if dtype == torch.float32:
        # fp32 tiles take twice the shared memory; fp32 is for accuracy checks, not speed.
        return BackwardConfig(32, 32, 4, 1), BackwardConfig(32, 32, 4, 1)
    if block_d <= 64:
        return BackwardConfig(64, 64, 4, 3), BackwardConfig(64, 64, 4, 3)
    if block_d <= 128:
        # dkdv: 64-key blocks give twice the programs of 128-key ones, which decides the
        # backward when B * Hk is small (B1 H8/2 L2048: 32 programs on 132 SMs), and 32 query
        # rows a shorter critical path; 32x64 with 4 warps beat 64x128 with 8 warps on every
        # probed case (change 17 in results/notes.md). Decode-sized Lq wastes less in 16 rows.
        # On a grid of a few programs (seqlen L256: 16) each program's walk over the query
        # blocks is the whole kernel, and 16-key blocks, 4x the programs, took it from 53 to
        # 32 us; at 64 programs (L1024) they gain under 10%, at 256 they lose (change 22).
        if seqlen_q <= 16:
            dkdv = BackwardConfig(16, DKDV_BLOCK_N, 4, 3)
        else:
            dkdv = BackwardConfig(32, 16 if small_grid else DKDV_BLOCK_N, 4, 3)
        return dkdv, BackwardConfig(64, 32, 4, 3)
    return BackwardConfig(32, 32, 4, 2), BackwardConfig(64, 16, 4, 2)


def configs_for(shape: AttnShape, dtype: torch.dtype,
                device: torch.device) -> tuple[BackwardConfig, BackwardConfig]:
    """(dkdv, dq) configs for a problem of this shape and dtype on ``device``."""
    interpreted = is_interpreted(attn_bwd_dq_kernel)
    key_programs = shape.batch * shape.heads_kv * ceil_div(shape.seqlen_k, DKDV_BLOCK_N)
    small_grid = 4 * key_programs <= multiprocessors(device, interpreted)
    return backward_configs(padded_head_dim(shape.head_dim), dtype, interpreted,
                            shape.seqlen_q, small_grid)


def backward_tiles(shape: AttnShape, dtype: torch.dtype, device: torch.device) -> tuple:
    """The (query rows, key cols) tiles whose active-tile lists the backward walks: the forward
    builds its activity map fine enough for these too."""
    cfg_kv, cfg_q = configs_for(shape, dtype, device)
    return (cfg_kv.block_m, cfg_kv.block_n), (cfg_q.block_m, cfg_q.block_n)


def backward_lists(activity: ActivityMap | None, cfg_kv: BackwardConfig,
                   cfg_q: BackwardConfig) -> tuple[BlockLists | None, BlockLists | None]:
    """(dkdv lists, keys on rows; dq lists) from the activity map, or (None, None) without one."""
    if activity is None:
        return None, None
    return (activity.lists(cfg_kv.block_n, cfg_kv.block_m, transposed=True),
            activity.lists(cfg_q.block_m, cfg_q.block_n, transposed=False))


def prepare_backward_lists(activity: ActivityMap, shape: AttnShape, dtype: torch.dtype,
                           device: torch.device) -> None:
    """Build (and keep in ``activity``) both backward kernels' lists ahead of the call, count
    the share of partial tiles in dkdv's, which picks its pipeline depth, and for decode
    shapes the share of live key blocks, which picks how the packed launch skips."""
    cfg_kv, cfg_q = configs_for(shape, dtype, device)
    backward_lists(activity, cfg_kv, cfg_q)
    # Counting reads back to the host, which a CUDA graph capture forbids; left uncounted, the
    # share counts as mostly partial (``dkdv_stages``).
    if not graph_capturing(device):
        activity.count_partial_share(cfg_kv.block_n, cfg_kv.block_m, transposed=True)
        count_live_blocks(activity, shape, dtype)


# dkdv's pipeline stages at 64 < D <= 128 in 16-bit where most of its tiles are partial: each
# such tile loads a mask tile beside q and dO, and there 2 stages beat 3 by 5-14% (topk masks:
# D 80, 96, 128 at L4096, gqa B2 H16/4 L4096, seqlen L16384), where on full tiles 3 stayed
# ahead (gqa H32/8 L8192 block_topk by 6%, no mask at L8192 by 4%; results/notes.md,
# change 28). A mask read within the call has no count: it gets 2, as a dynamic (topk) mask's
# tiles are mostly partial.
PARTIAL_TILES_DKDV_STAGES = 2


def dkdv_stages(cfg_kv: BackwardConfig, block_d: int, dtype: torch.dtype,
                activity: ActivityMap | None) -> int:
    """Pipeline stages of the (unfused) dkdv launch."""
    if activity is None or dtype == torch.float32 or not 64 < block_d <= 128:
        return cfg_kv.num_stages
    share = activity.partial_share(cfg_kv.block_n, cfg_kv.block_m, transposed=True)
    if share is not None and share <= 0.5:
        return cfg_kv.num_stages
    return min(cfg_kv.num_stages, PARTIAL_TILES_DKDV_STAGES)


def dq_key_splits(shape: AttnShape, cfg_q: BackwardConfig, device: torch.device) -> int:
    """How many key shares the dq kernel splits into (1: none), as the forward's split-K.

    A share gets at least 8 key blocks: dq's 32-key blocks are half the forward's 64, and a
    share of fewer than ~256 keys saves less GPU time than its partials and their merge cost
    (seqlen L256: 8 blocks, so no split; results/notes.md, change 21; the merge was a launch
    of its own then, and is folded into the dq programs since change 30).
    """
    programs = ceil_div(shape.seqlen_q, cfg_q.block_m) * shape.batch * shape.heads_q
    return key_splits(programs, ceil_div(shape.seqlen_k, cfg_q.block_n),
                      multiprocessors(device, is_interpreted(attn_bwd_dq_kernel)), min_blocks=8)


# The dq and dkdv programs run as one launch when together they fill at most this many waves
# of the GPU's multiprocessors. There one launch less of host time, and dq running beside
# dkdv, outweigh what the fused kernel costs on the GPU (dkdv rebuilds delta from the output
# tile, and each program is sized for the larger of the two kinds): at seqlen L256 (128
# programs on 132 SMs) the backward took 224 instead of 264 us; from two waves up the fused
# kernel lost, 211 vs 174 us at L1024 (320 programs) and 1504 vs 1316 at L4096
# (results/notes.md, change 23).
FUSE_MAX_WAVES = 1


def fuse_backward(cfg_kv: BackwardConfig, cfg_q: BackwardConfig, programs: int,
                  device: torch.device) -> bool:
    """Whether a backward of ``programs`` dq and dkdv programs in total runs as one launch
    (its two configs must agree on warps and stages, which are per launch)."""
    if (cfg_kv.num_warps, cfg_kv.num_stages) != (cfg_q.num_warps, cfg_q.num_stages):
        return False
    interpreted = is_interpreted(attn_bwd_fused_kernel)
    return programs <= FUSE_MAX_WAVES * multiprocessors(device, interpreted)


# dkdv's grid is (key blocks) x (batch, kv head) pairs, and each program walks its GQA group's
# query heads one after another. Where that grid is short of the GPU (B1 H8/2 L2048: 64
# programs on 132 multiprocessors), the group's heads are split into shares, one program per
# share, up to this many waves of programs; each share writes fp32 partials of dk and dv and
# the last share of each key block sums them (results/notes.md, changes 26 and 30).
DKDV_SHARE_WAVES = 2


def dkdv_head_shares(shape: AttnShape, programs: int, device: torch.device) -> int:
    """Into how many shares of its GQA group's query heads dkdv's grid of ``programs`` (batch,
    kv head, key block) programs splits (1: none): the most that divide the group evenly and
    keep the grid within ``DKDV_SHARE_WAVES`` waves of the GPU."""
    limit = DKDV_SHARE_WAVES * multiprocessors(device, is_interpreted(attn_bwd_dkdv_kernel))
    return max(d for d in range(1, shape.group_size + 1)
               if shape.group_size % d == 0 and (d == 1 or programs * d <= limit))


def dbias_flags(plan) -> dict:
    """The dkdv body's bias-gradient constexprs for a ``DbiasPlan`` (or None: no gradient)."""
    return dict(HAS_DBIAS=plan is not None and not plan.is_zero and not plan.in_dq,
                DBIAS_REDUCE_M=bool(plan and plan.reduce_m),
                DBIAS_SUM_GROUP=bool(plan and plan.sum_group),
                DBIAS_ACCUMULATE=bool(plan and plan.accumulate and not plan.in_dq))


def dq_dbias_flags(plan) -> dict:
    """The dq body's: whether it writes the bias gradient's tiles, and whether atomically."""
    return dict(DQ_DBIAS=bool(plan and plan.in_dq), DBIAS_ATOMIC=bool(plan and plan.atomic))


class BackwardPlan:
    """The backward's launches for one forward plan and one gradient signature (grad_out's
    strides and dtype, ``deterministic``, whether the bias needs a gradient), worked out once:
    configs, lists, the bias-gradient plan, grids and every scalar argument. The forward plan
    keeps its backward plans, so a repeat backward only allocates and launches."""

    def __init__(self, fwd, grad_out, query, key, value, dq, dk, dv, deterministic: bool,
                 bias_needs_grad: bool):
        shape = fwd.shape
        block_d = padded_head_dim(shape.head_dim)
        interpreted = is_interpreted(attn_bwd_dq_kernel)
        cfg_kv, cfg_q = configs_for(shape, fwd.dtype, fwd.device)
        self.device = fwd.device
        self.dbias = None
        if bias_needs_grad:
            self.dbias = plan_dbias(fwd.bias_shape, fwd.bias.head_div, shape, fwd.dtype,
                                    deterministic, interpreted)
        kv_lists, q_lists = backward_lists(fwd.activity, cfg_kv, cfg_q)
        self.kv_table = kv_lists.table if kv_lists is not None else None
        self.q_table = q_lists.table if q_lists is not None else None

        # Grid sizes decide the launch plan: fused, or dq then dkdv; either way dkdv splits
        # its group's heads into shares when its grid is small.
        sms = multiprocessors(fwd.device, interpreted)
        key_blocks = ceil_div(shape.seqlen_k, cfg_kv.block_n)
        rows_grid = (ceil_div(shape.seqlen_q, cfg_q.block_m), shape.batch * shape.heads_q)
        self.splits = dq_key_splits(shape, cfg_q, fwd.device)
        dq_programs = rows_grid[0] * rows_grid[1] * self.splits
        serialize_batch = bool(self.dbias and self.dbias.serialize_batch)
        serialize_heads = bool(self.dbias and self.dbias.serialize_heads)
        batches_per_launch = 1 if serialize_batch else shape.batch
        heads_per_launch = 1 if serialize_heads else shape.heads_kv
        pairs = batches_per_launch * heads_per_launch
        fused = (not (serialize_batch or serialize_heads)
                 and fuse_backward(cfg_kv, cfg_q, key_blocks * pairs + dq_programs, fwd.device))
        # A program may only own part of the group when nothing it writes needs the whole group:
        # dkdv's own full-size dbias tiles (deterministic, several contributors) do.
        splittable = not (self.dbias and self.dbias.dkdv_tiles)
        self.head_shares = (dkdv_head_shares(shape, key_blocks * pairs, fwd.device)
                            if splittable else 1)
        # A one-row gradient summed over the group: with shares, rows per query head go to
        # scratch and each key block's last share sums them into the plan's buffer.
        self.group_rows = self.head_shares > 1 and bool(self.dbias and self.dbias.sum_group)
        group_rows_shape = (shape.batch, shape.heads_q, 1, shape.seqlen_k)

        operands = ((fwd.mask or ABSENT_OPERAND).as_args()
                    + (fwd.bias or ABSENT_OPERAND).as_args())
        inputs = (*strides3(query), *strides3(key), *strides3(value), *strides3(grad_out))
        sizes = (shape.heads_q, shape.group_size, shape.seqlen_q, shape.seqlen_k,
                 fwd.softmax_scale * LOG2E, fwd.softmax_scale)
        common = dict(HEAD_DIM=shape.head_dim, BLOCK_D=block_d,
                      HAS_MASK=fwd.mask is not None, HAS_BIAS=fwd.bias is not None,
                      BIAS_ROW=fwd.bias_one_row, IS_CAUSAL=fwd.is_causal,
                      **dot_options(fwd.dtype, interpreted))

        plan = self.dbias
        dbias_target = (plan.target if plan else ABSENT_OPERAND).as_args()
        dbias_consts = dbias_flags(plan)
        dkdv_dbias_target, dkdv_dbias_consts = dbias_target, dbias_consts
        if self.group_rows:
            dkdv_dbias_target = broadcast_args(group_rows_shape, group_rows_shape, 1).as_args()
            dkdv_dbias_consts = dict(dbias_consts, DBIAS_SUM_GROUP=False)
        dq_dbias_consts = dq_dbias_flags(plan)
        kv_list_strides = block_list_strides(kv_lists, shape.batch)
        q_list_strides = block_list_strides(q_lists, shape.batch)
        out_strides = contiguous_strides(fwd.out_shape)[:3]
        kv_edge_slots = edge_slots(cfg_kv.block_n, cfg_kv.block_m)
        q_edge_slots = edge_slots(cfg_q.block_m, cfg_q.block_n)
        # One launch, or one per colliding (batch, kv head) slice in a fixed order for a
        # deterministic gradient of a shared bias.
        dkdv_rows = pairs * self.head_shares
        self.dkdv = [
            PlannedLaunch(
                attn_bwd_dkdv_kernel, (key_blocks * dkdv_rows,),
                (*operands, *dkdv_dbias_target, *kv_list_strides, *inputs,
                 *strides3(dk), *strides3(dv), *sizes,
                 batch_start, head_start, heads_per_launch,
                 grid_chunk_rows(dkdv_rows, key_blocks, self.head_shares, fwd.is_causal, sms),
                 self.head_shares),
                BLOCK_M=cfg_kv.block_m, BLOCK_N=cfg_kv.block_n,
                **dkdv_dbias_consts, EDGE_SLOTS=kv_edge_slots,
                SPLIT_HEADS=self.head_shares > 1, GROUP_ROWS=self.group_rows,
                num_warps=cfg_kv.num_warps,
                num_stages=dkdv_stages(cfg_kv, block_d, fwd.dtype, fwd.activity), **common,
            )
            for batch_start in (range(shape.batch) if serialize_batch else (0,))
            for head_start in (range(shape.heads_kv) if serialize_heads else (0,))
        ]

        dq_part_shape = (self.splits, shape.batch * shape.heads_q, shape.seqlen_q, block_d)
        self.dq = PlannedLaunch(
            attn_bwd_dq_kernel, (rows_grid[0] * rows_grid[1], 1, self.splits),
            (*operands, *dbias_target, *q_list_strides, *inputs, *out_strides, *strides3(dq),
             *sizes,
             grid_chunk_rows(rows_grid[1], rows_grid[0], shape.group_size, fwd.is_causal,
                             sms)),
            BLOCK_M=cfg_q.block_m, BLOCK_N=cfg_q.block_n,
            EDGE_SLOTS=q_edge_slots, SPLIT_KEYS=self.splits > 1, **dq_dbias_consts,
            num_warps=cfg_q.num_warps, num_stages=cfg_q.num_stages, **common,
        )
        self.fused = None
        if fused:
            # A one-row bias gradient (the only kind with group rows) is dkdv's alone, so the
            # launch's dbias arguments are dkdv's.
            dkdv_programs = key_blocks * pairs * self.head_shares
            self.fused = PlannedLaunch(
                attn_bwd_fused_kernel, (dkdv_programs + dq_programs,),
                (*operands, *dkdv_dbias_target, *q_list_strides, *kv_list_strides, *inputs,
                 *out_strides, *strides3(dq), *strides3(dk), *strides3(dv),
                 # ``sizes`` with heads_kv after heads_q: the fused kernel lays dkdv's pairs
                 # out itself, where the dkdv launch is given them per launch.
                 shape.heads_q, shape.heads_kv, *sizes[1:],
                 dkdv_programs, self.head_shares, rows_grid[0], rows_grid[1], self.splits),
                KV_BLOCK_M=cfg_kv.block_m, KV_BLOCK_N=cfg_kv.block_n,
                Q_BLOCK_M=cfg_q.block_m, Q_BLOCK_N=cfg_q.block_n,
                **dkdv_dbias_consts, **dq_dbias_consts,
                KV_EDGE_SLOTS=kv_edge_slots, Q_EDGE_SLOTS=q_edge_slots,
                SPLIT_KEYS=self.splits > 1, SPLIT_HEADS=self.head_shares > 1,
                GROUP_ROWS=self.group_rows,
                num_warps=cfg_kv.num_warps, num_stages=cfg_kv.num_stages, **common,
            )
        # delta (written by dq, read by dkdv; the fused launch needs none), dq's split-K
        # partials, dk's and dv's head-share partials and the group's bias-gradient rows live
        # within one call; the split programs' counters start at zero and are left at zero.
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

    def run(self, grad_out, query, key, value, out, lse, mask, bias, dq, dk, dv):
        """Fill ``dq``, ``dk``, ``dv``; return the bias gradient (or None)."""
        scratch = dict(zip(self._scratch_names, self._scratch.buffers()))
        # Pointer arguments a launch does not read get any tensor (lse).
        dq_part, dq_count = scratch.get("dq_part", lse), scratch.get("dq_count", lse)
        dk_part, dv_part = scratch.get("dk_part", lse), scratch.get("dv_part", lse)
        kv_count = scratch.get("kv_count", lse)
        mask, bias = operand_pointer(mask, lse), operand_pointer(bias, lse)
        q_table = lse if self.q_table is None else self.q_table
        kv_table = lse if self.kv_table is None else self.kv_table
        dbias = self.dbias.allocate(self.device) if self.dbias is not None else lse
        # With group rows, dkdv writes a row per query head and sums each group's into dbias.
        dkdv_dbias = scratch.get("dbias_rows", dbias)
        if self.fused is not None:
            self.fused(query, key, value, out, grad_out, lse, dq, dq_part, dk, dv, dk_part,
                       dv_part, mask, bias, dkdv_dbias, q_table, kv_table, dq_count, kv_count,
                       dbias)
        else:
            delta = scratch["delta"]
            self.dq(query, key, value, out, grad_out, lse, delta, dq, dq_part, mask, bias,
                    dbias, q_table, dq_count)
            for dkdv in self.dkdv:
                dkdv(query, key, value, grad_out, lse, delta, dk, dv, dk_part, dv_part, mask,
                     bias, dkdv_dbias, kv_table, kv_count, dbias)
        return self.dbias.finish(dbias) if self.dbias is not None else None


def attention_backward(fwd, grad_out, query, key, value, out, lse, mask, bias,
                       deterministic: bool, bias_needs_grad: bool):
    """Launch the backward of a forward run with plan ``fwd`` (a ``forward.ForwardPlan``) on
    these saved tensors. Returns (dq, dk, dv, dbias or None).

    With a mask, both kernels' lists come from the forward's activity map (made fine enough
    for ``backward_tiles``), never from the mask itself.
    """
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    signature = (grad_out.stride(), grad_out.dtype, bool(deterministic), bool(bias_needs_grad))
    plan = fwd.backward_plans.get(signature)
    if plan is None:
        packs, packed_dbias = packed_route(fwd, bias_needs_grad)
        if packs:
            plan = PackedBackwardPlan(fwd, grad_out, query, key, value, dq, dk, dv, packed_dbias)
        else:
            plan = BackwardPlan(fwd, grad_out, query, key, value, dq, dk, dv, deterministic,
                                bias_needs_grad)
        fwd.backward_plans[signature] = plan
    dbias = plan.run(grad_out, query, key, value, out, lse, mask, bias, dq, dk, dv)
    return dq, dk, dv, dbias
