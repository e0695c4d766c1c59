"""KeyIntervals: validation, the dense mask it stands for, the kernel operand and the per-block
bounds that decide tile activity. Everything is checked against the definition (row i sees key
j iff start <= i < end) evaluated element by element."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import KeyIntervals
from kernels.masks.intervals import most_kept_in_a_row
from kernels.runtime.arith import INT32_MAX, INT32_MIN

INDEX_DTYPES = (pytest.param(torch.int32, id="int32"), pytest.param(torch.int64, id="int64"))
SEQLEN_Q = (1, 17, 97)
SEQLEN_K = (1, 17, 97)
BLOCK_N = (1, 16, 64)
BLOCK_M = (1, 16, 64)


def random_intervals(shape, seqlen_q, dtype=torch.int64, device="cpu") -> KeyIntervals:
    """Starts and ends drawn around [0, seqlen_q], so some intervals are empty, some start
    before row 0 and some end past the last row."""
    start = torch.randint(-3, seqlen_q + 3, shape, device=device)
    end = start + torch.randint(-2, seqlen_q + 2, shape, device=device)
    return KeyIntervals(start.to(dtype), end.to(dtype))


def dense_by_definition(intervals: KeyIntervals, seqlen_q: int) -> torch.Tensor:
    bm, hm, lk = intervals.shape
    keep = torch.zeros(bm, hm, seqlen_q, lk, dtype=torch.bool)
    for b in range(bm):
        for h in range(hm):
            for j in range(lk):
                lo, hi = int(intervals.start[b, h, j]), int(intervals.end[b, h, j])
                for i in range(seqlen_q):
                    keep[b, h, i, j] = lo <= i < hi
    return keep


# -- construction
def test_construction_rejects_bad_tensors():
    good = torch.zeros(1, 2, 5, dtype=torch.int32)
    cases = [
        ((good.tolist(), good), TypeError, "KeyIntervals start must be a torch.Tensor"),
        ((good.float(), good), TypeError, "KeyIntervals start dtype"),
        ((good, good.bool()), TypeError, "KeyIntervals end dtype"),
        ((good, good.to(torch.int16)), TypeError, "KeyIntervals end dtype"),
        ((good[0], good[0]), ValueError, "KeyIntervals start must be 3-D"),
        ((good[..., :0], good[..., :0]), ValueError, "KeyIntervals start must not be empty"),
        ((good, good[..., :4]), ValueError, "one shape"),
        ((good, torch.zeros(1, 2, 5, dtype=torch.int32, device="meta")), ValueError,
         "one device"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            KeyIntervals(*args)


def test_is_immutable_and_mixes_int_dtypes():
    intervals = KeyIntervals(torch.zeros(2, 1, 3, dtype=torch.int32),
                             torch.ones(2, 1, 3, dtype=torch.int64))
    assert intervals.shape == (2, 1, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        intervals.start = intervals.end


@pytest.mark.parametrize("batch_axis", (1, 2))
@pytest.mark.parametrize("heads_axis", (1, 2, 6))
def test_check_against_accepts_the_broadcast_sizes(batch_axis, heads_axis):
    intervals = random_intervals((batch_axis, heads_axis, 9), 4)
    divisor = intervals.check_against(batch=2, heads_q=6, heads_kv=2, seqlen_q=4, seqlen_k=9)
    assert divisor == 6 // heads_axis


@pytest.mark.parametrize("shape, message", (
    ((3, 1, 9), r"attn_mask.start dimension 0 \(batch\) must be one of \[1, 2\]"),
    ((1, 4, 9), r"attn_mask.start dimension 1 \(heads\) must be one of \[1, 2, 6\]"),
    ((1, 1, 8), r"attn_mask.start dimension 2 \(seqlen_k\) must be 9"),
))
def test_check_against_names_the_argument(shape, message):
    intervals = random_intervals(shape, 4)
    with pytest.raises(ValueError, match=message):
        intervals.check_against(batch=2, heads_q=6, heads_kv=2, seqlen_q=4, seqlen_k=9)


def test_check_against_names_the_device():
    intervals = random_intervals((1, 1, 9), 4)
    with pytest.raises(ValueError, match="attn_mask must be on query's device meta"):
        intervals.check_against(batch=1, heads_q=1, heads_kv=1, seqlen_q=4, seqlen_k=9,
                                device="meta")


# -- the dense mask
@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("seqlen_q", SEQLEN_Q)
def test_to_dense_follows_the_definition(dtype, seqlen_q):
    intervals = random_intervals((2, 3, 17), seqlen_q, dtype)
    dense = intervals.to_dense(seqlen_q)
    assert dense.dtype == torch.bool and dense.shape == (2, 3, seqlen_q, 17)
    assert torch.equal(dense, dense_by_definition(intervals, seqlen_q))


# -- the kernel operand
def test_kernel_operand_layout():
    """Pairs in rows of an even number of keys: 17 keys sit 18 pairs apart, 16 keys 16."""
    for keys, row in ((16, 16), (17, 18)):
        intervals = random_intervals((2, 3, keys), 9)
        operand = intervals.kernel_operand()
        assert operand.dtype == torch.int32 and operand.shape == (2, 3, keys, 2)
        assert operand.stride() == (3 * row * 2, row * 2, 2, 1)
    assert torch.equal(operand[..., 0], intervals.start.clamp(0, INT32_MAX).int())
    assert torch.equal(operand[..., 1], intervals.end.clamp(0, INT32_MAX).int())


def test_kernel_operand_keeps_the_meaning_of_values_outside_int32():
    big = 2**40
    start = torch.tensor([[[-big, -big, 0, big, 3, -5, 2]]])
    end = torch.tensor([[[big, -big + 1, big, big + 5, 2, 4, 3]]])
    intervals = KeyIntervals(start, end)
    operand = intervals.kernel_operand()
    again = KeyIntervals(operand[..., 0], operand[..., 1])
    assert torch.equal(again.to_dense(6), intervals.to_dense(6))


@pytest.mark.parametrize("broadcast, expected", (
    ("batch", (1, 3)),
    ("heads", (2, 1)),
    ("both", (1, 1)),
    ("start_only", (2, 3)),  # end has its own rows: nothing to collapse
))
def test_kernel_operand_collapses_axes_broadcast_in_both(broadcast, expected):
    row = torch.randint(0, 9, (1, 1, 17))
    full = torch.randint(0, 9, (2, 3, 17))
    views = {
        "batch": (torch.randint(0, 9, (1, 3, 17)).expand(2, 3, 17),) * 2,
        "heads": (torch.randint(0, 9, (2, 1, 17)).expand(2, 3, 17),) * 2,
        "both": (row.expand(2, 3, 17), (row + 4).expand(2, 3, 17)),
        "start_only": (row.expand(2, 3, 17), full),
    }
    intervals = KeyIntervals(*views[broadcast])
    operand = intervals.kernel_operand()
    assert tuple(operand.shape[:2]) == expected
    dense = KeyIntervals(operand[..., 0], operand[..., 1]).to_dense(9)
    assert torch.equal(dense.expand(2, 3, 9, 17), intervals.to_dense(9))


# -- per-block bounds and tile activity
def bounds_by_definition(intervals: KeyIntervals, block_n: int):
    """(min_start, max_end, max_start, min_end) per key block, element by element."""
    operand = intervals.kernel_operand()
    bm, hm, lk, _ = operand.shape
    blocks = -(-lk // block_n)
    out = torch.zeros(4, bm, hm, blocks, dtype=torch.int64)
    for b in range(bm):
        for h in range(hm):
            for n in range(blocks):
                pairs = [(int(operand[b, h, j, 0]), int(operand[b, h, j, 1]))
                         for j in range(n * block_n, min(lk, (n + 1) * block_n))]
                live = [(s, e) for s, e in pairs if s < e]
                out[:, b, h, n] = torch.tensor([
                    min((s for s, _ in live), default=INT32_MAX),
                    max((e for _, e in live), default=INT32_MIN),
                    max(s for s, _ in pairs),
                    min(e for _, e in pairs),
                ])
    return out


@pytest.mark.parametrize("block_n", BLOCK_N)
@pytest.mark.parametrize("seqlen_k", SEQLEN_K)
def test_block_bounds_follow_the_definition(block_n, seqlen_k):
    drawn = random_intervals((2, 2, seqlen_k), 17)
    # Keys 0..5 empty, so that with 1- and 16-key blocks some block has no live interval.
    end = drawn.end.clone()
    end[..., :6] = drawn.start[..., :6]
    intervals = KeyIntervals(drawn.start, end)
    bounds = intervals.block_bounds(block_n)
    assert bounds.num_blocks == -(-seqlen_k // block_n)
    got = torch.stack([bounds.min_start, bounds.max_end, bounds.max_start, bounds.min_end])
    assert got.dtype == torch.int32
    assert torch.equal(got.long(), bounds_by_definition(intervals, block_n))


def dense_tiles(dense: torch.Tensor, block_m: int, block_n: int):
    """(any visible, every pair visible and block complete) per tile of a dense mask."""
    *lead, lq, lk = dense.shape
    rows, cols = -(-lq // block_m), -(-lk // block_n)
    padded = torch.zeros(*lead, rows * block_m, cols * block_n, dtype=torch.bool)
    padded[..., :lq, :lk] = dense
    inside = torch.zeros(rows * block_m, cols * block_n, dtype=torch.bool)
    inside[:lq, :lk] = True
    tiles = padded.view(*lead, rows, block_m, cols, block_n)
    inside_tiles = inside.view(rows, block_m, cols, block_n)
    any_visible = tiles.any(-1).any(-2)
    complete = torch.tensor([(c + 1) * block_n <= lk for c in range(cols)])
    every = ((tiles | ~inside_tiles).all(-1).all(-2)) & complete
    return any_visible, every


@pytest.mark.parametrize("block_m", BLOCK_M)
@pytest.mark.parametrize("block_n", BLOCK_N)
@pytest.mark.parametrize("seqlen_q", SEQLEN_Q)
def test_tiles_never_miss_a_visible_pair_and_full_is_exact(block_m, block_n, seqlen_q):
    # Wide intervals, so that many tiles are full.
    start = torch.randint(-2, seqlen_q // 3 + 1, (2, 2, 97))
    end = seqlen_q - torch.randint(-2, seqlen_q // 3 + 1, (2, 2, 97))
    intervals = KeyIntervals(start, end)
    active, full = intervals.block_bounds(block_n).tiles(block_m, seqlen_q)
    any_visible, every = dense_tiles(intervals.to_dense(seqlen_q), block_m, block_n)
    assert active.shape == any_visible.shape
    assert not (any_visible & ~active).any(), "a tile with a visible pair was called inactive"
    assert torch.equal(full, every)
    if block_n == 1:  # one interval per block: the activity test is exact
        assert torch.equal(active, any_visible)


def test_tiles_of_a_causal_band():
    lq = lk = 64
    keys = torch.arange(lk)
    intervals = KeyIntervals(keys[None, None], torch.full((1, 1, lk), lq))  # causal
    active, full = intervals.block_bounds(16).tiles(16, lq)
    blocks = torch.arange(4)
    assert torch.equal(active[0, 0], blocks[:, None] >= blocks[None, :])
    assert torch.equal(full[0, 0], blocks[:, None] > blocks[None, :])


@pytest.mark.parametrize("block_n", (0, -1, 2.0, True))
def test_block_bounds_rejects_bad_block_sizes(block_n):
    with pytest.raises(ValueError, match="block_n must be a positive int"):
        random_intervals((1, 1, 5), 3).block_bounds(block_n)


# -- the most keys one row keeps
@pytest.mark.parametrize("seqlen_q", SEQLEN_Q)
def test_most_kept_in_a_row_follows_the_definition(seqlen_q):
    """Starts before row 0, ends past the last row, empty and reversed intervals."""
    torch.manual_seed(seqlen_q)
    for shape in ((2, 3, 17), (1, 1, 97), (1, 2, 1)):
        intervals = random_intervals(shape, seqlen_q)
        expected = int(dense_by_definition(intervals, seqlen_q).sum(-1).max())
        assert most_kept_in_a_row(intervals.start, intervals.end, seqlen_q) == expected
    nothing = torch.zeros(1, 1, 5, dtype=torch.int32)
    assert most_kept_in_a_row(nothing, nothing, seqlen_q) == 0


def test_keeping_subset_carries_the_bounds_and_the_order_only():
    """Intervals rebuilt from narrower rows keep the bounds (max_kept, the most one row keeps)
    and the key order, or the order given; lists and documents tied to the old start and end
    are dropped, and documents given are the new intervals' own."""
    torch.manual_seed(0)
    start = torch.randint(0, 9, (1, 2, 11), dtype=torch.int32)
    end = start + 3
    lists = (torch.zeros(2, 4, dtype=torch.int32), torch.full((2,), 4, dtype=torch.int32))
    old = KeyIntervals(start, end, torch.arange(11).flip(0).expand(1, 2, 11), max_kept=4,
                       _row_kept=3, _kept_lists=lists)
    narrower = old.keeping_subset(start + 1, end)
    assert torch.equal(narrower.start, start + 1) and narrower.end is end
    assert narrower.max_kept == 4 and narrower._row_kept == 3
    assert narrower.key_order is old.key_order
    assert narrower._kept_lists is None and narrower._documents is None
    order = torch.arange(11).expand(1, 2, 11)
    offsets = torch.tensor([0, 11], dtype=torch.int32)
    other = old.keeping_subset(start, end, key_order=order, documents=(offsets, offsets, True))
    assert other.key_order is order
    cu_q, cu_k, causal = other._documents
    assert cu_q is offsets and cu_k is offsets and causal is True
    ordered = KeyIntervals(start, end, max_kept=4, _row_kept=3).with_key_order()
    assert ordered.max_kept == 4 and ordered._row_kept == 3
    assert sorted(ordered.key_order[0, 0].tolist()) == list(range(11))
