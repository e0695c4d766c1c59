"""The Hopper forward's work tiles over sequences packed end to end (flash-attn's varlen
layout): ``document_tiles`` lists each sequence's row tiles, longest key walks first, on the
offsets' device with no value read back, so a CUDA graph can capture it."""

from __future__ import annotations

import torch


def tile_bound(total_q: int, sequences: int, rows: int) -> int:
    """At most this many row tiles of ``rows`` rows cover ``sequences`` sequences of
    ``total_q`` rows in all (each sequence's last tile may be partial)."""
    return total_q // rows + sequences


def document_tiles(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, rows: int,
                   block_n: int, causal: bool) -> torch.Tensor:
    """The work tiles of the sequences that int32 offsets ``cu_q`` and ``cu_k`` (n + 1 each)
    pack, as an int32 table of 1 + 2 x ``tile_bound`` entries: the count of tiles, then per
    tile (sequence, row tile), sorted by the key blocks of ``block_n`` keys the tile walks,
    most first (ties in sequence order); the entries past the count are unread. A tile of
    rows [m x rows, (m + 1) x rows) of a sequence of Lq rows and Lk keys walks
    ceil(min(Lk, (m + 1) x rows + Lk - Lq) / block_n) blocks with (bottom-right) causality,
    ceil(Lk / block_n) without, and at least one (``tiles.WorkTiles.key_blocks``)."""
    device = cu_q.device
    seqlen_q = (cu_q[1:] - cu_q[:-1]).to(torch.int64)
    seqlen_k = (cu_k[1:] - cu_k[:-1]).to(torch.int64)
    sequences = seqlen_q.numel()
    ends = torch.cumsum((seqlen_q + rows - 1) // rows, 0)
    bound = tile_bound(total_q, sequences, rows)
    tile = torch.arange(bound, device=device)
    sequence = torch.searchsorted(ends, tile, right=True).clamp(max=sequences - 1)
    row_tile = tile - (ends - (seqlen_q + rows - 1) // rows)[sequence]
    lq, lk = seqlen_q[sequence], seqlen_k[sequence]
    visible_end = torch.minimum(lk, (row_tile + 1) * rows + lk - lq) if causal else lk
    blocks = (visible_end.clamp(min=1) + block_n - 1) // block_n
    blocks = torch.where(tile < ends[-1], blocks, -1)
    order = torch.sort(blocks, descending=True, stable=True).indices
    table = torch.empty(1 + 2 * bound, dtype=torch.int32, device=device)
    table[0] = ends[-1]
    table[1::2] = sequence[order]
    table[2::2] = row_tile[order]
    return table
