"""Mask and bias generation (the sweep mask kinds) and the active-pair count behind active TFLOP/s."""

from __future__ import annotations

import pytest
import torch

from dmbench.case import BIAS_KINDS, Case, shape_from_tokens
from dmbench.masks import BLOCK_KEYS, SPARSE_TILE
from dmbench.problem import make_problem

CPU = torch.device("cpu")
LENGTHS = ((17, 97), (97, 97), (40, 17))  # Lq < Lk, square, Lq > Lk (empty causal rows)
WINDOWS = (1, 8, 200)  # 200 exceeds every Lk here: keep everything visible


def _visible(case: Case) -> torch.Tensor:
    from kernels.reference import causal_keep

    if case.causal:
        return causal_keep(case.seqlen_q, case.seqlen_k, CPU)
    return torch.ones(case.seqlen_q, case.seqlen_k, dtype=torch.bool)


def _case(lq, lk, window, mask, causal=True, bias="kv_row", heads=(4, 2)) -> Case:
    return Case(2, heads[0], heads[1], lq, lk, 16, window, causal, "fp32", mask, bias=bias, seed=3)


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", (True, False))
def test_topk_keeps_the_largest_visible_bias(lengths, window, causal):
    case = _case(*lengths, window, "topk", causal)
    p = make_problem(case, CPU)
    visible = _visible(case)
    assert p.mask.shape == (2, 2, *lengths) and p.mask.dtype == torch.bool
    assert not (p.mask & ~visible).any()
    per_row = p.mask.sum(-1)
    assert torch.equal(per_row, visible.sum(-1).clamp(max=window).expand_as(per_row))
    # Every kept key outranks every visible dropped key of its row (kv_row bias: same for all rows).
    score = p.bias.float().expand(2, 2, *lengths)
    kept_min = score.masked_fill(~p.mask, float("inf")).amin(-1)
    dropped_max = score.masked_fill(p.mask | ~visible, float("-inf")).amax(-1)
    assert (kept_min >= dropped_max).all()


def test_topk_ranks_q_full_bias_by_group_max_and_no_bias_by_its_own_score():
    case = _case(9, 30, 4, "topk", bias="q_full")
    p = make_problem(case, CPU)
    assert p.mask.shape == (2, 2, 9, 30)
    assert torch.equal(p.mask.sum(-1), _visible(case).sum(-1).clamp(max=4).expand(2, 2, 9))
    unbiased = make_problem(_case(9, 30, 4, "topk", bias="none"), CPU)
    assert unbiased.bias is None and unbiased.mask.sum() > 0


def test_block_topk_keeps_whole_blocks_chosen_by_majority():
    case = _case(5, 3 * BLOCK_KEYS + 10, 150, "block_topk", causal=False)
    p = make_problem(case, CPU)
    topk = make_problem(Case(**{**case.__dict__, "mask": "topk"}), CPU).mask
    lk = case.seqlen_k
    for start in range(0, lk, BLOCK_KEYS):
        stop = min(lk, start + BLOCK_KEYS)
        block = p.mask[..., start:stop]
        chosen = topk[..., start:stop].sum(-1)
        expect = 2 * chosen > (stop - start)
        assert torch.equal(block.all(-1), expect) and torch.equal(block.any(-1), expect)


@pytest.mark.parametrize("window,fraction", ((1, 1 / 4), (SPARSE_TILE + 1, 2 / 4), (10**6, 1.0)))
def test_block_sparse_keeps_whole_random_tiles_at_an_exact_fraction(window, fraction):
    lq, lk = 3 * SPARSE_TILE - 5, 4 * SPARSE_TILE  # a partial last query block
    case = _case(lq, lk, window, "block_sparse", causal=False, bias="none")
    p = make_problem(case, CPU)
    tiles = p.mask[..., ::SPARSE_TILE, ::SPARSE_TILE]
    # Whole tiles: every element equals its tile's corner.
    whole = tiles.repeat_interleave(SPARSE_TILE, -2).repeat_interleave(SPARSE_TILE, -1)
    assert torch.equal(p.mask, whole[..., :lq, :lk])
    assert (tiles.sum(-1) == round(fraction * 4)).all()
    assert p.active_fraction == pytest.approx(fraction)
    if fraction < 1:  # random per (batch, KV head, query block), not one pattern for all
        assert len({tuple(t.tolist()) for t in tiles.reshape(-1, 4)}) > 1


