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
from kernels._blocks import build_block_lists
from kernels._checks import check_inputs


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


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("transposed", (False, True), ids=("queries_on_rows", "keys_on_rows"))
def test_full_tiles_first_then_partial(causal, transposed, device):
    # Over 256 columns either way, so the activity pass splits each row over several programs.
    dims = Dims(1, 290, 300, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    rows = torch.arange(dims.seqlen_q, device=device)[:, None]
    cols = torch.arange(dims.seqlen_k, device=device)[None, :]
    mask = random_mask(dims.full_operand_shape("Hk"), device, keep=0.2)
    mask |= ((rows // 16 + cols // 16) % 3 == 0)  # whole 16x16 blocks kept
    mask[..., 48:64] = False  # a band of empty tiles
    checked = check_inputs(q, k, v, mask, None, None)
    block_rows, block_cols = 16, 16
    lists = build_block_lists(checked.mask, checked.shape, block_rows, block_cols, causal,
                              transposed)

    visible = mask[0, 0].clone()
    if causal:
        visible &= cols <= rows + (dims.seqlen_k - dims.seqlen_q)
    if transposed:
        visible = visible.T
    expected = _expected_lists(visible.cpu(), block_rows, block_cols)
    counts, indices = lists.counts.cpu(), lists.indices.cpu()
    kinds_seen = set()
    for row, (full, partial) in enumerate(expected):
        count, full_count = counts[0, 0, row].tolist()
        assert (count, full_count) == (len(full) + len(partial), len(full)), f"row block {row}"
        assert indices[0, 0, row, :count].tolist() == full + partial, f"row block {row}"
        kinds_seen.update(("full",) * bool(full) + ("partial",) * bool(partial))
    assert kinds_seen == {"full", "partial"}, "the mask was meant to give both kinds of tile"
