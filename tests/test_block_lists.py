"""The active-tile lists every masked kernel walks: which tiles, in which order.

Each row block's list holds the full tiles (every pair visible) first, then the partial ones,
each part ascending; inactive tiles are absent. Checked against the tiles of the mask computed
in torch, for both orientations (keys on rows is the dkdv kernel's), causal or not, at lengths
that leave partial blocks.
"""

from __future__ import annotations

import pytest
import torch

from attn_helpers import Dims, random_mask, random_qkv
from kernels.planning.activity import lists_from_activity, tile_activity
from kernels.planning.inputs import check_inputs


def _expected_lists(visible: torch.Tensor, block_rows: int, block_cols: int):
    """Per row block: (full column blocks, partial column blocks), from a (R, C) bool tensor."""
    rows, cols = visible.shape
    lists = []
    for r0 in range(0, rows, block_rows):
        full, partial = [], []
        for c, c0 in enumerate(range(0, cols, block_cols)):
            tile = torch.zeros(block_rows, block_cols, dtype=torch.bool)
            part = visible[r0:r0 + block_rows, c0:c0 + block_cols]
            tile[:part.shape[0], :part.shape[1]] = part  # pairs past the lengths are not visible
            if tile.all():
                full.append(c)
            elif tile.any():
                partial.append(c)
        lists.append((full, partial))
    return lists


