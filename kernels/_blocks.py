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
import triton
import triton.language as tl

from ._checks import AttnShape, BroadcastOperand, interval_words
from ._launch import PlannedLaunch, ceil_div, operand_args
from ._operands import NO_LISTS, ListStrides, sizes_of
from ._score import clamped_bounds, tile_offsets, visible_keys


@triton.jit
def _tile_activity_kernel(
    mask_ptr, active_ptr, mask_layout, heads, sizes, map_rows, map_cols, num_load_cols,
    SUB_ROWS: tl.constexpr, SUB_COLS: tl.constexpr,
    LOAD_ROWS: tl.constexpr, LOAD_COLS: tl.constexpr, IS_CAUSAL: tl.constexpr,
):
    """One program per (LOAD_ROWS x LOAD_COLS) block of (query, key) pairs; writes the activity
    of each (SUB_ROWS x SUB_COLS) tile in it: 0 if no pair is visible, 2 if all are, else 1.

    The load block is wider than the map's tiles so that the mask loads stay long and
    vectorized whatever granularity the kernels' tiles need. The lengths come in ``sizes`` (a
    ``_operands.Sizes``), which keeps them compiled for their divisibility by 16: the loads
    stay vectorized only where the predicate's length is known to be a multiple of 16 (sm_90
    PTX: 4 vector loads against 64 byte loads at L4096)."""
    seqlen_q = sizes.seqlen_q
    seqlen_k = sizes.seqlen_k
    FR: tl.constexpr = LOAD_ROWS // SUB_ROWS
    FC: tl.constexpr = LOAD_COLS // SUB_COLS
    block = tl.program_id(0)
    bh = tl.program_id(1)
    load_row = block // num_load_cols
    load_col = block % num_load_cols
    b = bh // heads
    h = bh % heads
    m_idx = (load_row * LOAD_ROWS + tl.arange(0, LOAD_ROWS))[:, None]
    n_idx = (load_col * LOAD_COLS + tl.arange(0, LOAD_COLS))[None, :]
    base = (mask_ptr + b.to(tl.int64) * mask_layout.stride_b
            + h.to(tl.int64) * mask_layout.stride_h)
    reachable = True
    if IS_CAUSAL:
        # A block wholly above the diagonal reads no mask bytes: causal maps read half the mask.
        # (A branch, not a narrower load predicate: the predicate must stay a plain compare of
        # positions with the lengths: a length computed in the kernel made the pass 1.3-1.8x
        # slower on the H100, most likely because the loads lost their vector width.)
        reachable = tl.min(n_idx) <= tl.max(m_idx) + (seqlen_k - seqlen_q)
    activity = tl.zeros([FR, FC], dtype=tl.int8)
    if reachable:
        keep = visible_keys(m_idx, n_idx, seqlen_q, seqlen_k,
                            base + tile_offsets(m_idx, n_idx, mask_layout.stride_m,
                                                 mask_layout.stride_n),
                            True, IS_CAUSAL)
        # Visible pairs per map tile; one count gives both "any" and "all".
        per_tile = tl.reshape(keep.to(tl.int32), [FR, SUB_ROWS, FC, SUB_COLS])
        visible = tl.sum(tl.sum(per_tile, 3), 1)
        activity = (visible > 0).to(tl.int8) + (visible == SUB_ROWS * SUB_COLS).to(tl.int8)
    sub_r = (load_row * FR + tl.arange(0, FR))[:, None]
    sub_c = (load_col * FC + tl.arange(0, FC))[None, :]
    tl.store(active_ptr + bh.to(tl.int64) * map_rows * map_cols + sub_r * map_cols + sub_c,
             activity, mask=(sub_r < map_rows) & (sub_c < map_cols))


