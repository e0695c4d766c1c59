"""The mask kinds: drawn from the case's seed, built in the case's mask format.

Kinds (as bool masks, (B, Hk, Lq, Lk), True = keep, unless said otherwise):

- ``topk``: for each batch, KV head and query row, keep the ``window`` visible keys with the
  largest ranking score. With a bias the score is the bias (a ``q_full`` bias is reduced to its
  KV head by the max over the group); without one it is an independent seeded (B, Hk, 1, Lk)
  score, i.e. what a ``kv_row`` bias would have been. ``window >=`` visible keys keeps them all.
  Built as flash-dmattn and transformers' Doge build it: ``torch.topk`` over each row's scores
  (visible keys only), then a scatter into a bool mask (here in row chunks).
- ``block_topk``: topk, then per row each 64-key block is kept whole when more than half of it
  was chosen (a tail block counts against its own length).
- ``block_sparse``: whole 128 x 128 tiles (FlexAttention's default block) chosen at random: for
  each batch, KV head and 128-row query block, ``ceil(window / 128)`` key blocks among those the
  block's rows can see, the same count for every query block. Without causality the active
  fraction is exactly ``min(1, ceil(window / 128) * 128 / Lk)`` for Lk a multiple of 128, which
  is what the block-sparse proportionality target (docs/TARGETS.md) is measured against. ``window >= Lk`` is a
  full-tile ("dense") mask that is still read as a mask.
- ``sliding``: the ``window`` most recent visible keys: keys ``(last - window, last]`` where
  ``last`` is the last key the row may see (``i + Lk - Lq`` when causal, else ``Lk - 1``).
- ``random``: keep with probability 1/2 at ``mask_shape``; when the shape has a query axis,
  rows ``i % 4 == 1`` are fully masked so every random mask exercises empty rows.
- ``document``: packed documents in each batch row (``dmbench.documents``), (B, 1, L, L).
- ``none``: no mask tensor.

Formats: ``bool`` (the masks above), ``intervals`` (``kernels.KeyIntervals``: topk by
``kernels.topk_intervals`` from the same score, sliding, document) and ``varlen`` (a document
batch's packed layout, ``documents.PackedLayout``). ``topk_intervals`` breaks ties between
equal scores by the smaller key index, ``torch.topk`` in no stated order, so with tied scores
(a bf16 bias has many) the two formats of one topk case may keep different keys of equal score.

A mask is made in two steps so that its build is timed apart from the random draws:
``draw_source`` draws what is random (topk's score without a bias, block_sparse's tiles, a
random mask, the documents) and ``mask_builder`` returns the deterministic build of the case's
format from it. Kept entries are always visible under causality, so the active-pair count is
exact. Bool masks are filled in row chunks so that no O(Lq·Lk) float scores exist at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .case import Case, shape_from_tokens
from .documents import Documents, case_documents

BLOCK_KEYS = 64
# Tile edge of block_sparse masks: FlexAttention's default block size, a multiple of ours.
SPARSE_TILE = 128
# Row chunks for mask generation hold at most this many (batch, head, row, key) scores.
CHUNK_ELEMENTS = 1 << 27


@dataclass(frozen=True)
class MaskSource:
    """The random draws a mask is built from (only the ones its kind needs)."""

    score: torch.Tensor | None = None  # topk, block_topk: the ranking score
    tiles: torch.Tensor | None = None  # block_sparse: (B, Hk, query blocks, key blocks)
    mask: torch.Tensor | None = None  # random: the mask itself
    documents: Documents | None = None  # document


def causal_rows(rows: torch.Tensor, case: Case) -> torch.Tensor:
    """bool (R, Lk): the keys bottom-right causality lets each of ``rows`` see (all of them
    without causality)."""
    cols = torch.arange(case.seqlen_k, device=rows.device)[None, :]
    if not case.causal:
        return torch.ones(len(rows), case.seqlen_k, dtype=torch.bool, device=rows.device)
    return cols <= rows[:, None] + (case.seqlen_k - case.seqlen_q)


def row_chunk(case: Case, heads: int) -> int:
    """Query rows per chunk so that a chunk of a (B, heads, rows, Lk) tensor stays small."""
    per_row = case.batch * heads * case.seqlen_k
    return max(1, min(case.seqlen_q, CHUNK_ELEMENTS // per_row))


def _ranking_score(case: Case, bias: torch.Tensor | None, gen, device) -> torch.Tensor:
    """(B or 1, Hk or 1, Lq or 1, Lk) scores that topk ranks keys by."""
    if bias is None:
        return torch.randn(case.batch, case.heads_kv, 1, case.seqlen_k, generator=gen,
                           device=device, dtype=torch.float32)
    if bias.shape[1] == case.heads_q and case.heads_q != case.heads_kv:
        group = case.heads_q // case.heads_kv
        b, _, lq, lk = bias.shape
        return bias.view(b, case.heads_kv, group, lq, lk).amax(dim=2)
    return bias


def _topk_rows(score: torch.Tensor, visible: torch.Tensor, case: Case, r0: int, r1: int) -> torch.Tensor:
    b, h, lq, lk = case.batch, case.heads_kv, r1 - r0, case.seqlen_k
    rows = score[:, :, r0:r1] if score.shape[2] != 1 else score
    if case.window >= lk:
        return visible.expand(b, h, lq, lk)
    chunk = rows.expand(b, h, lq, lk).float().masked_fill(~visible, float("-inf"))
    index = chunk.topk(case.window, dim=-1, sorted=False).indices
    keep = torch.zeros(b, h, lq, lk, dtype=torch.bool, device=score.device)
    keep.scatter_(-1, index, True)
    # With fewer visible keys than the window, topk also picks -inf keys; drop them.
    return keep & visible


def _smooth_blocks(keep: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    b, h, lq, lk = keep.shape
    blocks = -(-lk // BLOCK_KEYS)
    padded = torch.zeros(b, h, lq, blocks * BLOCK_KEYS, dtype=torch.int32, device=keep.device)
    padded[..., :lk] = keep
    chosen = padded.view(b, h, lq, blocks, BLOCK_KEYS).sum(-1)
    sizes = torch.full((blocks,), BLOCK_KEYS, dtype=torch.int32, device=keep.device)
    sizes[-1] = lk - (blocks - 1) * BLOCK_KEYS
    kept_blocks = 2 * chosen > sizes
    return kept_blocks.repeat_interleave(BLOCK_KEYS, dim=-1)[..., :lk] & visible


def _sliding_rows(case: Case, r0: int, r1: int, device) -> torch.Tensor:
    cols = torch.arange(case.seqlen_k, device=device)[None, :]
    if case.causal:
        last = torch.arange(r0, r1, device=device)[:, None] + (case.seqlen_k - case.seqlen_q)
    else:
        last = torch.full((r1 - r0, 1), case.seqlen_k - 1, device=device)
    return (cols <= last) & (cols > last - case.window)


def _sparse_tiles(case: Case, gen, device) -> torch.Tensor:
    """(B, Hk, query blocks, key blocks) bool: ``ceil(window / SPARSE_TILE)`` random key blocks
    per query block, among those its last row can see (all of them without causality)."""
    row_blocks = -(-case.seqlen_q // SPARSE_TILE)
    key_blocks = -(-case.seqlen_k // SPARSE_TILE)
    score = torch.rand(case.batch, case.heads_kv, row_blocks, key_blocks, generator=gen,
                       device=device)
    if case.causal:
        last_row = torch.clamp(torch.arange(1, row_blocks + 1, device=device) * SPARSE_TILE,
                               max=case.seqlen_q) - 1
        last_key = last_row + (case.seqlen_k - case.seqlen_q)
        first_key = torch.arange(key_blocks, device=device) * SPARSE_TILE
        seen = first_key[None, :] <= last_key[:, None]
        score = score.masked_fill(~seen, -1.0)  # never outranks a visible block
    count = min(key_blocks, -(-case.window // SPARSE_TILE))
    tiles = torch.zeros_like(score, dtype=torch.bool)
    tiles.scatter_(-1, score.topk(count, dim=-1, sorted=False).indices, True)
    return tiles


def _tile_rows(tiles: torch.Tensor, visible: torch.Tensor, case: Case, r0: int, r1: int):
    rows = tiles[:, :, torch.arange(r0, r1, device=tiles.device) // SPARSE_TILE]
    return rows.repeat_interleave(SPARSE_TILE, dim=-1)[..., :case.seqlen_k] & visible


def _bool_mask(case: Case, source: MaskSource, device) -> torch.Tensor:
    heads = 1 if case.mask == "document" else case.heads_kv
    mask = torch.empty(case.batch, heads, case.seqlen_q, case.seqlen_k, dtype=torch.bool,
                       device=device)
    step = row_chunk(case, heads)
    for r0 in range(0, case.seqlen_q, step):
        r1 = min(case.seqlen_q, r0 + step)
        rows = torch.arange(r0, r1, device=device)
        if case.mask == "document":
            mask[:, :, r0:r1] = source.documents.rows(rows, case.causal)
            continue
        visible = causal_rows(rows, case)
        if case.mask == "sliding":
            chunk = _sliding_rows(case, r0, r1, device)
        elif case.mask == "block_sparse":
            chunk = _tile_rows(source.tiles, visible, case, r0, r1)
        else:
            chunk = _topk_rows(source.score, visible, case, r0, r1)
            if case.mask == "block_topk":
                chunk = _smooth_blocks(chunk.expand(case.batch, heads, r1 - r0, case.seqlen_k),
                                       visible)
        mask[:, :, r0:r1] = chunk
    return mask


def _random_mask(case: Case, gen, device) -> torch.Tensor:
    shape = shape_from_tokens(case.mask_shape, case)
    mask = torch.rand(shape, generator=gen, device=device) < 0.5
    if shape[2] > 1:
        mask[:, :, 1::4] = False
    return mask


def sliding_intervals(case: Case, device):
    """The sliding mask as ``KeyIntervals`` (1, 1, Lk): key j is seen by rows
    [j - (Lk - Lq), j - (Lk - Lq) + window) with causality, else by every row when it is one of
    the last ``window`` keys (the bool mask's rows, solved for the row)."""
    from kernels import KeyIntervals

    keys = torch.arange(case.seqlen_k, device=device)
    if case.causal:
        start = keys - (case.seqlen_k - case.seqlen_q)
        end = start + case.window
    else:
        start = torch.zeros_like(keys)
        end = torch.where(keys >= case.seqlen_k - case.window, case.seqlen_q, 0)
    start, end = start.clamp(0, case.seqlen_q), end.clamp(0, case.seqlen_q)
    return KeyIntervals(start.to(torch.int32)[None, None], end.to(torch.int32)[None, None])


def draw_source(case: Case, bias: torch.Tensor | None, gen, device) -> MaskSource:
    """The random draws of the case's mask, from ``gen`` (the documents from their own)."""
    if case.mask in ("topk", "block_topk"):
        return MaskSource(score=_ranking_score(case, bias, gen, device))
    if case.mask == "block_sparse":
        return MaskSource(tiles=_sparse_tiles(case, gen, device))
    if case.mask == "random":
        return MaskSource(mask=_random_mask(case, gen, device))
    if case.mask == "document":
        return MaskSource(documents=case_documents(case))
    return MaskSource()


@dataclass(frozen=True)
class MaskBuilder:
    name: str  # what the build is, as the CSV's detail names it
    build: Callable[[], object]  # returns a bool tensor, KeyIntervals or a PackedLayout


BOOL_BUILDS = {"topk": "torch.topk+scatter", "block_topk": "torch.topk+scatter+blocks",
               "block_sparse": "tiles to mask", "sliding": "sliding mask",
               "document": "document mask"}
INTERVAL_BUILDS = {"topk": "topk_intervals", "sliding": "sliding intervals",
                   "document": "document intervals"}


def mask_builder(case: Case, source: MaskSource, device) -> MaskBuilder | None:
    """The build of the case's mask in its format from ``source``; None when nothing is built
    (no mask, or a random mask, which is its own draw)."""
    if case.mask in ("none", "random"):
        return None
    if case.mask_format == "varlen":
        return MaskBuilder("cu_seqlens", lambda: source.documents.packed(device))
    if case.mask_format == "bool":
        return MaskBuilder(BOOL_BUILDS[case.mask], lambda: _bool_mask(case, source, device))
    if case.mask == "topk":
        from kernels import topk_intervals

        def build():
            return topk_intervals(source.score, case.window, seqlen_q=case.seqlen_q,
                                  is_causal=case.causal)
    elif case.mask == "sliding":
        def build():
            return sliding_intervals(case, device)
    else:
        def build():
            return source.documents.intervals(case.causal, device)
    return MaskBuilder(INTERVAL_BUILDS[case.mask], build)
