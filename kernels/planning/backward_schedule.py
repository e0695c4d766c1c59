"""The backward launches of a ``Problem``: the route (one fused launch, dq then dkdv, or the
packed decode launch), each launch's tile and stages, dq's key splits, dkdv's head shares and
the bias gradient's plan. ``kernels.schedule`` combines it with the forward's.

A ``BackwardSchedule`` holds what every route has (the route and the bias gradient's plan) and
the launches of its route: ``GeneralBackward`` (routes ``fused`` and ``dq+dkdv``) or
``PackedBackward`` (route ``packed``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from ..runtime.arith import ceil_div, next_power_of_2
from . import tuning
from .dbias import DbiasMode, DbiasPlan, per_query_head_rows, plan_dbias, plan_packed_dbias
from .grids import key_splits
from .hopper_backward import (captured_split, documents_backward_gap, hopper_backward_gap,
                              ordered_walks, splitting_balances, takes_hopper_backward)
from .problem import Problem


class BackwardRoute(str, Enum):
    """How the backward runs."""

    SEPARATE = "dq+dkdv"  # a dq launch (which stores delta), then dkdv launch(es)
    FUSED = "fused"  # dq and dkdv programs in one launch (each rebuilds delta)
    PACKED = "packed"  # decode: one launch owns key blocks of whole GQA groups, K and V read once
    HOPPER = "hopper"  # Gluon (sm_90a): a program per key block, dQ by TMA reduce-adds

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class GeneralBackward:
    """The launches of routes ``fused`` and ``dq+dkdv``: dkdv's and dq's tiles, dq's key splits
    and dkdv's shares of a GQA group's heads."""

    dkdv: tuning.Tile
    dq: tuning.Tile
    dq_key_splits: int = 1
    dkdv_head_shares: int = 1
    # dkdv with head shares writes a one-row gradient per query head to scratch; the last share
    # of each key block sums its group's rows.
    dkdv_group_rows: bool = False
    # A deterministic full-bias gradient with several contributors: one dkdv launch per
    # colliding batch and/or kv head, in a fixed order.
    dkdv_launch_per_batch: bool = False
    dkdv_launch_per_head: bool = False


@dataclass(frozen=True)
class PackedBackward:
    """The launch of route ``packed``: its tile, its key splits and whether it branches around
    dead key blocks (``skips_dead_blocks``)."""

    tile: tuning.Tile
    key_splits: int = 1
    skips_dead_blocks: bool = False


@dataclass(frozen=True)
class BackwardSchedule:
    """The backward's launches. ``dbias`` holds the bias gradient's plan (None: no gradient);
    its ``mode`` is the decision. ``launches`` are the route's: ``PackedBackward`` for route
    PACKED, ``GeneralBackward`` for the others (also as ``packed`` and ``general``)."""

    route: BackwardRoute
    dbias: DbiasPlan | None
    launches: GeneralBackward | PackedBackward | tuning.HopperBackwardTile
    # The Hopper backward walks a packed batch's documents each in its own key blocks
    # (``hopper_backward.documents_backward_gap``), its mask unread.
    documents: bool = False
    # The Hopper backward stages dQ with its columns spread (``dq_spread``).
    dq_spread: bool = False
    # The Hopper backward's programs walk one query head each (``split_heads``).
    split_heads: bool = False

    def __post_init__(self):
        if (self.route is BackwardRoute.PACKED) != isinstance(self.launches, PackedBackward):
            raise TypeError(f"route {self.route} cannot run {type(self.launches).__name__}")

    @property
    def dbias_mode(self) -> DbiasMode:
        return self.dbias.mode if self.dbias is not None else DbiasMode.NONE

    @property
    def general(self) -> GeneralBackward:
        """The launches of routes ``fused`` and ``dq+dkdv``."""
        if not isinstance(self.launches, GeneralBackward):
            raise TypeError(f"route {self.route} has no general backward launches")
        return self.launches

    @property
    def packed(self) -> PackedBackward:
        """The launch of route ``packed``."""
        if not isinstance(self.launches, PackedBackward):
            raise TypeError(f"route {self.route} has no packed backward launch")
        return self.launches


def wide_tile_possible(problem: Problem) -> bool:
    """Whether dkdv can take its wide tile: 16-bit, 64 < padded head dim <= 128, more than
    decode rows."""
    return (problem.dtype != torch.float32 and 64 < problem.block_d <= 128
            and problem.shape.seqlen_q > tuning.DKDV_DECODE_ROWS)


def compared_dkdv_tiles() -> tuple[tuple[int, int], tuple[int, int]]:
    """(query rows, keys) of dkdv's wide and narrow tiles, whose active pairs a prepared mask
    counts (``ActivityMap.count_active_areas``) for ``wide_tile_adds_work``."""
    wide, narrow = tuning.DKDV_D128_WIDE, tuning.DKDV_D128
    return (wide.block_m, wide.block_n), (narrow.block_m, narrow.block_n)


def wide_tile_adds_work(problem: Problem) -> bool:
    """Whether a prepared mask's counted active tiles (``ActivityMap.count_active_areas``) put
    more than ``tuning.DKDV_WIDE_MAX_EXTRA_WORK`` times the narrow tiles' pairs in the wide
    ones: masks whose activity changes at a finer grain than 128 keys (whole 64-key blocks).
    Uncounted (a mask read within the call, or none): False."""
    activity = problem.activity
    if activity is None:
        return False
    wide, narrow = compared_dkdv_tiles()
    wide_area, narrow_area = activity.active_area(*wide), activity.active_area(*narrow)
    if wide_area is None or narrow_area is None:
        return False
    return wide_area > tuning.DKDV_WIDE_MAX_EXTRA_WORK * narrow_area


def dkdv_takes_wide_tile(problem: Problem, options: dict | None = None) -> bool:
    """Whether dkdv takes ``tuning.DKDV_D128_WIDE`` (64 query rows x 128 keys, 8 warps): 16-bit,
    64 < padded head dim <= 128, more than decode rows, and by default a grid of at least
    ``DKDV_WIDE_MIN_PROGRAMS_PER_SM`` 128-key programs per multiprocessor over at least
    ``DKDV_WIDE_MIN_ROWS`` query rows, unless a prepared mask's active tiles hold much more work
    in the wide tile (``wide_tile_adds_work``). Where the grid is smaller, 64-key programs (twice
    as many) finish sooner. ``kernel_options['dkdv_wide_tile']`` forces the choice."""
    shape = problem.shape
    possible = wide_tile_possible(problem)
    forced = (options or {}).get("dkdv_wide_tile")
    if forced is None:
        if problem.interpreted or not possible:
            return False
        programs = shape.batch * shape.heads_kv * ceil_div(shape.seqlen_k,
                                                           tuning.DKDV_D128_WIDE.block_n)
        return (shape.seqlen_q >= tuning.DKDV_WIDE_MIN_ROWS
                and programs >= tuning.DKDV_WIDE_MIN_PROGRAMS_PER_SM * problem.multiprocessors
                and not wide_tile_adds_work(problem))
    if forced and not possible:
        raise ValueError("kernel_options['dkdv_wide_tile']: True needs a 16-bit dtype, a head "
                         "dim above 64 and at most 128, and more than "
                         f"{tuning.DKDV_DECODE_ROWS} query rows")
    return forced


def backward_tiles(problem: Problem, options: dict | None = None) -> tuple[tuning.Tile,
                                                                           tuning.Tile]:
    """(dkdv, dq) tiles of the general backward; ``options`` may force dkdv's wide tile."""
    shape, block_d = problem.shape, problem.block_d
    wide = dkdv_takes_wide_tile(problem, options)
    if problem.interpreted:
        return (tuning.DKDV_INTERPRETED_WIDE if wide else tuning.DKDV_INTERPRETED,
                tuning.DQ_INTERPRETED)
    if problem.dtype == torch.float32:
        return tuning.BACKWARD_FP32, tuning.BACKWARD_FP32
    if block_d <= 64:
        return tuning.DKDV_D64, tuning.DQ_D64
    if block_d <= 128:
        if wide:
            return tuning.DKDV_D128_WIDE, tuning.DQ_D128
        if shape.seqlen_q <= tuning.DKDV_DECODE_ROWS:
            return tuning.DKDV_D128_DECODE, tuning.DQ_D128
        key_programs = shape.batch * shape.heads_kv * ceil_div(shape.seqlen_k,
                                                               tuning.DKDV_BLOCK_N)
        small_grid = tuning.DKDV_SMALL_GRID_SHARE * key_programs <= problem.multiprocessors
        return (tuning.DKDV_D128_SMALL_GRID if small_grid else tuning.DKDV_D128), tuning.DQ_D128
    return tuning.DKDV_D256, tuning.DQ_D256


