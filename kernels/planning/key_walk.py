"""Which key blocks a tile of query rows needs without a mask, and which of them every row of
it sees whole: one definition for the host's estimates, checked against the activity lists
and the kernels' walks.

A tile holds query rows [first_row, first_row + rows), clipped at Lq; key block j holds keys
[j * block_n, (j + 1) * block_n), clipped at Lk. Without causality every row sees keys
[0, Lk); with bottom-right causality row r sees keys up to r + Lk - Lq.
``tile_key_blocks`` gives (active, full): blocks [0, active) hold a visible pair of the tile,
and the first ``full`` of them hold only visible pairs of its rows below Lq and no key past Lk.
These are the (count, full count) that the activity lists (``activity.BlockLists``) hold for
the tile under a mask that keeps every pair, except in a last tile that runs past Lq, where the
lists count every block partial (tests/test_key_walk.py).

The kernels walk that definition with their own rules:
- the Hopper forward (``hopper_device.tiles.WorkTiles.key_blocks``, in Gluon) walks
  max(active, 1) blocks, so that a tile whose rows see no key still writes its rows, and tests
  per pair its first block and every block from ``full`` on (a block past Lk reads zeros
  through TMA, so it is tested);
- the Triton forward (``triton_device.spans.causal_block_split``) walks ``active`` blocks and
  tests per pair from min(the causal full count, active) on; without causality it calls every
  block full and bounds the last one by its loads (zero blocks for an empty tile);
- ``hopper_forward.mean_key_blocks`` averages the Hopper forward's walk.
"""

from __future__ import annotations

from ..runtime.arith import ceil_div


def tile_key_blocks(first_row: int, rows: int, seqlen_q: int, seqlen_k: int, block_n: int,
                    causal: bool) -> tuple[int, int]:
    """(active, full) key blocks of the tile of query rows [first_row, first_row + rows)."""
    if not causal:
        return ceil_div(seqlen_k, block_n), seqlen_k // block_n
    diagonal = seqlen_k - seqlen_q  # row r sees keys <= r + diagonal
    last_row = min(first_row + rows, seqlen_q) - 1
    key_end = min(seqlen_k, max(last_row + 1 + diagonal, 0))
    full = min(max(first_row + diagonal + 1, 0), seqlen_k) // block_n
    return ceil_div(key_end, block_n), full
