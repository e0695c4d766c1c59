"""The forward launch of a ``Problem``: its tile, GQA packing, key splits, grid order, and
whether it reads unprepared intervals itself. ``kernels.schedule`` combines it with the
backward's. The grid rules it shares with the backward's launches are in ``grids``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.arith import ceil_div, next_power_of_2
from . import tuning
from .grids import edge_slots, grid_chunk_rows, key_splits
from .gather_decode import GatherTile, gather_gap, gather_tile
from .hopper_forward import (hopper_gap, list_tile, may_take_masks, takes_documents,
                             takes_hopper, takes_three_consumers, three_consumer_gap,
                             tile_order)
from .problem import Problem


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
    # (``spans.interval_block_range``): no activity map and no list, each pair tested.
    scan_keys: bool = False
    # The Hopper route's tile where the forward takes it (``hopper_forward``), else None. The
    # Triton launch above stays planned: a call whose addresses a TMA descriptor cannot take
    # runs it.
    hopper: tuning.HopperTile | None = None
    # Decode's gather route (``gather_decode``) where the forward takes it, else None: the
    # kept keys' lists, then a forward over them.
    gather: GatherTile | None = None
    # How the Hopper forward deals its tiles (``hopper_forward.tile_order``); None off it.
    tile_order: str | None = None
    # The Hopper forward walks the mask's packed documents each in its own tiles
    # (``hopper_forward.documents_gap``), its mask unread.
    documents: bool = False

    @property
    def route(self) -> str:
        if self.gather is not None:
            return "gather"
        return "triton" if self.hopper is None else "hopper"

    @property
    def reads_mask_itself(self) -> bool:
        """The forward reads the call's mask as given (no activity map, no tile lists)."""
        return self.scan_keys or self.gather is not None

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


def interval_tile_rows(dtype: torch.dtype, head_dim: int, interpreted: bool) -> int | None:
    """The fewest query rows at which a call with KeyIntervals of this dtype and head dim may
    take ``tuning.FORWARD_D128_INTERVALS`` (``interval_tile_possible``), or None where it never
    does: 16-bit on the GPU at head dim 128."""
    if interpreted or dtype not in (torch.float16, torch.bfloat16) or head_dim != 128:
        return None
    return tuning.FORWARD_D128_INTERVALS.block_m


def interval_tile_possible(problem: Problem) -> bool:
    """Whether the forward's tile follows the bias (``tuning.FORWARD_D128_INTERVALS`` without
    one): KeyIntervals in 16-bit on the GPU at head dim 128, with at least that tile's rows of
    queries. A prepared mask's map is made before a call's bias is known, so it serves both."""
    rows = interval_tile_rows(problem.dtype, problem.shape.head_dim, problem.interpreted)
    return problem.intervals and rows is not None and problem.shape.seqlen_q >= rows


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


FORWARD_ROUTES = ("triton", "hopper", "gather")


def forward_documents(problem: Problem, options: dict) -> bool:
    """Whether the Hopper forward walks the mask's packed documents in their own tiles.
    ``options['forward_documents']`` True forces it (a ValueError says why where it never
    can, or where another route is forced), False keeps it off; by default it does where
    ``takes_documents``. Prepared intervals' plan keeps the documents' tile table; a call
    whose intervals are not prepared (the first with these offsets, a torch.compile'd call,
    one in a CUDA graph capture) makes it from its offsets (``ForwardPlan.call_documents``:
    a few torch ops on the device, no read-back)."""
    asked = options.get("forward_documents")
    forced_route = options.get("forward_route")
    if asked is None:  # other options that rule the documents out keep them off
        return (forced_route in (None, "hopper") and not options.get("forward_key_scan")
                and options.get("forward_tile_order") in (None, "balanced")
                and takes_documents(problem))
    if not asked:
        return False
    if forced_route not in (None, "hopper"):
        raise ValueError(f"kernel_options: 'forward_documents' True and 'forward_route' "
                         f"{forced_route!r} conflict (documents take the Hopper forward)")
    gap = hopper_gap(problem, documents=True)
    if gap is not None:
        raise ValueError(f"kernel_options['forward_documents']: the Hopper forward cannot walk "
                         f"this call's documents: {gap}")
    return True