def dkdv_stages(problem: Problem, dkdv: tuning.Tile) -> int:
    """Pipeline stages of the (unfused) dkdv launch: fewer where most tiles are partial."""
    if (problem.mask is None or problem.dtype == torch.float32
            or not 64 < problem.block_d <= 128):
        return dkdv.num_stages
    share = None
    if problem.activity is not None:
        share = problem.activity.partial_share(dkdv.block_n, dkdv.block_m, transposed=True)
    if share is not None and share <= tuning.DKDV_PARTIAL_SHARE_FOR_FEWER_STAGES:
        return dkdv.num_stages
    return min(dkdv.num_stages, tuning.DKDV_PARTIAL_TILES_STAGES)


def dkdv_head_shares(problem: Problem, programs: int) -> int:
    """Into how many shares of its GQA group's query heads dkdv's grid of ``programs`` (batch,
    kv head, key block) programs splits (1: none): the most that divide the group evenly and
    keep the grid within ``DKDV_SHARE_WAVES`` waves of the GPU."""
    group = problem.shape.group_size
    limit = tuning.DKDV_SHARE_WAVES * problem.multiprocessors
    return max(d for d in range(1, group + 1)
               if group % d == 0 and (d == 1 or programs * d <= limit))


def packed_tile(problem: Problem) -> tuning.Tile:
    """The packed launch's tile: rows for every query row of a GQA group, and its key block."""
    shape = problem.shape
    if problem.interpreted:
        base = tuning.PACKED_INTERPRETED
    elif problem.dtype == torch.float32 or problem.block_d > 128:
        base = tuning.PACKED_WIDE
    else:
        base = tuning.PACKED_D128
    block_m = max(16, next_power_of_2(shape.seqlen_q * shape.group_size))
    return tuning.Tile(block_m, base.block_n, base.num_warps, base.num_stages)


