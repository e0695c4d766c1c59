"""What runs for one attention problem, decided in one place.

``Problem`` describes a call: sizes, dtype, device, the mask's and bias's layouts, causality,
scale, what the backward must produce and the mask's counted activity. ``schedule(problem,
options)`` is a pure function of it. Its ``Schedule`` names every decision: the forward's tile,
GQA packing and key splits; the backward's route (one fused launch, dq then dkdv, or the packed
decode launch), each launch's tile and stages, dq's key splits, dkdv's head shares, and the bias
gradient's mode. The launchers (``forward.ForwardPlan``, ``backward.BackwardPlan``,
``backward_packed.PackedBackwardPlan``) only carry a Schedule out. ``str(schedule)`` prints it.

``options`` (``kernel_options`` of ``dmattn_func``) forces a decision; see ``OPTION_NAMES``.
The tuned constants are in ``kernels.tuning``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum

import torch

from . import tuning
from ._checks import AttnShape, CheckedInputs
from ._dbias import DbiasMode, DbiasPlan, plan_dbias, plan_packed_dbias
from ._launch import ceil_div, next_power_of_2, padded_head_dim


@dataclass(frozen=True)
class OperandLayout:
    """A mask's or bias's broadcast layout: its own 4-D shape, and the divisor that maps a query
    head to its head (query head h reads head h // head_div)."""

    shape: tuple[int, int, int, int]
    head_div: int

    @property
    def one_row(self) -> bool:
        """Broadcast over queries (flash-dmattn's (B, Hk, 1, Lk) bias)."""
        return self.shape[2] == 1

    def shared_by(self, heads: int) -> bool:
        """Every one of ``heads`` consecutive query heads (a GQA group or part) reads one head."""
        return self.head_div % heads == 0


@dataclass(frozen=True)
class Problem:
    """One call, as far as the schedule depends on it. ``activity`` is the mask's activity map
    (``_blocks.ActivityMap``); only the shares it has counted are read."""

    shape: AttnShape
    dtype: torch.dtype
    device: torch.device
    interpreted: bool
    multiprocessors: int
    is_causal: bool
    softmax_scale: float
    mask: OperandLayout | None = None
    bias: OperandLayout | None = None
    deterministic: bool = False
    bias_grad: bool = False
    activity: object = field(default=None, compare=False, repr=False)
    # The mask is ``KeyIntervals`` that this call reads itself (not prepared), whose start and
    # end share one dtype and layout, so that the forward can read them as given.
    interval_pair: bool = False
    # No backward follows this call's forward (no gradient is wanted).
    forward_only: bool = False
    # The mask is ``KeyIntervals``: prepared, read by the call, or varlen's documents.
    intervals: bool = False

    @property
    def block_d(self) -> int:
        return padded_head_dim(self.shape.head_dim)


def problem_of(checked: CheckedInputs, dtype: torch.dtype, device: torch.device,
               interpreted: bool, multiprocessors: int, is_causal: bool,
               deterministic: bool = False, bias_grad: bool = False,
               activity=None, intervals_per_call: bool = False,
               forward_only: bool = False) -> Problem:
    """The Problem of checked inputs. ``intervals_per_call``: the mask is ``KeyIntervals`` that
    the call reads itself (not prepared); ``forward_only``: no backward follows."""
    def layout(op):
        return None if op is None else OperandLayout(tuple(op.original_shape), op.head_div)

    pair = (intervals_per_call and checked.mask is not None
            and checked.mask.interval_pair is not None)
    intervals = checked.mask is not None and checked.mask.interval_pairs is not None
    return Problem(checked.shape, dtype, device, interpreted, multiprocessors, bool(is_causal),
                   checked.softmax_scale, layout(checked.mask), layout(checked.bias),
                   bool(deterministic), bool(bias_grad), activity, pair, bool(forward_only),
                   intervals)


class BackwardRoute(str, Enum):
    """How the backward runs."""

    SEPARATE = "dq+dkdv"  # a dq launch (which stores delta), then dkdv launch(es)
    FUSED = "fused"  # dq and dkdv programs in one launch (each rebuilds delta)
    PACKED = "packed"  # decode: one launch owns key blocks of whole GQA groups, K and V read once

    def __str__(self) -> str:
        return self.value


# -- forward

@dataclass(frozen=True)
class ForwardSchedule:
    """The forward launch. A tile has ``block_m`` rows: ``group_pack`` query heads of a GQA
    group times ``query_rows`` query positions (``group_pack`` 1: one head's rows)."""

    tile: tuning.Tile
    block_m: int
    group_pack: int
    key_splits: int
    chunk_rows: int
    edge_slots: int
    bias_row: bool
    # The program reads the caller's interval tensors and finds its own range of key blocks
    # (``_score.interval_block_range``): no activity map and no list, each pair tested.
    scan_keys: bool = False

    @property
    def query_rows(self) -> int:
        return self.block_m // self.group_pack

    @property
    def list_tile(self) -> tuple[int, int]:
        """(query rows, key cols) of the tiles whose active-tile lists the forward walks."""
        return self.query_rows, self.tile.block_n


def forward_tile(problem: Problem) -> tuning.Tile:
    block_d = problem.block_d
    if problem.interpreted:
        return tuning.FORWARD_INTERPRETED
    if problem.dtype == torch.float32:
        return tuning.FORWARD_FP32 if block_d <= 128 else tuning.FORWARD_FP32_WIDE
    if block_d <= 64:
        return tuning.FORWARD_D64
    if block_d <= 128:
        if problem.mask is None:
            return tuning.FORWARD_D128
        if interval_tile_possible(problem) and problem.bias is None:
            return tuning.FORWARD_D128_INTERVALS
        return tuning.FORWARD_D128_MASKED
    return tuning.FORWARD_D256


def interval_tile_possible(problem: Problem) -> bool:
    """Whether the forward's tile follows the bias (``tuning.FORWARD_D128_INTERVALS`` without
    one): KeyIntervals in 16-bit on the GPU at head dim 128, with at least that tile's rows of
    queries. A prepared mask's map is made before a call's bias is known, so it serves both."""
    return (problem.intervals and not problem.interpreted
            and problem.dtype in (torch.float16, torch.bfloat16)
            and problem.shape.head_dim == 128
            and problem.shape.seqlen_q >= tuning.FORWARD_D128_INTERVALS.block_m)


def group_pack(problem: Problem, block_m: int) -> int:
    """How many query heads of a GQA group share one forward tile (1 = no packing).

    Packing reads K, V and a group-shared mask once per group instead of once per head. It is
    used where that traffic dominates: with a mask (a (B, Hk, Lq, Lk) topk mask is read Hq/Hk
    times otherwise) and for decode-sized Lq, where one head's rows fill a tile poorly. The
    group must be a power of two that fits a tile, and the mask must be shared by it.
    """
    group = problem.shape.group_size
    if group == 1 or group & (group - 1) or group > block_m:
        return 1
    if problem.mask is not None and not problem.mask.shared_by(group):
        return 1
    if problem.mask is None and problem.shape.seqlen_q >= block_m:
        return 1
    return group


def key_splits(programs: int, key_blocks: int, multiprocessors: int, min_blocks: int) -> int:
    """Key shares for a grid of ``programs`` (1: none): only where it fills less than half the
    GPU, about ``SPLIT_PROGRAMS_PER_SM`` programs per multiprocessor, at least ``min_blocks``
    key blocks a share."""
    if 2 * programs > multiprocessors:
        return 1
    return max(1, min(ceil_div(tuning.SPLIT_PROGRAMS_PER_SM * multiprocessors, programs),
                      key_blocks // min_blocks, tuning.MAX_KEY_SPLITS))


def grid_chunk_rows(rows: int, blocks: int, group: int, uneven: bool,
                    multiprocessors: int) -> int:
    """Rows per chunk of a ``_score.grid_position`` grid: ``rows`` rows of ``blocks`` programs
    each, consecutive runs of ``group`` rows sharing K and V (a GQA group).

    With even work per program, one row per chunk: the programs running together then belong
    to one or two heads and share their K and V in L2. With uneven work (causal), a chunk
    starts its longest programs first and ends on its shortest, which keeps the grid's last
    wave short, but only if the chunk holds enough programs to fill the GPU several times
    over; more rows than that only spread the programs running together over more heads.
    """
    if not uneven:
        return 1
    # The fewest whole groups that divide the rows into equal chunks and fill the GPU: a
    # narrower last chunk would end the grid on its own longest programs.
    for size in range(group, rows, group):
        if rows % size == 0 and size * blocks >= tuning.CHUNK_PROGRAMS_PER_SM * multiprocessors:
            return size
    return rows


def edge_slots(loop_rows: int, step_rows: int) -> int:
    """List entries read from each end by ``_score.interior_span``: a loop over
    ``step_rows``-sized blocks crosses the causal diagonal of a ``loop_rows``-sized block in at
    most ceil(loop_rows / step_rows) + 1 blocks; a partial last block is one of those or one
    more."""
    return next_power_of_2(ceil_div(loop_rows, step_rows) + 2)


def scan_keys(problem: Problem, options: dict, splits: int = 1) -> bool:
    """Whether the forward finds its key blocks by reading the intervals itself (see
    ``ForwardSchedule.scan_keys``) rather than walking a list compacted from an activity map.

    It can where the call reads unprepared intervals whose start and end share a layout and no
    backward follows (the backward walks lists of the map, so the map is made anyway). It
    pays for short key lengths: the read and the compaction are two launches per call (a
    CUDA-graph replay included), while each program's scan reads every reachable key's
    interval (8 bytes per key for int32) and walks the blocks between its first and last
    visible key, gaps included. ``tuning.FORWARD_SCAN_MAX_KEYS`` is where the lists win (keys
    read per program: with ``splits`` key splits, each share reads its own), and
    ``tuning.FORWARD_SCAN_SKIPS_HEAD_DIMS`` the head dims where they win too."""
    possible = (problem.mask is not None and problem.interval_pair and problem.forward_only)
    forced = options.get("forward_key_scan")
    if forced is None:
        head_dim = problem.shape.head_dim
        return (possible and ceil_div(problem.shape.seqlen_k, splits)
                <= tuning.FORWARD_SCAN_MAX_KEYS
                and not tuning.FORWARD_SCAN_SKIPS_HEAD_DIMS[0] < head_dim
                < tuning.FORWARD_SCAN_SKIPS_HEAD_DIMS[1])
    if forced and not possible:
        raise ValueError("kernel_options['forward_key_scan']: True needs KeyIntervals read by "
                         "the call (not prepared), start and end of one dtype and strides, "
                         "and no gradient wanted")
    return forced


def schedule_forward(problem: Problem, options: dict) -> ForwardSchedule:
    shape, sms = problem.shape, problem.multiprocessors
    tile = forward_tile(problem)
    pack = group_pack(problem, tile.block_m)
    block_m = tile.block_m
    if pack > 1:
        # Decode-sized Lq: just enough rows for the group's heads (tl.dot needs 16).
        block_m = max(16, min(block_m, pack * next_power_of_2(shape.seqlen_q)))
    query_rows = block_m // pack
    row_blocks = ceil_div(shape.seqlen_q, query_rows)
    rows = shape.batch * shape.heads_q // pack
    splits = options.get("forward_key_splits") or key_splits(
        row_blocks * rows, ceil_div(shape.seqlen_k, tile.block_n), sms,
        tuning.MIN_BLOCKS_PER_SPLIT)
    bias = problem.bias
    return ForwardSchedule(
        tile=tile, block_m=block_m, group_pack=pack, key_splits=splits,
        chunk_rows=grid_chunk_rows(rows, row_blocks, 1 if pack > 1 else shape.group_size,
                                   problem.is_causal, sms),
        edge_slots=edge_slots(query_rows, tile.block_n),
        bias_row=bias is not None and bias.one_row and bias.shared_by(pack),
        scan_keys=scan_keys(problem, options, splits))


# -- backward

@dataclass(frozen=True)
class BackwardSchedule:
    """The backward's launches. ``dbias`` holds the bias gradient's plan (None: no gradient);
    its ``mode`` is the decision. Route PACKED uses ``packed``; the others ``dkdv`` and ``dq``."""

    route: BackwardRoute
    dbias: DbiasPlan | None
    dkdv: tuning.Tile | None = None
    dq: tuning.Tile | None = None
    dq_key_splits: int = 1
    dkdv_head_shares: int = 1
    # dkdv with head shares writes a one-row gradient per query head to scratch; the last share
    # of each key block sums its group's rows.
    dkdv_group_rows: bool = False
    # A deterministic full-bias gradient with several contributors: one dkdv launch per
    # colliding batch and/or kv head, in a fixed order.
    dkdv_launch_per_batch: bool = False
    dkdv_launch_per_head: bool = False
    packed: tuning.Tile | None = None
    packed_key_splits: int = 1
    packed_skips_dead_blocks: bool = False

    @property
    def dbias_mode(self) -> DbiasMode:
        return self.dbias.mode if self.dbias is not None else DbiasMode.NONE


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


def forward_list_tiles(problem: Problem, forward: ForwardSchedule) -> tuple[tuple[int, int], ...]:
    """The forward's list tile, and where its tile follows the bias (``interval_tile_possible``)
    the list tiles of both choices, first the one ``forward`` took."""
    tiles = [forward.list_tile]
    if interval_tile_possible(problem):
        for tile in (tuning.FORWARD_D128_INTERVALS, tuning.FORWARD_D128_MASKED):
            tiles.append((tile.block_m // group_pack(problem, tile.block_m), tile.block_n))
    return tuple(dict.fromkeys(tiles))


def activity_tiles(problem: Problem, forward: ForwardSchedule) -> tuple[tuple[int, int], ...]:
    """Every (query rows, key cols) tile whose active-tile lists the forward and the general
    backward walk: one activity map of the mask must serve them all, dkdv's tile either way
    ``kernel_options['dkdv_wide_tile']`` may force it and the forward's either way a bias
    picks it (a prepared mask's map is built before any call's options and bias are known)."""
    choices = [{}]
    if wide_tile_possible(problem):
        choices += [{"dkdv_wide_tile": False}, {"dkdv_wide_tile": True}]
    tiles = list(forward_list_tiles(problem, forward))
    for options in choices:
        dkdv, dq = backward_tiles(problem, options)
        tiles += [(dkdv.block_m, dkdv.block_n), (dq.block_m, dq.block_n)]
    return tuple(dict.fromkeys(tiles))


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
    return BackwardSchedule(
        route=BackwardRoute.PACKED,
        dbias=dbias,
        packed=tile,
        packed_key_splits=key_splits(pairs, ceil_div(shape.seqlen_k, tile.block_n),
                                     problem.multiprocessors,
                                     tuning.MIN_BLOCKS_PER_SPLIT),
        packed_skips_dead_blocks=skips_dead_blocks(problem, tile))


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
    return BackwardSchedule(
        route=route, dbias=dbias,
        dkdv=tuning.Tile(dkdv.block_m, dkdv.block_n, dkdv.num_warps, stages), dq=dq,
        dq_key_splits=splits, dkdv_head_shares=shares,
        dkdv_group_rows=shares > 1 and bool(dbias and dbias.sum_group),
        dkdv_launch_per_batch=per_batch, dkdv_launch_per_head=per_head)


def schedule_backward(problem: Problem, options: dict) -> BackwardSchedule:
    route = options.get("backward")
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


# -- the whole schedule, and options

@dataclass(frozen=True)
class Schedule:
    problem: Problem
    forward: ForwardSchedule
    backward: BackwardSchedule

    def __str__(self) -> str:
        s = self.problem.shape
        lines = [f"problem: B{s.batch} Lq{s.seqlen_q} Lk{s.seqlen_k} H{s.heads_q}/{s.heads_kv} "
                 f"D{s.head_dim} {str(self.problem.dtype).replace('torch.', '')}"
                 f"{' causal' if self.problem.is_causal else ''}"
                 f"{' mask' + str(self.problem.mask.shape) if self.problem.mask else ''}"
                 f"{' bias' + str(self.problem.bias.shape) if self.problem.bias else ''}"]
        for part, value in (("forward", self.forward), ("backward", self.backward)):
            shown = [f.name for f in fields(value)]
            if part == "backward":
                general = self.backward.route is not BackwardRoute.PACKED
                shown = [name for name in shown if name.startswith("packed") != general]
            items = []
            for name in shown:
                item = self.backward.dbias_mode if name == "dbias" else getattr(value, name)
                items.append(f"{name}={item}")
            lines.append(f"{part}: " + ", ".join(items))
        return "\n".join(lines)


# kernel_options: name -> what it forces.
OPTION_NAMES = {
    "backward": "the backward route: 'fused', 'dq+dkdv' or 'packed'",
    "forward_key_splits": "the forward's key splits (split-K), an int >= 1",
    "dq_key_splits": "dq's key splits, an int >= 1",
    "dkdv_head_shares": "dkdv's shares of a GQA group's heads, an int dividing the group",
    "forward_key_scan": "whether the forward reads unprepared intervals itself, True or False",
    "dkdv_wide_tile": "whether dkdv takes its 64 x 128 tile (16-bit, 64 < head dim <= 128), "
                      "True or False",
}


def normalize_options(options) -> dict:
    """``kernel_options`` checked, with the route as a BackwardRoute: a ValueError or TypeError
    names the option and what it takes."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(f"kernel_options must be a dict or None, got {type(options).__name__}")
    out = {}
    for name, value in options.items():
        if name not in OPTION_NAMES:
            raise ValueError(f"kernel_options: unknown option {name!r}; known: "
                             + ", ".join(sorted(OPTION_NAMES)))
        if name == "backward":
            try:
                value = BackwardRoute(value)
            except ValueError:
                raise ValueError(f"kernel_options['backward']: expected one of 'fused', "
                                 f"'dq+dkdv', 'packed', got {value!r}") from None
        elif name in ("forward_key_scan", "dkdv_wide_tile"):
            if type(value) is not bool:
                raise ValueError(f"kernel_options[{name!r}]: expected {OPTION_NAMES[name]}, "
                                 f"got {value!r}")
        elif type(value) is not int or value < 1:
            raise ValueError(f"kernel_options[{name!r}]: expected {OPTION_NAMES[name]}, "
                             f"got {value!r}")
        out[name] = value
    return out


def schedule(problem: Problem, options: dict | None = None) -> Schedule:
    """The schedule of ``problem``; ``options`` (already normalized) force decisions."""
    options = options or {}
    return Schedule(problem, schedule_forward(problem, options),
                    schedule_backward(problem, options))