@triton.jit
def _compact_kernel(active_ptr, table_ptr, map_rows, map_cols, num_rows, num_cols,
                    FR: tl.constexpr, FC: tl.constexpr, TRANSPOSED: tl.constexpr,
                    CHUNK: tl.constexpr):
    """One table row per list row: (count, full count, the full column blocks in order, then
    the partial ones). A list tile covers FR x FC map tiles (FR along the list's rows); it is
    inactive if all of them are, full if all are full, else partial. Map tiles past the map
    lie past the lengths: they count as inactive and keep the tile from being full.
    TRANSPOSED lists put keys on rows (the dkdv kernel's); the map always has queries on rows.
    """
    pid = tl.program_id(0)
    bh = pid // num_rows
    row = pid % num_rows
    map_base = active_ptr + bh.to(tl.int64) * map_rows * map_cols
    table_row = table_ptr + pid.to(tl.int64) * (num_cols + 2)
    offs = tl.arange(0, CHUNK)
    sub = tl.arange(0, FR * FC)
    sub_r = (row * FR + sub // FC)[None, :]
    count = 0
    # Pass 0 collects full tiles (activity 2), pass 1 partial ones (activity 1).
    for part in tl.static_range(2):
        for start in range(0, num_cols, CHUNK):
            cols = start + offs
            sub_c = cols[:, None] * FC + (sub % FC)[None, :]
            if TRANSPOSED:
                q_sub, k_sub = sub_c, sub_r
            else:
                q_sub, k_sub = sub_r, sub_c
            sub_activity = tl.load(map_base + q_sub * map_cols + k_sub,
                                   mask=(q_sub < map_rows) & (k_sub < map_cols), other=0)
            any_active = tl.max(sub_activity, 1) > 0
            all_full = tl.min(sub_activity, 1) == 2
            activity = tl.where(all_full, 2, tl.where(any_active, 1, 0))
            activity = tl.where(cols < num_cols, activity, 0)
            flags = (activity == 2 - part).to(tl.int32)
            # Exclusive prefix sum gives each chosen column its slot in the list.
            slots = count + tl.cumsum(flags, 0) - flags
            tl.store(table_row + 2 + slots, cols, mask=flags > 0)
            count += tl.sum(flags, 0)
        if part == 0:
            tl.store(table_row + 1, count)
    tl.store(table_row, count)


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


def call_activity(activity: ActivityMap | None) -> ActivityMap:
    """``activity``, the map a plan with lists per call was handed; a ValueError without one
    (the kernels would read some other tensor as their lists)."""
    if activity is None:
        raise ValueError("this plan takes its tile lists per call: pass the call's activity map")
    return activity


def block_list_strides(lists: BlockLists | None, batch: int) -> ListStrides:
    """The (b, h, row) strides of the lists' table (its pointer is passed per call). A
    batch-broadcast mask has one set of lists; batch stride 0 shares it across the batch.
    Without a mask the kernels never read these (HAS_MASK is False)."""
    if lists is None:
        return NO_LISTS
    table = lists.table
    shared = table.shape[0] == 1 and batch > 1
    return ListStrides(0 if shared else table.stride(0), table.stride(1), table.stride(2))


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


@triton.jit
def _interval_activity_kernel(
    start_ptr, end_ptr, words_ptr, active_ptr,
    stride_start_b, stride_start_h, stride_start_k, stride_end_b, stride_end_h, stride_end_k,
    heads, seqlen_q, seqlen_k, map_rows, map_cols,
    SUB_ROWS: tl.constexpr, SUB_COLS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
):
    """One program per (ROWS x COLS) map tiles of one mask batch and head (``heads`` of them per
    batch). It reads its COLS key blocks (SUB_COLS keys each) of ``start`` and ``end`` as the
    caller gave them (int32 or int64, any strides; a broadcast axis has stride 0), clamps them
    into [0, 2**31 - 1] and, in the programs of the first row chunk, writes each key's int64
    word (start in the low half, end in the high half: ``_checks.interval_words``), which the
    attention kernels read. Then the bounds of each key block and every tile's activity, as
    ``intervals.IntervalBlockBounds`` defines them: a tile of rows [m0, m1) is active where
    min_start < m1 and max_end > m0 over the block's non-empty intervals, and full (2) where
    max_start <= m0 and min_end >= m1 over all of them and the tile lies inside both lengths.
    Causality narrows key j's start to j - (Lk - Lq) first (in the bounds, not the words)."""
    bh = tl.program_id(2)
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    keys = cols[:, None] * SUB_COLS + tl.arange(0, SUB_COLS)[None, :]
    key_ok = keys < seqlen_k
    key_offsets = keys.to(tl.int64)
    start = tl.load(start_ptr + b * stride_start_b + h * stride_start_h
                    + key_offsets * stride_start_k, mask=key_ok, other=0)
    end = tl.load(end_ptr + b * stride_end_b + h * stride_end_h + key_offsets * stride_end_k,
                  mask=key_ok, other=0)
    start, end = clamped_bounds(start, end)
    if tl.program_id(0) == 0:
        words = (end.to(tl.int64) << 32) | start.to(tl.int64)
        tl.store(words_ptr + bh.to(tl.int64) * seqlen_k + key_offsets, words, mask=key_ok)
    if IS_CAUSAL:
        start = tl.maximum(start, keys - (seqlen_k - seqlen_q))
    live = key_ok & (start < end)
    min_start = tl.min(tl.where(live, start, 2147483647), 1)[None, :]
    max_end = tl.max(tl.where(live, end, -2147483648), 1)[None, :]
    max_start = tl.max(tl.where(key_ok, start, -2147483648), 1)[None, :]
    min_end = tl.min(tl.where(key_ok, end, 2147483647), 1)[None, :]
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS))[:, None]
    m0 = rows * SUB_ROWS
    m1 = tl.minimum(m0 + SUB_ROWS, seqlen_q)
    active = (min_start < m1) & (max_end > m0)
    inside = (m0 + SUB_ROWS <= seqlen_q) & ((cols[None, :] + 1) * SUB_COLS <= seqlen_k)
    full = active & inside & (max_start <= m0) & (min_end >= m1)
    tl.store(active_ptr + bh.to(tl.int64) * map_rows * map_cols + rows * map_cols + cols[None, :],
             active.to(tl.int8) + full.to(tl.int8),
             mask=(rows < map_rows) & (cols[None, :] < map_cols))