def test_block_sparse_causal_picks_only_blocks_its_rows_can_see():
    lq = lk = 4 * SPARSE_TILE
    case = _case(lq, lk, 2 * SPARSE_TILE, "block_sparse", causal=True, bias="none")
    p = make_problem(case, CPU)
    assert not (p.mask & ~_visible(case)).any()
    tiles = p.mask.view(2, 2, 4, SPARSE_TILE, 4, SPARSE_TILE).any(-1).any(-2)
    # Query block 0 sees one key block; the others have two of the visible ones.
    assert torch.equal(tiles.sum(-1), torch.tensor([1, 2, 2, 2]).expand(2, 2, 4))


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_is_the_most_recent_visible_keys(lengths, window):
    case = _case(*lengths, window, "sliding")
    p = make_problem(case, CPU)
    lq, lk = lengths
    for i in range(lq):
        last = i + lk - lq
        expect = [max(0, last - window + 1) <= j <= last for j in range(lk)]
        assert p.mask[0, 0, i].tolist() == expect


@pytest.mark.parametrize("shape", ("1x1x1xLk", "BxHqxLqx1", "1xHkxLqxLk"))
def test_random_mask_shape_and_empty_rows(shape):
    case = Case(2, 4, 2, 9, 13, 16, None, False, "bf16", "random", shape, "none", 0)
    p = make_problem(case, CPU)
    assert tuple(p.mask.shape) == shape_from_tokens(shape, case)
    if p.mask.shape[2] > 1:
        assert not p.mask[:, :, 1::4].any()


@pytest.mark.parametrize("kind", sorted(BIAS_KINDS))
def test_bias_kinds_have_their_shapes(kind):
    case = Case(2, 4, 2, 5, 7, 16, None, False, "bf16", "none", bias=kind)
    p = make_problem(case, CPU, requires_grad=True)
    if BIAS_KINDS[kind] is None:
        assert p.bias is None
    else:
        assert tuple(p.bias.shape) == shape_from_tokens(BIAS_KINDS[kind], case)
        assert p.bias.dtype == torch.bfloat16 and p.bias.requires_grad


@pytest.mark.parametrize("mask", ("none", "topk", "block_sparse", "sliding", "random"))
def test_kept_pairs_counts_mask_and_causality(mask):
    case = _case(17, 40, 6, mask) if mask != "random" else Case(2, 4, 2, 17, 40, 16, None, True, "fp32", "random", "1xHkxLqxLk")
    p = make_problem(case, CPU)
    keep = _visible(case).expand(2, 4, 17, 40)
    if p.mask is not None:
        heads = p.mask.shape[1]
        index = torch.arange(4) // (4 // heads)
        keep = keep & p.mask.expand(2, heads, 17, 40)[:, index]
    assert p.kept_pairs == int(keep.sum())
    assert 0 < p.active_fraction <= 1


def test_same_seed_same_inputs():
    case = _case(9, 30, 4, "topk")
    a, b = make_problem(case, CPU), make_problem(case, CPU)
    assert torch.equal(a.q, b.q) and torch.equal(a.mask, b.mask) and torch.equal(a.bias, b.bias)


@pytest.mark.parametrize("batch,heads,seqlen,skipped", [
    (1, 16, 16384, True),    # 15 * 16384**2 wraps int32: the H100 seqlen sweep's fault
    (1, 8, 16384, False),    # 7 * 16384**2 < 2**31
    (1, 2, 32768, False),    # the window sweep's largest case ran fine
    (2, 2, 32768, False),    # its batch stride (2**31) arrives as int64
    (1, 1, 65536, True),     # one (Lq, Lk) plane is already past 2**31
])
def test_fdma_skips_cases_whose_offsets_wrap_int32(batch, heads, seqlen, skipped):
    from dmbench.backends.fdma import FdmaBackend

    case = Case(batch, heads, heads, seqlen, seqlen, 64, causal=True, mask="topk", window=32)
    reason = FdmaBackend().skip_reason(case)
    assert (reason is not None) == skipped
    assert reason is None or "32 bits" in reason
