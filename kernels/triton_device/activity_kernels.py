"""The Triton kernels of the tile activity passes and of the list compaction.

What they build, and why, is in ``planning.activity``, which plans and launches them.
"""

from __future__ import annotations


import triton
import triton.language as tl

from .score import clamped_bounds, tile_offsets, visible_keys


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
    ``operands.Sizes``), which keeps them compiled for their divisibility by 16: the loads
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
                    CHUNK: tl.constexpr, SUB_TILES: tl.constexpr):
    """One table row per list row: (count, full count, the full column blocks in order, then
    the partial ones). A list tile covers FR x FC map tiles (FR along the list's rows); it is
    inactive if all of them are, full if all are full, else partial. Map tiles past the map
    lie past the lengths: they count as inactive and keep the tile from being full.
    TRANSPOSED lists put keys on rows (the dkdv kernel's); the map always has queries on rows.
    SUB_TILES is FR x FC rounded up to a power of two (a 192-row tile has FR = 3): the padding
    reads as inactive to the any-active test and as full to the all-full one, so it changes
    neither.
    """
    pid = tl.program_id(0)
    bh = pid // num_rows
    row = pid % num_rows
    map_base = active_ptr + bh.to(tl.int64) * map_rows * map_cols
    table_row = table_ptr + pid.to(tl.int64) * (num_cols + 2)
    offs = tl.arange(0, CHUNK)
    sub = tl.arange(0, SUB_TILES)
    real = (sub < FR * FC)[None, :]
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
                                   mask=real & (q_sub < map_rows) & (k_sub < map_cols), other=0)
            any_active = tl.max(sub_activity, 1) > 0
            all_full = tl.min(tl.where(real, sub_activity, 2), 1) == 2
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


@triton.jit
def _interval_activity_kernel(
    start_ptr, end_ptr, words_ptr, active_ptr,
    stride_start_b, stride_start_h, stride_start_k, stride_end_b, stride_end_h, stride_end_k,
    heads, seqlen_q, seqlen_k, map_rows, map_cols, words_row,
    SUB_ROWS: tl.constexpr, SUB_COLS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
):
    """One program per (ROWS x COLS) map tiles of one mask batch and head (``heads`` of them per
    batch). It reads its COLS key blocks (SUB_COLS keys each) of ``start`` and ``end`` as the
    caller gave them (int32 or int64, any strides; a broadcast axis has stride 0), clamps them
    into [0, 2**31 - 1] and, in the programs of the first row chunk, writes each key's int64
    word (start in the low half, end in the high half: ``inputs.interval_words``; the words
    of one (batch, head) ``words_row`` apart), which the attention kernels read. Then the
    bounds of each key block and every tile's activity, as
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
        tl.store(words_ptr + bh.to(tl.int64) * words_row + key_offsets, words, mask=key_ok)
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
