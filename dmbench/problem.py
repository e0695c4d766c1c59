"""Inputs for one case, generated on the target device from the case's seed.

Mask kinds, all (B, Hk, Lq, Lk) bool, True = keep:

- ``topk``: for each batch, KV head and query row, keep the ``window`` visible keys with the
  largest ranking score. With a bias the score is the bias (a ``q_full`` bias is reduced to its
  KV head by the max over the group); without one it is an independent seeded (B, Hk, 1, Lk)
  score, i.e. what a ``kv_row`` bias would have been. ``window >=`` visible keys keeps them all.
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
- ``none``: no mask tensor.

Kept entries of the generated masks are always visible under causality, so the active-pair count
is exact. Generation works in row chunks so the float ranking scores never need O(Lq·Lk) memory
at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sweep import Case

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BLOCK_KEYS = 64
# Tile edge of block_sparse masks: FlexAttention's default block size, a multiple of ours.
SPARSE_TILE = 128
# Row chunks for mask generation hold at most this many (batch, head, row, key) scores.
CHUNK_ELEMENTS = 1 << 27


@dataclass
class Problem:
    """Canonical-layout inputs: q (B, Lq, Hq, D), k/v (B, Lk, Hk, D), mask, bias."""

    case: Case
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    bias: torch.Tensor | None
    kept_pairs: int  # kept (batch, query head, i, j) entries after mask and causality

    @property
    def active_fraction(self) -> float:
        c = self.case
        return self.kept_pairs / (c.batch * c.heads_q * c.seqlen_q * c.seqlen_k)


def shape_from_tokens(tokens: str, case: Case) -> tuple[int, int, int, int]:
    sizes = {"1": 1, "B": case.batch, "Hk": case.heads_kv, "Hq": case.heads_q,
             "Lq": case.seqlen_q, "Lk": case.seqlen_k}
    return tuple(sizes[t] for t in tokens.split("x"))


def _causal_rows(r0: int, r1: int, case: Case, device) -> torch.Tensor:
    """Visible-key pattern (rows r0..r1, Lk) for bottom-right causality (all True if not causal)."""
    cols = torch.arange(case.seqlen_k, device=device)[None, :]
    if not case.causal:
        return torch.ones(r1 - r0, case.seqlen_k, dtype=torch.bool, device=device)
    rows = torch.arange(r0, r1, device=device)[:, None]
    return cols <= rows + (case.seqlen_k - case.seqlen_q)


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


def _row_chunk(case: Case) -> int:
    per_row = case.batch * case.heads_kv * case.seqlen_k
    return max(1, min(case.seqlen_q, CHUNK_ELEMENTS // per_row))


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


def _window_mask(case: Case, bias, gen, device) -> torch.Tensor:
    mask = torch.empty(case.batch, case.heads_kv, case.seqlen_q, case.seqlen_k,
                       dtype=torch.bool, device=device)
    score = None
    if case.mask == "block_sparse":
        tiles = _sparse_tiles(case, gen, device)
    elif case.mask != "sliding":
        score = _ranking_score(case, bias, gen, device)
    step = _row_chunk(case)
    for r0 in range(0, case.seqlen_q, step):
        r1 = min(case.seqlen_q, r0 + step)
        visible = _causal_rows(r0, r1, case, device)
        if case.mask == "sliding":
            rows = _sliding_rows(case, r0, r1, device)
        elif case.mask == "block_sparse":
            rows = _tile_rows(tiles, visible, case, r0, r1)
        else:
            rows = _topk_rows(score, visible, case, r0, r1)
            if case.mask == "block_topk":
                rows = _smooth_blocks(rows.expand(case.batch, case.heads_kv, r1 - r0, case.seqlen_k), visible)
        mask[:, :, r0:r1] = rows
    return mask


def _random_mask(case: Case, gen, device) -> torch.Tensor:
    shape = shape_from_tokens(case.mask_shape, case)
    mask = torch.rand(shape, generator=gen, device=device) < 0.5
    if shape[2] > 1:
        mask[:, :, 1::4] = False
    return mask


def _kept_pairs(case: Case, mask: torch.Tensor | None) -> int:
    from .flops import visible_pairs

    if mask is None:
        return case.batch * case.heads_q * visible_pairs(case)
    b, h = mask.shape[:2]
    view = mask.expand(case.batch, h, case.seqlen_q, case.seqlen_k)
    total = 0
    step = _row_chunk(case)
    for r0 in range(0, case.seqlen_q, step):
        r1 = min(case.seqlen_q, r0 + step)
        total += int((view[:, :, r0:r1] & _causal_rows(r0, r1, case, mask.device)).sum())
    return total * (case.heads_q // h)


def make_problem(case: Case, device: torch.device, requires_grad: bool = False) -> Problem:
    """Generate q, k, v, bias and mask for ``case`` on ``device`` from ``case.seed``.

    With ``requires_grad`` the q, k, v and bias tensors are leaves that require grad.
    """
    dtype = TORCH_DTYPES[case.dtype]
    gen = torch.Generator(device=device)
    gen.manual_seed(case.seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    q = randn(case.batch, case.seqlen_q, case.heads_q, case.head_dim)
    k = randn(case.batch, case.seqlen_k, case.heads_kv, case.head_dim)
    v = randn(case.batch, case.seqlen_k, case.heads_kv, case.head_dim)
    bias = randn(*shape_from_tokens(case.bias_shape, case)) if case.bias_shape else None
    if case.mask == "none":
        mask = None
    elif case.mask == "random":
        mask = _random_mask(case, gen, device)
    else:
        mask = _window_mask(case, bias, gen, device)
    if requires_grad:
        for t in (q, k, v, bias):
            if t is not None:
                t.requires_grad_(True)
    return Problem(case, q, k, v, mask, bias, _kept_pairs(case, mask))