class IntervalActivityPass:
    """The read of a ``KeyIntervals`` mask (``_interval_activity_kernel``) planned for one
    form: the strides of its start and end tensors (their dtypes and device are the form's
    too), the kernels' (Bm', Hm') after broadcast axes collapse, the lengths, the map's tile
    and causality. A call allocates the map and launches once: the kernels' int64 words and
    the activity map from the tensors as given. A kept plan of intervals used once keeps one
    (``interface``), so that a call spends no host time on the launch's grid or form."""

    def __init__(self, source: tuple[torch.Tensor, torch.Tensor], mask_batch: int,
                 mask_heads: int, shape: AttnShape, sub_rows: int, sub_cols: int,
                 is_causal: bool):
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
            (*strides, mask_heads, shape.seqlen_q, shape.seqlen_k, map_rows, map_cols),
            SUB_ROWS=sub_rows, SUB_COLS=sub_cols, ROWS=rows, COLS=cols,
            IS_CAUSAL=bool(is_causal), num_warps=4)

    def __call__(self, start: torch.Tensor, end: torch.Tensor,
                 words: torch.Tensor) -> ActivityMap:
        """The map of intervals ``start`` and ``end`` (of the planned form); their words are
        written into ``words``, a contiguous int64 (Bm', Hm', Lk) tensor."""
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
    words = interval_words(mask.interval_pairs)  # (Bm', Hm', Lk) int64, contiguous
    return IntervalActivityPass(mask.interval_source, words.shape[0], words.shape[1], shape,
                                sub_rows, sub_cols, is_causal)(*mask.interval_source, words)


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
            CHUNK=max(16, 1024 // (fr * fc)), num_warps=4,
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