def packed_tile_heads(problem: Problem, mask_heads: int) -> int:
    """Mask heads within one packed tile: a tile spans the G query heads of one kv head."""
    return problem.shape.group_size if mask_heads == problem.shape.heads_q else 1


def packed_dbias(problem: Problem) -> DbiasPlan | None:
    """The bias gradient's plan for the packed launch, or None where it has no one-writer plan
    (then the general backward runs). Without a wanted gradient: None too; check bias_grad."""
    bias = problem.bias
    if bias.shape[3] == 1:  # key-broadcast: exactly zero, no kernel work
        return plan_dbias(bias.shape, bias.head_div, problem.shape, problem.dtype, False,
                          problem.interpreted)
    return plan_packed_dbias(bias.shape, problem.shape, problem.dtype, problem.interpreted)


def packed_route(problem: Problem) -> tuple[bool, DbiasPlan | None]:
    """(whether the packed launch serves this call, its bias gradient's plan when one is
    wanted), the plan made once. Decode: the packed launch serves a call whose GQA group has at
    most PACKED_MAX_ROWS query rows, unless its bias gradient would need several writers per
    element."""
    shape = problem.shape
    if shape.seqlen_q * shape.group_size > tuning.PACKED_MAX_ROWS:
        return False, None
    if not problem.bias_grad:
        return True, None
    dbias = packed_dbias(problem)
    return dbias is not None, dbias