def forward_route(problem: Problem, options: dict) -> tuning.HopperTile | None:
    """The Hopper forward's tile where the forward takes that route, else None (the Triton
    route). ``options['forward_route']`` forces it; forcing 'hopper' where it does not cover
    the problem is a ValueError that says why. ``options['forward_consumers']`` = 3 takes
    ``tuning.HOPPER_FORWARD_THREE`` (a ValueError where ``three_consumer_gap`` says why not)."""
    forced = options.get("forward_route")
    if forced in ("triton", "gather"):
        return None
    if forced == "hopper":
        gap = hopper_gap(problem)
        if gap is not None:
            raise ValueError(f"kernel_options['forward_route']: 'hopper' does not cover this "
                             f"call: {gap}")
        return hopper_tile(problem, options)
    return hopper_tile(problem, options) if takes_hopper(problem) else None


def hopper_tile(problem: Problem, options: dict) -> tuning.HopperTile:
    """The Hopper forward's tile of a call that takes that route: two consumer warpgroups,
    or three where ``options['forward_consumers']`` asks or, by default, where
    ``takes_three_consumers`` says they lead."""
    consumers = options.get("forward_consumers")
    if consumers is None and takes_three_consumers(problem):
        return tuning.HOPPER_FORWARD_THREE
    if consumers != 3:
        return tuning.HOPPER_FORWARD
    gap = three_consumer_gap(problem)
    if gap is not None:
        raise ValueError(f"kernel_options['forward_consumers']: 3 does not cover this call: "
                         f"{gap}")
    return tuning.HOPPER_FORWARD_THREE


def gather_route(problem: Problem, options: dict) -> GatherTile | None:
    """The gather route's launch where the forward takes it, else None. ``options
    ['forward_route']`` 'gather' forces it (a ValueError says why where it cannot apply), any
    other forced route keeps it off."""
    forced = options.get("forward_route")
    if forced == "gather":
        gap = gather_gap(problem)
        if gap is not None:
            raise ValueError(f"kernel_options['forward_route']: 'gather' does not cover this "
                             f"call: {gap}")
        return gather_tile(problem, forced=True)
    return None if forced is not None else gather_tile(problem)


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
    documents = forward_documents(problem, options)
    hopper = tuning.HOPPER_FORWARD if documents else forward_route(problem, options)
    scan = scan_keys(problem, options, splits)
    if hopper is None and options.get("forward_consumers") is not None:
        raise ValueError("kernel_options['forward_consumers'] sizes the Hopper forward's "
                         "programs; this call takes the Triton route (force forward_route "
                         "'hopper' with it)")
    if documents and options.get("forward_consumers") == 3:
        raise ValueError("kernel_options['forward_consumers']: 3 does not cover this call: "
                         "three consumer warpgroups walk no packed documents yet")
    if hopper is None and options.get("forward_tile_order") is not None:
        raise ValueError("kernel_options['forward_tile_order'] orders the Hopper forward's "
                         "tiles; this call takes the Triton route (force forward_route "
                         "'hopper' with it)")
    if hopper is not None and scan:
        if options.get("forward_key_scan"):
            raise ValueError("kernel_options: 'forward_key_scan' True and 'forward_route' "
                             "'hopper' conflict (the Hopper forward walks lists; choose one)")
        scan = False
    if documents and options.get("forward_tile_order") not in (None, "balanced"):
        raise ValueError("kernel_options: 'forward_documents' True deals the documents' tiles "
                         "longest first ('balanced'); 'forward_tile_order' "
                         f"{options['forward_tile_order']!r} conflicts")
    return ForwardSchedule(
        tile=tile, block_m=block_m, group_pack=pack, key_splits=splits,
        chunk_rows=grid_chunk_rows(rows, row_blocks, 1 if pack > 1 else shape.group_size,
                                   problem.is_causal, sms),
        edge_slots=edge_slots(query_rows, tile.block_n),
        bias_row=bias is not None and bias.one_row and bias.shared_by(pack),
        scan_keys=scan, hopper=hopper,
        gather=None if documents else gather_route(problem, options),
        tile_order=None if hopper is None else ("balanced" if documents
                                                else tile_order(problem, options)),
        documents=documents)


def forward_list_tiles(problem: Problem, forward: ForwardSchedule) -> tuple[tuple[int, int], ...]:
    """The forward's list tile, and where its tile follows the bias (``interval_tile_possible``)
    the list tiles of both choices, first the one ``forward`` took; where the masked Hopper
    forward may run, its list tile too (``hopper_forward.list_tile``)."""
    tiles = [forward.list_tile]
    if interval_tile_possible(problem):
        for tile in (tuning.FORWARD_D128_INTERVALS, tuning.FORWARD_D128_MASKED):
            tiles.append((tile.block_m // group_pack(problem, tile.block_m), tile.block_n))
    if (forward.hopper is not None and problem.mask is not None) or may_take_masks(problem):
        tiles.append(list_tile(forward.hopper or tuning.HOPPER_FORWARD))
    return tuple(dict.fromkeys(tiles))