def _mask_with_both_kinds(dims: Dims, device) -> torch.Tensor:
    rows = torch.arange(dims.seqlen_q, device=device)[:, None]
    cols = torch.arange(dims.seqlen_k, device=device)[None, :]
    mask = random_mask(dims.full_operand_shape("Hk"), device, keep=0.2)
    mask |= ((rows // 16 + cols // 16) % 3 == 0)  # whole 16x16 blocks kept
    mask[..., 48:64] = False  # a band of empty tiles
    mask[..., 192:256, 64:128] = True  # below the diagonal: full at every tile size tested
    return mask


def _assert_lists(lists, mask, dims, causal, transposed, block_rows, block_cols,
                  need_both_kinds=True):
    rows = torch.arange(dims.seqlen_q, device=mask.device)[:, None]
    cols = torch.arange(dims.seqlen_k, device=mask.device)[None, :]
    visible = mask[0, 0].clone()
    if causal:
        visible &= cols <= rows + (dims.seqlen_k - dims.seqlen_q)
    if transposed:
        visible = visible.T
    expected = _expected_lists(visible.cpu(), block_rows, block_cols)
    counts, indices = lists.counts.cpu(), lists.indices.cpu()
    assert counts.shape[2] == len(expected)
    kinds_seen = set()
    for row, (full, partial) in enumerate(expected):
        count, full_count = counts[0, 0, row].tolist()
        assert (count, full_count) == (len(full) + len(partial), len(full)), f"row block {row}"
        assert indices[0, 0, row, :count].tolist() == full + partial, f"row block {row}"
        kinds_seen.update(("full",) * bool(full) + ("partial",) * bool(partial))
    if need_both_kinds:
        assert kinds_seen == {"full", "partial"}, "the mask was meant to give both kinds of tile"


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("transposed", (False, True), ids=("queries_on_rows", "keys_on_rows"))
def test_full_tiles_first_then_partial(causal, transposed, device):
    # Over 256 columns either way, so the activity pass splits each row over several programs.
    dims = Dims(1, 290, 300, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    mask = _mask_with_both_kinds(dims, device)
    checked = check_inputs(q, k, v, mask, None, None)
    activity = tile_activity(checked.mask, checked.shape, 16, 16, causal)
    lists = lists_from_activity(activity, 16, 16, transposed)
    _assert_lists(lists, mask, dims, causal, transposed, 16, 16)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("transposed,block,sub", [
    (False, (32, 64), (16, 16)),   # list tiles of 2 x 4 map tiles
    (False, (64, 16), (8, 16)),
    (True, (64, 32), (16, 32)),    # keys on rows: a (32 query, 64 key) tile of 2 x 2 map tiles
    (True, (32, 32), (32, 32)),
    (False, (48, 32), (16, 16)),   # 3 x 2 map tiles, as the three-warpgroup forward's 192 rows
    (True, (32, 48), (16, 32)),    # keys on rows: 1 x 3 map tiles
], ids=("q32k64_of_16x16", "q64k16_of_8x16", "keys64q32_of_16x32", "keys32q32_of_32x32",
        "q48k32_of_16x16", "keys32q48_of_16x32"))
def test_lists_derived_from_a_finer_map(causal, transposed, block, sub, device):
    """One activity map serves every kernel: lists for larger tiles, either orientation, come
    out as if built from the mask at their own tile size, also where a tile holds a number of
    map tiles that is not a power of two. 290 x 300 leaves partial tiles whose last map tiles
    lie past the map."""
    dims = Dims(1, 290, 300, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    mask = _mask_with_both_kinds(dims, device)
    checked = check_inputs(q, k, v, mask, None, None)
    activity = tile_activity(checked.mask, checked.shape, *sub, causal)
    lists = lists_from_activity(activity, *block, transposed)
    _assert_lists(lists, mask, dims, causal, transposed, *block)


@pytest.mark.parametrize("transposed", (False, True), ids=("queries_on_rows", "keys_on_rows"))
def test_lists_for_a_single_query_row(transposed, device):
    """Decode: Lq = 1 with 4-row map tiles (a packed GQA forward's query rows)."""
    dims = Dims(1, 1, 300, heads_q=4, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    mask = random_mask(dims.full_operand_shape("Hk"), device, keep=0.3)
    mask[..., 64:128] = False
    checked = check_inputs(q, k, v, mask, None, None)
    activity = tile_activity(checked.mask, checked.shape, 4, 16, True)
    block = (64, 16) if transposed else (4, 32)
    lists = lists_from_activity(activity, *block, transposed)
    _assert_lists(lists, mask, dims, True, transposed, *block, need_both_kinds=False)


def test_lists_need_tiles_made_of_map_tiles(device):
    dims = Dims(1, 40, 40, heads_q=1, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    mask = random_mask(dims.full_operand_shape("Hk"), device)
    checked = check_inputs(q, k, v, mask, None, None)
    activity = tile_activity(checked.mask, checked.shape, 16, 32, False)
    with pytest.raises(ValueError, match="not made of"):
        lists_from_activity(activity, 16, 16, False)


def test_partial_share_counts_the_tiles_that_read_mask_bytes(device):
    """The share of partial tiles among active ones, over all list rows, as counted in torch
    from the mask; only a counted share is reported (a call never syncs to count one)."""
    dims = Dims(1, 290, 300, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    mask = _mask_with_both_kinds(dims, device)
    checked = check_inputs(q, k, v, mask, None, None)
    activity = tile_activity(checked.mask, checked.shape, 16, 16, True)
    assert activity.partial_share(32, 16, True) is None
    rows = torch.arange(dims.seqlen_q, device=device)[:, None]
    cols = torch.arange(dims.seqlen_k, device=device)[None, :]
    visible = (mask[0, 0] & (cols <= rows + dims.seqlen_k - dims.seqlen_q)).T.cpu()
    lists = _expected_lists(visible, 32, 16)
    full = sum(len(f) for f, _ in lists)
    partial = sum(len(p) for _, p in lists)
    assert 0 < full and 0 < partial
    assert activity.count_partial_share(32, 16, True) == pytest.approx(partial / (full + partial))
    assert activity.partial_share(32, 16, True) == activity.count_partial_share(32, 16, True)
    assert activity.partial_share(32, 16, False) is None


@pytest.mark.parametrize("keep,share", [("blocks", 0.0), ("none", 0.0)])
def test_partial_share_of_block_sparse_and_empty_masks(keep, share, device):
    dims = Dims(1, 64, 96, heads_q=1, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    mask = torch.zeros(dims.full_operand_shape("Hk"), dtype=torch.bool, device=device)
    if keep == "blocks":
        mask[..., :32, 32:64] = True
        mask[..., 32:, :32] = True
    checked = check_inputs(q, k, v, mask, None, None)
    activity = tile_activity(checked.mask, checked.shape, 16, 16, False)
    assert activity.count_partial_share(32, 32, True) == share