def takes_packed(problem: Problem) -> bool:
    """Whether the packed launch serves this call (``packed_route``)."""
    return packed_route(problem)[0]


def skips_dead_blocks(problem: Problem, tile: tuning.Tile) -> bool:
    """Whether the packed launch branches around dead key blocks: only for a prepared mask
    counted at most ``PACKED_LIVE_SHARE_FOR_BRANCH`` live (a mask read within the call is not
    counted, since counting stalls the host)."""
    activity = problem.activity
    if activity is None:
        return False
    share = activity.live_share(tile.block_n,
                                packed_tile_heads(problem, activity.active.shape[1]))
    return share is not None and share <= tuning.PACKED_LIVE_SHARE_FOR_BRANCH


def schedule_packed(problem: Problem, dbias: DbiasPlan | None) -> BackwardSchedule:
    """The packed route, with the bias gradient's plan from ``packed_route``."""
    shape = problem.shape
    tile = packed_tile(problem)
    pairs = shape.batch * shape.heads_kv
    return BackwardSchedule(BackwardRoute.PACKED, dbias, PackedBackward(
        tile=tile,
        key_splits=key_splits(pairs, ceil_div(shape.seqlen_k, tile.block_n),
                              problem.multiprocessors, tuning.MIN_BLOCKS_PER_SPLIT),
        skips_dead_blocks=skips_dead_blocks(problem, tile)))


def schedule_general(problem: Problem, options: dict) -> BackwardSchedule:
    shape, sms = problem.shape, problem.multiprocessors
    dkdv, dq = backward_tiles(problem, options)
    dbias = None
    if problem.bias_grad:
        dbias = plan_dbias(problem.bias.shape, problem.bias.head_div, shape, problem.dtype,
                           problem.deterministic, problem.interpreted)
    key_blocks = ceil_div(shape.seqlen_k, dkdv.block_n)
    dq_rows = ceil_div(shape.seqlen_q, dq.block_m) * shape.batch * shape.heads_q
    splits = options.get("dq_key_splits") or key_splits(
        dq_rows, ceil_div(shape.seqlen_k, dq.block_n), sms, tuning.DQ_MIN_BLOCKS_PER_SPLIT)
    per_batch = bool(dbias and dbias.serialize_batch)
    per_head = bool(dbias and dbias.serialize_heads)
    pairs = (1 if per_batch else shape.batch) * (1 if per_head else shape.heads_kv)
    route = options.get("backward")
    if route is None:
        same_launch_options = (dkdv.num_warps, dkdv.num_stages) == (dq.num_warps, dq.num_stages)
        fits = key_blocks * pairs + dq_rows * splits <= tuning.FUSE_MAX_WAVES * sms
        fused = same_launch_options and fits and not (per_batch or per_head)
        route = BackwardRoute.FUSED if fused else BackwardRoute.SEPARATE
    elif route is BackwardRoute.FUSED and (per_batch or per_head):
        raise ValueError("kernel_options['backward']: 'fused' cannot serve a deterministic "
                         "bias gradient with several contributors (its dkdv launches run one "
                         "batch or kv head at a time)")
    # A program may own part of the group only when nothing it writes needs the whole group:
    # dkdv's own full-size dbias tiles (deterministic, several contributors) do.
    whole_group = bool(dbias and dbias.dkdv_tiles)
    shares = options.get("dkdv_head_shares")
    if shares is None:
        shares = 1 if whole_group else dkdv_head_shares(problem, key_blocks * pairs)
    elif shares > 1 and whole_group:
        raise ValueError("kernel_options['dkdv_head_shares']: this bias gradient is summed over "
                         "the whole GQA group in one program; only 1 is possible here")
    elif shape.group_size % shares:
        raise ValueError(f"kernel_options['dkdv_head_shares']: must divide the GQA group of "
                         f"{shape.group_size} query heads, got {shares}")
    stages = dkdv_stages(problem, dkdv) if route is BackwardRoute.SEPARATE else dkdv.num_stages
    return BackwardSchedule(route, dbias, GeneralBackward(
        dkdv=tuning.Tile(dkdv.block_m, dkdv.block_n, dkdv.num_warps, stages), dq=dq,
        dq_key_splits=splits, dkdv_head_shares=shares,
        dkdv_group_rows=shares > 1 and bool(dbias and dbias.sum_group),
        dkdv_launch_per_batch=per_batch, dkdv_launch_per_head=per_head))


