"""Compact lists of active tiles, built once from the mask and shared by all kernels.

For a mask, most of the cost of a sparse tile-skip is the branch: a kernel that loads a mask tile
and then decides whether to load K/V cannot software-pipeline its K/V loads. Instead, one pass
over the mask writes, for every row block, the indices of the column blocks that hold at least
one visible pair (mask AND causal AND in range). The attention loops then walk these lists
without branches, so inactive tiles cost no K/V loads, no dots and no mask bytes.

Each row's list puts the *full* tiles first (every pair visible: block-sparse masks, sliding
windows, a topk window wider than the visible keys), then the partial ones, each part in
ascending order. Full tiles run like unmasked interior tiles: no mask bytes, no select.

Lists are per mask head and mask batch (a (B, Hk, ...) mask gives lists shared by the whole
GQA group). "Rows" are query blocks for the forward and dq kernels, key blocks for dkdv.

The mask is read once per call: the forward's pass writes an activity map (0 none, 1 some,
2 all pairs visible) in tiles that divide every kernel's tiles, and each kernel's list comes
from a small compaction over the map, so the backward reads no mask bytes to find its tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..runtime.arith import ceil_div, next_power_of_2
from ..runtime.launch import PlannedLaunch
from ..triton_device.activity_kernels import (_compact_kernel, _interval_activity_kernel,
                                              _tile_activity_kernel)
from .inputs import AttnShape, BroadcastOperand, interval_words, operand_args
from .operands import ListStrides, NO_LISTS, sizes_of


@dataclass(frozen=True)
class ActivityMap:
    """(Bm, Hm, ceil(Lq / sub_rows), ceil(Lk / sub_cols)) int8 activity of (sub_rows x
    sub_cols) tiles of (query, key) pairs, per mask batch and head: 0 none, 1 some, 2 all
    visible. One pass over the mask builds it; every kernel's lists are derived from it."""

    active: torch.Tensor
    sub_rows: int
    sub_cols: int
    _lists: dict = field(default_factory=dict, compare=False, repr=False)
    _partial_shares: dict = field(default_factory=dict, compare=False, repr=False)
    _live_shares: dict = field(default_factory=dict, compare=False, repr=False)
    _active_areas: dict = field(default_factory=dict, compare=False, repr=False)

    def lists(self, block_rows: int, block_cols: int, transposed: bool) -> BlockLists:
        """The lists for (block_rows x block_cols) tiles, built on first use and kept: a
        prepared mask (``kernels.prepare_mask``) builds them once for every later call."""
        key = (block_rows, block_cols, bool(transposed))
        if key not in self._lists:
            self._lists[key] = lists_from_activity(self, block_rows, block_cols, transposed)
        return self._lists[key]

    def compacted(self, compaction: ListCompaction) -> BlockLists:
        """The lists of ``compaction``, a planned ``lists``: built on first use and kept with
        the others (one table per tile, whichever of the two made it)."""
        lists = self._lists.get(compaction.key)
        if lists is None:
            lists = self._lists[compaction.key] = compaction(self)
        return lists

    def count_partial_share(self, block_rows: int, block_cols: int, transposed: bool) -> float:
        """Count, and keep, which share of the active tiles in these lists are partial (read
        mask bytes) rather than full. This reads the counts back to the host, a device sync,
        so only ``prepare_mask`` calls it; calls read the kept value with ``partial_share``."""
        key = (block_rows, block_cols, bool(transposed))
        counts = self.lists(*key).counts.to(torch.int64)
        active, full = counts.sum(dim=tuple(range(counts.dim() - 1))).tolist()
        self._partial_shares[key] = (active - full) / active if active else 0.0
        return self._partial_shares[key]

    def partial_share(self, block_rows: int, block_cols: int, transposed: bool) -> float | None:
        """The share counted by ``count_partial_share``, or None where it was not counted
        (a mask read within the call, where a sync would stall the host)."""
        return self._partial_shares.get((block_rows, block_cols, bool(transposed)))

    def count_active_areas(self, tiles) -> tuple[int, ...]:
        """Count, and keep, for each (block_rows, block_cols) tile in ``tiles`` (queries on
        rows) the (query, key) pairs inside its active tiles: the work of a kernel that walks
        them. One device sync for all, as ``count_partial_share``; each tile must be made of
        the map's tiles."""
        batch, heads, rows, cols = self.active.shape
        live = self.active > 0
        sums = []
        for block_rows, block_cols in tiles:
            fr, fc = block_rows // self.sub_rows, block_cols // self.sub_cols
            padded = torch.nn.functional.pad(live, (0, -cols % fc, 0, -rows % fr))
            blocks = padded.view(batch, heads, -(-rows // fr), fr, -(-cols // fc), fc)
            sums.append(blocks.any(5).any(3).sum())
        counts = torch.stack(sums).tolist()
        areas = tuple(count * tile_rows * tile_cols
                      for count, (tile_rows, tile_cols) in zip(counts, tiles))
        self._active_areas.update(zip(map(tuple, tiles), areas))
        return areas

    def active_area(self, block_rows: int, block_cols: int) -> int | None:
        """The area counted by ``count_active_areas``, or None where it was not counted."""
        return self._active_areas.get((block_rows, block_cols))

    def count_live_share(self, block_cols: int, heads_per_tile: int) -> float | None:
        """Count, and keep, which share of the (all query rows, ``block_cols`` keys) tiles of
        each group of ``heads_per_tile`` consecutive mask heads hold a visible pair: the packed
        backward's key blocks (``backward_packed``). A device sync, as ``count_partial_share``;
        None where the map's tiles do not divide such a block."""
        batch, heads, _, cols = self.active.shape
        if block_cols % self.sub_cols or heads % heads_per_tile:
            return None
        per_block = block_cols // self.sub_cols
        live = (self.active > 0).any(dim=2).to(torch.int8)  # (Bm, Hm, map cols)
        live = torch.nn.functional.pad(live, (0, (-cols) % per_block))
        live = live.view(batch, heads // heads_per_tile, heads_per_tile, -1, per_block)
        share = live.amax(dim=(2, 4)).float().mean().item()
        self._live_shares[(block_cols, heads_per_tile)] = share
        return share

    def live_share(self, block_cols: int, heads_per_tile: int) -> float | None:
        """The share counted by ``count_live_share``, or None where it was not counted."""
        return self._live_shares.get((block_cols, heads_per_tile))


def call_activity(activity: ActivityMap | None) -> ActivityMap:
    """``activity``, the map a plan with lists per call was handed; a ValueError without one
    (the kernels would read some other tensor as their lists)."""
    if activity is None:
        raise ValueError("this plan takes its tile lists per call: pass the call's activity map")
    return activity


def shared_granularity(tiles) -> tuple[int, int]:
    """The largest (query rows, key cols) tile that divides every (query, key) tile given, so
    one activity map serves all of them."""
    rows = cols = 0
    for tile_rows, tile_cols in tiles:
        rows, cols = math.gcd(rows, tile_rows), math.gcd(cols, tile_cols)
    return rows, cols


class TileActivityPass:
    """The activity pass of a bool mask (``_tile_activity_kernel``) planned for one form: the
    mask's layout (its broadcast shape and strides), the lengths, the map's tile and
    causality. A call allocates the map and launches on the mask it is given, a tensor of that
    layout; a kept plan of a bool mask read per call keeps one (``interface``), so that such a
    call spends no host time on the launch's grid, arguments or form."""

    def __init__(self, mask: BroadcastOperand, shape: AttnShape, sub_rows: int, sub_cols: int,
                 is_causal: bool):
        mask_batch, mask_heads = mask.original_shape[0], mask.original_shape[1]
        map_rows, map_cols = ceil_div(shape.seqlen_q, sub_rows), ceil_div(shape.seqlen_k, sub_cols)
        self.map_shape = (mask_batch, mask_heads, map_rows, map_cols)
        self.sub_rows, self.sub_cols = sub_rows, sub_cols
        # At least two map tiles per load block each way, and blocks of >= 64 x 128 mask bytes.
        load_rows, load_cols = max(2 * sub_rows, 64), max(2 * sub_cols, 128)
        num_load_cols = ceil_div(shape.seqlen_k, load_cols)
        grid = (ceil_div(shape.seqlen_q, load_rows) * num_load_cols, mask_batch * mask_heads)
        self.launch = PlannedLaunch(
            _tile_activity_kernel, grid, None,
            (operand_args(mask), mask_heads, sizes_of(shape), map_rows, map_cols, num_load_cols),
            SUB_ROWS=sub_rows, SUB_COLS=sub_cols, LOAD_ROWS=load_rows, LOAD_COLS=load_cols,
            IS_CAUSAL=bool(is_causal), num_warps=4)

    def __call__(self, mask: torch.Tensor) -> ActivityMap:
        """The map of ``mask``, a bool tensor of the planned layout (its broadcast view or the
        tensor itself: both start at the same address)."""
        active = torch.empty(self.map_shape, dtype=torch.int8, device=mask.device)
        self.launch(mask, active)
        return ActivityMap(active, self.sub_rows, self.sub_cols)


def tile_activity(mask: BroadcastOperand, shape: AttnShape, sub_rows: int, sub_cols: int,
                  is_causal: bool) -> ActivityMap:
    """The activity map at (sub_rows x sub_cols) granularity: the one pass over the mask.
    Fully parallel and bandwidth-bound; ``lists_from_activity`` then compacts each list row in
    a small second launch (one sequential pass per row over the mask would be latency-bound).
    ``KeyIntervals`` masks take ``interval_activity`` instead: no pass over (Lq, Lk)."""
    if mask.interval_pairs is not None:
        return interval_activity(mask, shape, sub_rows, sub_cols, is_causal)
    return TileActivityPass(mask, shape, sub_rows, sub_cols, is_causal)(mask.view)


class IntervalActivityPass:
    """The read of a ``KeyIntervals`` mask (``_interval_activity_kernel``) planned for one
    form: the strides of its start and end tensors (their dtypes and device are the form's
    too), the kernels' (Bm', Hm') after broadcast axes collapse, the lengths, the map's tile
    and causality. A call allocates the map and launches once: the kernels' int64 words and
    the activity map from the tensors as given. A kept plan of intervals used once keeps one
    (``interface``), so that a call spends no host time on the launch's grid or form."""

    def __init__(self, source: tuple[torch.Tensor, torch.Tensor], mask_batch: int,
                 mask_heads: int, words_row: int, shape: AttnShape, sub_rows: int,
                 sub_cols: int, is_causal: bool):
        map_rows, map_cols = ceil_div(shape.seqlen_q, sub_rows), ceil_div(shape.seqlen_k, sub_cols)
        self.map_shape = (mask_batch, mask_heads, map_rows, map_cols)
        self.sub_rows, self.sub_cols = sub_rows, sub_cols
        start, end = source
        # A size-1 axis is only ever read at index 0: its stride is passed as 0, so that it
        # never decides the compiled form.
        strides = tuple(0 if size == 1 else stride
                        for t in (start, end) for size, stride in zip(t.shape, t.stride()))
        # 1024 keys and 1024 rows per program: the bounds of a key block are recomputed once
        # per ROWS row blocks, so the intervals are read map_rows / ROWS times in all. Fixed
        # sizes, not sizes that follow the lengths, so that a new length compiles nothing.
        cols = max(1, 1024 // sub_cols)
        rows = max(1, 1024 // sub_rows)
        grid = (ceil_div(map_rows, rows), ceil_div(map_cols, cols), mask_batch * mask_heads)
        self.launch = PlannedLaunch(
            _interval_activity_kernel, grid, None,
            (*strides, mask_heads, shape.seqlen_q, shape.seqlen_k, map_rows, map_cols,
             words_row),
            SUB_ROWS=sub_rows, SUB_COLS=sub_cols, ROWS=rows, COLS=cols,
            IS_CAUSAL=bool(is_causal), num_warps=4)

    def __call__(self, start: torch.Tensor, end: torch.Tensor,
                 words: torch.Tensor) -> ActivityMap:
        """The map of intervals ``start`` and ``end`` (of the planned form); their words are
        written into ``words``, an int64 (Bm', Hm', Lk) tensor whose rows are the planned
        ``words_row`` apart (``KeyIntervals.kernel_operand``'s layout)."""
        active = torch.empty(self.map_shape, dtype=torch.int8, device=words.device)
        self.launch(start, end, words, active)
        return ActivityMap(active, self.sub_rows, self.sub_cols)


def interval_activity(mask: BroadcastOperand, shape: AttnShape, sub_rows: int, sub_cols: int,
                      is_causal: bool) -> ActivityMap:
    """The activity map of a ``KeyIntervals`` mask (its checked operand) in one launch of
    O(Bm' Hm' (Lk + map tiles)) work: per key block the bounds of its intervals, per tile the
    tests on them (``_interval_activity_kernel``). A tile is active (1) where some key's
    interval reaches its rows, which may count a tile whose keys' intervals pass between its
    rows (harmless: its pairs are tested); it is full (2) only where every pair is visible and
    the tile lies inside both lengths, exactly as ``_tile_activity_kernel`` counts it. One
    launch in place of ~45 torch ops, which cost ~1.1 ms of host time per call at L1024 on the
    H100 host. The launch also rewrites the operand's words, with the values they hold."""
    words = interval_words(mask.interval_pairs)  # (Bm', Hm', Lk) int64, rows of even length
    return IntervalActivityPass(mask.interval_source, words.shape[0], words.shape[1],
                                words.stride(1), shape, sub_rows, sub_cols,
                                is_causal)(*mask.interval_source, words)


@dataclass(frozen=True)
class BlockLists:
    """table (Bm, Hm, R, 2 + C) int32: per row block (count, full count, column blocks...),
    the full tiles' blocks first, then the partial ones'. One tensor, so one allocation and
    four kernel arguments."""

    table: torch.Tensor
    block_rows: int
    block_cols: int

    @property
    def counts(self) -> torch.Tensor:
        return self.table[..., :2]

    @property
    def indices(self) -> torch.Tensor:
        return self.table[..., 2:]


def block_list_strides(lists: BlockLists | None, batch: int) -> ListStrides:
    """The (b, h, row) strides of the lists' table (its pointer is passed per call). A
    batch-broadcast mask has one set of lists; batch stride 0 shares it across the batch.
    Without a mask the kernels never read these (HAS_MASK is False)."""
    if lists is None:
        return NO_LISTS
    table = lists.table
    shared = table.shape[0] == 1 and batch > 1
    return ListStrides(0 if shared else table.stride(0), table.stride(1), table.stride(2))


class ListCompaction:
    """The list compaction (``_compact_kernel``) of a map of one shape and tile into lists of
    (block_rows x block_cols) tiles (keys on rows when transposed), planned once: a call
    allocates the table and launches."""

    def __init__(self, map_shape: tuple, sub_rows: int, sub_cols: int, block_rows: int,
                 block_cols: int, transposed: bool):
        tile_q, tile_k = (block_cols, block_rows) if transposed else (block_rows, block_cols)
        if tile_q % sub_rows or tile_k % sub_cols:
            raise ValueError(f"a ({tile_q}, {tile_k}) tile is not made of the activity map's "
                             f"({sub_rows}, {sub_cols}) tiles")
        self.key = (block_rows, block_cols, bool(transposed))
        fq, fk = tile_q // sub_rows, tile_k // sub_cols
        mask_batch, mask_heads, map_rows, map_cols = map_shape
        # A list tile's last map tiles may lie past the map (the lengths end inside the tile).
        q_tiles, k_tiles = ceil_div(map_rows, fq), ceil_div(map_cols, fk)
        num_rows, num_cols = (k_tiles, q_tiles) if transposed else (q_tiles, k_tiles)
        fr, fc = (fk, fq) if transposed else (fq, fk)
        self.table_shape = (mask_batch, mask_heads, num_rows, num_cols + 2)
        self.launch = PlannedLaunch(
            _compact_kernel, (mask_batch * mask_heads * num_rows,), None,
            (map_rows, map_cols, num_rows, num_cols),
            FR=fr, FC=fc, TRANSPOSED=bool(transposed),
            # A fixed chunk, not one that follows the number of columns, so that a new length
            # compiles nothing (the chunk loop masks the columns past the row).
            CHUNK=max(16, 1024 // next_power_of_2(fr * fc)),
            SUB_TILES=next_power_of_2(fr * fc), num_warps=4,
        )

    def __call__(self, activity: ActivityMap) -> BlockLists:
        table = torch.empty(self.table_shape, dtype=torch.int32, device=activity.active.device)
        self.launch(activity.active, table)
        return BlockLists(table, *self.key[:2])


def lists_from_activity(activity: ActivityMap, block_rows: int, block_cols: int,
                        transposed: bool) -> BlockLists:
    """Lists for (block_rows x block_cols) tiles (keys on rows when transposed) from a map
    whose tiles divide them: one small launch reading the map, never the mask."""
    return ListCompaction(activity.active.shape, activity.sub_rows, activity.sub_cols,
                          block_rows, block_cols, transposed)(activity)
