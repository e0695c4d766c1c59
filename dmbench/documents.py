"""Packed documents, the ``document`` mask kind: every batch row holds documents end to end.

Row ``i`` sees key ``j`` iff both lie in one document, and with causality also ``j <= i``.

The lengths are either the case's explicit ``documents`` (every batch row the same list, zeros
allowed) or drawn from the case's seed, per batch row: log-uniform between
``max(1, window // DOCUMENT_RANGE)`` and ``window`` (the longest document), rounded, drawn until
the row is full, the last one cut to fit. Log-uniform means many short documents and few long
ones, while most tokens sit in the long ones (with the range 64: median length window / 8,
mean about window / 4.2). The draw uses its own CPU generator, so a seed gives the same
documents on every device.

Three forms of one mask, all O(B·L):

- ``intervals``: ``KeyIntervals`` (B, 1, L): key j of the document [s, e) is seen by rows
  [s, e), or [j, e) with causality.
- ``packed``: flash-attn's varlen layout of all rows' documents in order, B·L tokens:
  ``cu_seqlens`` (int32, one offset per document boundary, zero-length documents included)
  and the longest length.
- ``rows``: the dense bool mask of some query rows, (B, 1, R, L), for bool masks and checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The drawn lengths span window // DOCUMENT_RANGE .. window.
DOCUMENT_RANGE = 64


@dataclass(frozen=True)
class PackedLayout:
    """The varlen layout of a batch of documents: offsets over the B·L packed tokens."""

    cu_seqlens: torch.Tensor  # int32 (n + 1,)
    max_seqlen: int


@dataclass(frozen=True)
class Documents:
    seqlen: int
    lengths: tuple[tuple[int, ...], ...]  # per batch row, each summing to seqlen

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def longest(self) -> int:
        return max(max(row) for row in self.lengths)

    def packed(self, device) -> PackedLayout:
        flat = [n for row in self.lengths for n in row]
        offsets = torch.tensor([0] + flat, dtype=torch.int64).cumsum(0)
        return PackedLayout(offsets.to(device=device, dtype=torch.int32), self.longest)

    def bounds(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 (B, L): the [start, end) of each position's document, in row coordinates."""
        offsets = self.packed(device).cu_seqlens.to(torch.int64)
        lengths = offsets[1:] - offsets[:-1]
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        row_start = torch.arange(self.batch * self.seqlen, device=device) // self.seqlen * self.seqlen
        start = (offsets[doc] - row_start).view(self.batch, self.seqlen)
        end = (offsets[doc + 1] - row_start).view(self.batch, self.seqlen)
        return start, end

    def ids(self, device) -> torch.Tensor:
        """int32 (B, L): each position's document, numbered over the whole batch."""
        lengths = torch.tensor([n for row in self.lengths for n in row], device=device)
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        return doc.to(torch.int32).view(self.batch, self.seqlen)

    def intervals(self, causal: bool, device):
        from kernels import KeyIntervals

        start, end = self.bounds(device)
        if causal:
            start = torch.arange(self.seqlen, device=device).expand(self.batch, -1)
        return KeyIntervals(start[:, None].to(torch.int32).contiguous(),
                            end[:, None].to(torch.int32).contiguous())

    def rows(self, rows: torch.Tensor, causal: bool) -> torch.Tensor:
        """bool (B, 1, R, L): which keys each of ``rows`` sees."""
        start, _ = self.bounds(rows.device)
        keep = start[:, rows, None] == start[:, None, :]
        if causal:
            keep &= torch.arange(self.seqlen, device=rows.device) <= rows[:, None]
        return keep[:, None]


def draw_lengths(seqlen: int, longest: int, gen: torch.Generator) -> tuple[int, ...]:
    """One row's document lengths, log-uniform in [max(1, longest // DOCUMENT_RANGE),
    longest], summing to ``seqlen`` (the last one cut)."""
    longest = min(longest, seqlen)
    shortest = max(1, longest // DOCUMENT_RANGE)
    count = seqlen // shortest + 1  # enough: each length is at least ``shortest``
    u = torch.rand(count, generator=gen, dtype=torch.float64)
    log_lo, log_hi = math.log(shortest), math.log(longest)
    lengths = torch.exp(log_lo + u * (log_hi - log_lo)).round().long().clamp(shortest, longest)
    ends = lengths.cumsum(0)
    n = int(torch.searchsorted(ends, seqlen)) + 1  # the first document reaching the end
    kept = lengths[:n].tolist()
    kept[-1] -= int(ends[n - 1]) - seqlen
    return tuple(kept)


def case_documents(case) -> Documents:
    """The documents of a ``document`` case: its explicit lengths, or drawn from its seed."""
    if case.documents is not None:
        return Documents(case.seqlen_k, (tuple(case.documents),) * case.batch)
    gen = torch.Generator().manual_seed(case.seed)
    return Documents(case.seqlen_k, tuple(draw_lengths(case.seqlen_k, case.window, gen)
                                          for _ in range(case.batch)))