def _refuse_other_route(name: str, options: dict) -> None:
    """A ValueError where ``options[name]`` True asks for the Hopper backward's work and
    ``options['backward']`` forces another route."""
    route = options.get("backward")
    if route not in (None, BackwardRoute.HOPPER):
        raise ValueError(f"kernel_options: {name!r} True and 'backward' {route.value!r} "
                         f"conflict (it is the Hopper backward's)")


def backward_documents(problem: Problem, options: dict) -> bool:
    """Whether the Hopper backward walks the mask's packed documents in their own key blocks.
    ``options['backward_documents']`` True forces it (a ValueError says why where it never
    can, or where another route is forced), False keeps it off; by default it does where
    the packed rows fill at least ``tuning.HOPPER_FORWARD_MIN_QUERIES`` and
    ``documents_backward_gap`` finds nothing. H200, varlen.yaml (16k and 64k packed tokens,
    documents of median 256 and 1024 tokens, causal, D128, with and without a kv_row bias,
    GQA 4): 0.69-0.91x the backward time of the Hopper backward over the intervals' lists in
    fifteen rows of sixteen (the sixteenth, 16k tokens of median 256 with the bias, read
    1.0x in the sweep and 0.61x of the kernel's time profiled alone). As for the forward's
    (``forward_schedule.forward_documents``), prepared intervals' plan keeps the key blocks'
    table and a call of unprepared ones makes it from its offsets."""
    asked = options.get("backward_documents")
    if asked is None:
        return (options.get("backward") in (None, BackwardRoute.HOPPER)
                and problem.shape.seqlen_q >= tuning.HOPPER_FORWARD_MIN_QUERIES
                and documents_backward_gap(problem) is None)
    if not asked:
        return False
    _refuse_other_route("backward_documents", options)
    gap = documents_backward_gap(problem)
    if gap is not None:
        raise ValueError(f"kernel_options['backward_documents']: the Hopper backward cannot "
                         f"walk this call's documents: {gap}")
    return True


def dq_spread(problem: Problem, options: dict) -> bool:
    """Whether the Hopper backward, where it runs, stages dQ's partials with their columns
    spread over the shared memory banks (``hopper_device.dq_columns``): by default at head
    dim 128, the only one it spreads; ``options['backward_dq_spread']`` True forces it (a
    ValueError at another head dim, and with another route forced), False keeps it off.
    H200, B2 H16/4 D128 bf16, 8k and 16k tokens, causal and not, one process: the backward
    kernel 0.95-0.96x the time of the unspread staging, the whole backward 0.96-0.99x (its
    cast from the spread columns takes 86 us at 8k where the plain cast took 48)."""
    asked = options.get("backward_dq_spread")
    if asked is None:
        return problem.shape.head_dim == 128
    if not asked:
        return False
    _refuse_other_route("backward_dq_spread", options)
    if problem.shape.head_dim != 128:
        raise ValueError(f"kernel_options['backward_dq_spread']: spreads head dim 128's "
                         f"columns, not {problem.shape.head_dim}'s")
    return True


