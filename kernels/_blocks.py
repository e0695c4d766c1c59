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
GQA group). "Rows" are query blocks for the forward and dq kernels; for the dkdv kernel the same
kernel builds the transposed lists (rows are key blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._checks import AttnShape, BroadcastOperand
from ._launch import ceil_div, next_power_of_2, operand_args
from ._score import tile_offsets, visible_keys


@triton.jit
def _tile_activity_kernel(
    mask_ptr, stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    active_ptr, heads, seqlen_q, seqlen_k, num_col_blocks,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    TRANSPOSED: tl.constexpr, IS_CAUSAL: tl.constexpr,
):
    """One program per tile: 0 if no pair of the tile is visible, 2 if all are, else 1."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    row_block = tile // num_col_blocks
    col_block = tile % num_col_blocks
    b = bh // heads
    h = bh % heads
    rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = col_block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    if TRANSPOSED:  # rows are keys, columns are queries
        m_idx = cols[None, :]
        n_idx = rows[:, None]
    else:
        m_idx = rows[:, None]
        n_idx = cols[None, :]
    base = mask_ptr + b.to(tl.int64) * stride_mask_b + h.to(tl.int64) * stride_mask_h
    reachable = True
    if IS_CAUSAL:
        # A tile wholly above the diagonal reads no mask bytes: causal lists read half the mask.
        # (A branch, not a narrower load predicate: the predicate must stay a plain compare of
        # positions with the lengths: a length computed in the kernel made the pass 1.3-1.8x
        # slower on the H100, most likely because the loads lost their vector width.)
        reachable = tl.min(n_idx) <= tl.max(m_idx) + (seqlen_k - seqlen_q)
    activity = tl.zeros([], dtype=tl.int8)
    if reachable:
        keep = visible_keys(m_idx, n_idx, seqlen_q, seqlen_k,
                            base + tile_offsets(m_idx, n_idx, stride_mask_m, stride_mask_n),
                            True, IS_CAUSAL)
        # One reduction gives both "any" and "all".
        visible = tl.sum(keep.to(tl.int32))
        activity = (visible > 0).to(tl.int8) + (visible == BLOCK_ROWS * BLOCK_COLS).to(tl.int8)
    tl.store(active_ptr + bh.to(tl.int64) * tl.num_programs(0) + tile, activity)


@triton.jit
def _compact_kernel(active_ptr, table_ptr, num_col_blocks,
                    CHUNK: tl.constexpr):
    """Per row of the activity map, one table row: (count, full count, the full column blocks
    in order, then the partial ones)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNK)
    table_row = table_ptr + row * (num_col_blocks + 2)
    count = 0
    # Pass 0 collects full tiles (activity 2), pass 1 partial ones (activity 1).
    for part in tl.static_range(2):
        for start in range(0, num_col_blocks, CHUNK):
            cols = start + offs
            activity = tl.load(active_ptr + row * num_col_blocks + cols,
                               mask=cols < num_col_blocks, other=0)
            flags = (activity == 2 - part).to(tl.int32)
            # Exclusive prefix sum gives each chosen column its slot in the list.
            slots = count + tl.cumsum(flags, 0) - flags
            tl.store(table_row + 2 + slots, cols, mask=flags > 0)
            count += tl.sum(flags, 0)
        if part == 0:
            tl.store(table_row + 1, count)
    tl.store(table_row, count)


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


def block_list_args(lists: BlockLists | None, batch: int, placeholder: torch.Tensor) -> tuple:
    """Kernel args: the table and its (b, h, row) strides.

    A batch-broadcast mask has one set of lists; batch stride 0 shares it across the batch.
    Without a mask the kernels never read these (HAS_MASK is False).
    """
    if lists is None:
        return (placeholder, 0, 0, 0)
    table = lists.table
    shared = table.shape[0] == 1 and batch > 1
    return (table, 0 if shared else table.stride(0), table.stride(1), table.stride(2))


def build_block_lists(mask: BroadcastOperand, shape: AttnShape, block_rows: int,
                      block_cols: int, is_causal: bool, transposed: bool) -> BlockLists:
    """Active-tile lists for (block_rows x block_cols) tiles; transposed puts keys on rows."""
    args = operand_args(mask, None)
    mask_batch, mask_heads = mask.original_shape[0], mask.original_shape[1]
    len_rows, len_cols = ((shape.seqlen_k, shape.seqlen_q) if transposed
                          else (shape.seqlen_q, shape.seqlen_k))
    num_rows = ceil_div(len_rows, block_rows)
    num_cols = ceil_div(len_cols, block_cols)
    device = mask.view.device
    table = torch.empty((mask_batch, mask_heads, num_rows, num_cols + 2), dtype=torch.int32,
                        device=device)
    # Two launches: a fully parallel activity pass (the mask is read once, bandwidth-bound),
    # then a tiny compaction per row. One sequential pass per row would be latency-bound.
    active = torch.empty((mask_batch, mask_heads, num_rows, num_cols), dtype=torch.int8,
                         device=device)
    _tile_activity_kernel[(num_rows * num_cols, mask_batch * mask_heads)](
        args.tensor, args.stride_b, args.stride_h, args.stride_m, args.stride_n,
        active, mask_heads, shape.seqlen_q, shape.seqlen_k, num_cols,
        BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
        TRANSPOSED=transposed, IS_CAUSAL=bool(is_causal),
        num_warps=4,
    )
    _compact_kernel[(mask_batch * mask_heads * num_rows,)](
        active, table, num_cols, CHUNK=min(1024, next_power_of_2(num_cols)),
        num_warps=4,
    )
    return BlockLists(table, block_rows, block_cols)
