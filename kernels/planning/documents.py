"""The Hopper kernels' work over sequences packed end to end (flash-attn's varlen layout):
``document_tiles`` lists the forward's row tiles of each sequence, longest walk first;
``document_key_blocks`` the backward's key blocks, a sequence's together, the sequences with
the longest walks first. Both on the offsets' device with no value read back, so a CUDA graph
can capture them."""

from __future__ import annotations

import torch


def tile_bound(total: int, sequences: int, size: int) -> int:
    """At most this many pieces of ``size`` rows (or keys) cover ``sequences`` sequences of
    ``total`` in all (each sequence's last piece may be partial)."""
    return total // size + sequences


def document_tiles(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, rows: int,
                   block_n: int, causal: bool) -> torch.Tensor:
    """The forward's work tiles of the sequences that int32 offsets ``cu_q`` and ``cu_k``
    (n + 1 each) pack, as an int32 table of 1 + 2 x ``tile_bound`` entries: the count of
    tiles, then per tile (sequence, row tile), sorted by the key blocks of ``block_n`` keys
    the tile walks, most first (ties in sequence order); the entries past the count are
    unread. A tile of rows [m x rows, (m + 1) x rows) of a sequence of Lq rows and Lk keys
    walks ceil(min(Lk, (m + 1) x rows + Lk - Lq) / block_n) blocks with (bottom-right)
    causality, ceil(Lk / block_n) without, and at least one
    (``tiles.WorkTiles.key_blocks``)."""
    seqlen_q, seqlen_k = _lengths(cu_q, cu_k)
    sequence, row_tile, valid = _pieces(seqlen_q, total_q, rows)
    lq, lk = seqlen_q[sequence], seqlen_k[sequence]
    visible_end = torch.minimum(lk, (row_tile + 1) * rows + lk - lq) if causal else lk
    blocks = (visible_end.clamp(min=1) + block_n - 1) // block_n
    return _table(sequence, row_tile, valid, blocks)


def document_key_blocks(cu_q: torch.Tensor, cu_k: torch.Tensor, total_k: int, block_n: int,
                        block_m: int, causal: bool) -> torch.Tensor:
    """The backward's key blocks of ``block_n`` keys of the sequences that ``cu_q`` and
    ``cu_k`` pack, as ``document_tiles``' table over keys: the count, then per key block
    (sequence, key block). A program walks query blocks of ``block_m`` rows: ceil(Lq /
    block_m) without causality; with (bottom-right) causality those from the block holding row
    kb x block_n - (Lk - Lq), the first to see the key block's first key
    (``tiles.KeyBlockWork.query_blocks``). A sequence's key blocks are listed together, in
    order, and the sequences by their longest walk, most first (ties in sequence order): the
    programs in flight then add dQ into few sequences' rows, as the dense grid's causal groups
    keep them to few heads' (``tuning.HOPPER_BACKWARD_CAUSAL_GROUP_WAVES``). Every key block
    is listed, walks of none included: its program writes its keys' zero dK and dV."""
    seqlen_q, seqlen_k = _lengths(cu_q, cu_k)
    sequence, key_block, valid = _pieces(seqlen_k, total_k, block_n)
    lq, lk = seqlen_q[sequence], seqlen_k[sequence]
    stop = (lq + block_m - 1) // block_m
    walks = stop
    if causal:
        first = (key_block * block_n - (lk - lq)).clamp(min=0) // block_m
        walks = (stop - first).clamp(min=0)
    longest = torch.zeros_like(seqlen_k).scatter_reduce(
        0, sequence, torch.where(valid, walks, 0), reduce="amax")
    return _table(sequence, key_block, valid, longest[sequence])


def _lengths(cu_q: torch.Tensor, cu_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return ((cu_q[1:] - cu_q[:-1]).to(torch.int64), (cu_k[1:] - cu_k[:-1]).to(torch.int64))


def _pieces(lengths: torch.Tensor, total: int, size: int) -> tuple:
    """(sequence, piece within it, real) of each of ``tile_bound`` pieces of ``size``: the
    sequences' pieces in order, then stand-ins (not real) up to the bound."""
    ends = torch.cumsum((lengths + size - 1) // size, 0)
    piece = torch.arange(tile_bound(total, lengths.numel(), size), device=lengths.device)
    sequence = torch.searchsorted(ends, piece, right=True).clamp(max=lengths.numel() - 1)
    within = piece - (ends - (lengths + size - 1) // size)[sequence]
    return sequence, within, piece < ends[-1]


def _table(sequence: torch.Tensor, within: torch.Tensor, valid: torch.Tensor,
           walks: torch.Tensor) -> torch.Tensor:
    """The int32 table: the count of real pieces, then (sequence, piece) by ``walks`` most
    first (ties in order), the stand-ins last."""
    order = torch.sort(torch.where(valid, walks, -1), descending=True, stable=True).indices
    table = torch.empty(1 + 2 * sequence.numel(), dtype=torch.int32, device=sequence.device)
    table[0] = valid.sum()
    table[1::2] = sequence[order]
    table[2::2] = within[order]
    return table