def split_heads(problem: Problem, options: dict, documents: bool) -> bool:
    """Whether the Hopper backward, where it runs, gives each query head of a GQA group its
    own programs (``tiles.KeyBlockWork``'s SPLIT_HEADS: dK and dV reduce-added into float32
    accumulators, a bias gradient row per query head summed after). A program of a whole
    group walks its key block once per head of the group, so a grid waits on its longest
    walks where they are long against the even share: by default split for ``ordered_walks``
    (``tuning.HOPPER_BACKWARD_SPLIT_ORDERED_HEADS``: their first key blocks walk nearly every
    query block), and where ``tuning.HOPPER_BACKWARD_SPLIT_LONG_WALKS`` is on (off by
    default; a captured call with ``tuning.HOPPER_BACKWARD_SPLIT_CAPTURED``,
    ``hopper_backward.captured_split``) where the dense walks' longest share is too long whole
    and not split (``hopper_backward.splitting_balances``);
    ``options['backward_split_heads']`` True forces it (a ValueError where it cannot: no
    group to split, deterministic gradients, packed documents, or another route forced),
    False keeps it off."""
    asked = options.get("backward_split_heads")
    splittable = (problem.shape.group_size > 1 and not problem.deterministic
                  and not documents)
    if asked is None:
        return splittable and (
            (tuning.HOPPER_BACKWARD_SPLIT_ORDERED_HEADS and ordered_walks(problem))
            or ((tuning.HOPPER_BACKWARD_SPLIT_LONG_WALKS or captured_split(problem))
                and splitting_balances(problem)))
    if not asked:
        return False
    _refuse_other_route("backward_split_heads", options)
    if not splittable:
        raise ValueError("kernel_options['backward_split_heads']: splits a GQA group of more "
                         "than one query head, without deterministic=True or packed "
                         f"documents; this call has a group of {problem.shape.group_size}"
                         f"{', deterministic=True' if problem.deterministic else ''}"
                         f"{', packed documents' if documents else ''}")
    return True


def schedule_backward(problem: Problem, options: dict) -> BackwardSchedule:
    route = options.get("backward")
    spread = dq_spread(problem, options)
    documents = backward_documents(problem, options)
    split = split_heads(problem, options, documents)
    if documents:
        route = BackwardRoute.HOPPER
    elif route is BackwardRoute.HOPPER:
        gap = hopper_backward_gap(problem)
        if gap is not None:
            raise ValueError(f"kernel_options['backward']: 'hopper' does not cover this call: "
                             f"{gap}")
    elif route is None and takes_hopper_backward(problem, split):
        route = BackwardRoute.HOPPER
    if route is BackwardRoute.HOPPER:
        dbias = None
        if problem.bias_grad:  # one row per (batch, head): rows summed in the program
            dbias = plan_dbias(problem.bias.shape, problem.bias.head_div, problem.shape,
                               problem.dtype, problem.deterministic, problem.interpreted)
            if split and dbias.sum_group:  # each program sees one head of the group
                dbias = per_query_head_rows(dbias, problem.shape)
        return BackwardSchedule(BackwardRoute.HOPPER, dbias, tuning.HOPPER_BACKWARD,
                                documents, spread, split)
    if route in (None, BackwardRoute.PACKED):
        packs, dbias = packed_route(problem)
        if packs:
            return schedule_packed(problem, dbias)
        if route is BackwardRoute.PACKED:
            raise ValueError(
                "kernel_options['backward']: 'packed' serves at most "
                f"{tuning.PACKED_MAX_ROWS} query rows per GQA group (seqlen_q x heads_q / "
                "heads_kv) and a bias gradient with one writer per element; this call has "
                f"{problem.shape.seqlen_q * problem.shape.group_size} rows")
    return schedule_general(problem, options)
