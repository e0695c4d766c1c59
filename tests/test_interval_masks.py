"""``KeyIntervals`` masks through the Triton kernels: forward, backward (general and packed),
bias gradient, GQA, causal, prepared, against the float64 reference given the same intervals,
and against the same call with the intervals' dense bool mask. Tile skipping comes from the
intervals' per-block bounds, never from an (Lq, Lk) pass."""

from __future__ import annotations

import pytest
import torch

from attn_helpers import (Dims, assert_close_to_reference, assert_empty_rows_and_finite,
                          assert_grads_close_to_reference, backward_schedule, forcing, grads_of,
                          random_bias, random_intervals, random_qkv)
from kernels import KeyIntervals, attention_reference, dmattn_func, prepare_mask
from kernels.planning.activity import interval_activity, tile_activity
from kernels.planning.inputs import check_inputs

CAUSAL = (pytest.param(False, id="full"), pytest.param(True, id="causal"))
# (dims, interval heads: "1", "Hk" or "Hq", interval batch: "1" or "B")
SHAPES = [
    pytest.param(Dims(2, 17, 33, heads_q=4, heads_kv=2, head_dim=16), "Hk", "B", id="gqa"),
    pytest.param(Dims(1, 97, 40, heads_q=2, heads_kv=1, head_dim=40), "1", "1", id="lq>lk"),
    pytest.param(Dims(2, 33, 70, heads_q=4, heads_kv=4, head_dim=16), "Hq", "1", id="mha"),
    pytest.param(Dims(1, 1, 130, heads_q=8, heads_kv=2, head_dim=16), "Hk", "1", id="decode"),
    pytest.param(Dims(1, 3, 65, heads_q=6, heads_kv=2, head_dim=16), "Hq", "1", id="lq3-packed"),
]


def _check(name, got, truth, low, dtype):
    assert torch.isfinite(got).all(), f"{name} has NaN or Inf"
    assert_close_to_reference(name, got, truth, low, dtype)


@pytest.mark.parametrize("dims,heads,batch", SHAPES)
@pytest.mark.parametrize("causal", CAUSAL)
def test_intervals_forward_and_backward_match_the_reference(dims, heads, batch, causal,
                                                             device):
    dtype = torch.float16
    q, k, v = random_qkv(dims, dtype, device)
    bias = random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), dtype, device)
    intervals = random_intervals(dims, heads, batch, device)
    out, lse = dmattn_func(q, k, v, intervals, bias, causal, return_lse=True)
    ref_out, ref_lse = attention_reference(q, k, v, intervals, bias, causal, return_lse=True)
    low_out, low_lse = attention_reference(q, k, v, intervals, bias, causal, return_lse=True,
                                           upcast=False)
    assert_empty_rows_and_finite(out, ref_lse=ref_lse, lse=lse)
    _check("out", out, ref_out, low_out, dtype)
    assert_close_to_reference("lse", lse, ref_lse, low_lse, dtype)  # -inf on empty rows

    grad_out = torch.randn(q.shape, device=device).to(dtype)
    assert_grads_close_to_reference(q, k, v, intervals, bias, causal, grad_out, dtype)


@pytest.mark.parametrize("dims,heads,batch", SHAPES[:2] + SHAPES[3:4])
def test_intervals_give_the_dense_masks_bits(dims, heads, batch, device):
    """The same call with the intervals' dense bool mask: the same outputs and gradients, bit
    for bit (deterministic), whichever tiles each one's activity map counts."""
    q, k, v = random_qkv(dims, torch.float32, device)
    bias = random_bias(dims.operand_shape("1", "Hk", "1", "Lk"), torch.float32, device)
    intervals = random_intervals(dims, heads, batch, device, seed=1)
    dense = intervals.to_dense(dims.seqlen_q)
    grad_out = torch.randn(q.shape, device=device)
    runs = [grads_of(dmattn_func, q, k, v, mask, bias, True, None, grad_out,
                     deterministic=True) for mask in (intervals, dense)]
    for (name, a), (_, b) in zip(runs[0].named(), runs[1].named()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("route", ("fused", "dq+dkdv"))
def test_intervals_on_each_general_backward_route(route, device):
    dims = Dims(1, 40, 70, heads_q=4, heads_kv=2, head_dim=16)
    dtype = torch.bfloat16
    q, k, v = random_qkv(dims, dtype, device)
    bias = random_bias(dims.operand_shape("1", "Hk", "1", "Lk"), dtype, device)
    intervals = random_intervals(dims, "Hk", "1", device, seed=2)
    options = {"backward": route, "dkdv_head_shares": 2}
    assert backward_schedule(q, k, v, intervals, bias, True,
                             kernel_options=options).route.value == route
    grad_out = torch.randn(q.shape, device=device).to(dtype)
    got = grads_of(forcing(**options), q, k, v, intervals, bias, True, None, grad_out)
    upcast = [t.float() for t in (q, k, v, bias)]
    truth = grads_of(attention_reference, *upcast[:3], intervals, upcast[3], True, None,
                     grad_out.double())
    low = grads_of(attention_reference, q, k, v, intervals, bias, True, None, grad_out,
                   upcast=False)
    for (name, a), (_, t), (_, lo) in zip(got.named(), truth.named(), low.named()):
        _check(name, a, t, lo, dtype)


def test_prepared_intervals(device):
    """prepare_mask takes KeyIntervals; calls with it give the unprepared call's bits."""
    dims = Dims(2, 33, 47, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    intervals = random_intervals(dims, "Hk", "B", device, seed=3)
    prepared = prepare_mask(intervals, q, k, is_causal=True)
    grad_out = torch.randn(q.shape, device=device)
    runs = [grads_of(dmattn_func, q, k, v, mask, None, True, None, grad_out)
            for mask in (prepared, intervals)]
    for (name, a), (_, b) in zip(runs[0].named(), runs[1].named()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("causal", CAUSAL)
def test_interval_activity_never_misses_a_pair_and_full_is_exact(causal, device):
    """Against the bool mask's own activity pass: every tile with a visible pair is active,
    and a tile is full exactly where the dense mask's is."""
    dims = Dims(2, 70, 90, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    intervals = random_intervals(dims, "Hk", "B", device, seed=4)
    # Whole blocks of keys visible to every row make full tiles.
    intervals = KeyIntervals(intervals.start.clone(), intervals.end.clone())
    intervals.start[..., 16:48] = 0
    intervals.end[..., 16:48] = dims.seqlen_q
    dense = intervals.to_dense(dims.seqlen_q)
    by_intervals = interval_activity(check_inputs(q, k, v, intervals, None, None).mask, dims,
                                     16, 16, causal).active
    by_mask = tile_activity(check_inputs(q, k, v, dense, None, None).mask, dims, 16, 16,
                            causal).active
    assert by_intervals.shape == by_mask.shape
    assert ((by_mask > 0) <= (by_intervals > 0)).all()
    assert torch.equal(by_intervals == 2, by_mask == 2)
    assert (by_mask == 2).any()


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("sub_rows,sub_cols", [(16, 16), (16, 32), (32, 16)])
def test_interval_activity_kernel_follows_the_block_bounds(causal, sub_rows, sub_cols, device):
    """The one-launch activity map equals the tests of ``IntervalBlockBounds.tiles`` applied to
    the causally narrowed intervals, tile for tile (Lq and Lk not multiples of the tiles)."""
    dims = Dims(2, 75, 93, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    drawn = random_intervals(dims, "Hq", "B", device, seed=6)
    start, end = drawn.start.clone(), drawn.end.to(drawn.start.dtype)
    # Head 0: whole blocks visible to every row, then whole blocks of empty intervals.
    start[:, 0, :64], end[:, 0, :64] = 0, dims.seqlen_q
    end[:, 0, 64:] = start[:, 0, 64:]
    intervals = KeyIntervals(start, end)
    got = interval_activity(check_inputs(q, k, v, intervals, None, None).mask, dims,
                            sub_rows, sub_cols, causal).active
    start, end = intervals.start.long(), intervals.end.long()
    if causal:
        start = torch.maximum(start, torch.arange(dims.seqlen_k, device=start.device)
                              - (dims.seqlen_k - dims.seqlen_q))
    active, full = KeyIntervals(start, end).block_bounds(sub_cols).tiles(sub_rows,
                                                                          dims.seqlen_q)
    whole_rows = (torch.arange(1, active.shape[-2] + 1, device=active.device) * sub_rows
                  <= dims.seqlen_q)[:, None]
    expected = active.to(torch.int8) + (active & full & whole_rows).to(torch.int8)
    assert (expected == 2).any() and (expected == 0).any() and (expected == 1).any()
    assert torch.equal(got, expected)


def test_intervals_keep_their_preparation_for_later_calls(device):
    """A first call with new intervals prepares nothing; the second prepares them, and a third
    reuses its lists and plan (no mask work); a call of another shape is another form; a write
    into start makes the next call read the new intervals; results equal those of fresh
    intervals throughout."""
    dims = Dims(1, 40, 50, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    intervals = random_intervals(dims, "Hk", "1", device, seed=7)
    first = dmattn_func(q, k, v, intervals, None, True)
    assert list(intervals._preparations.values()) == [None]
    second = dmattn_func(q, k, v, intervals, None, True)
    (prepared,) = intervals._preparations.values()
    assert prepared is not None
    plans = dict(prepared.plans)
    third = dmattn_func(q, k, v, intervals, None, True)
    assert torch.equal(first, second) and torch.equal(first, third)
    assert list(intervals._preparations.values()) == [prepared]
    assert prepared.plans == plans, "the third call made a new plan"
    fresh = KeyIntervals(intervals.start.clone(), intervals.end.clone())
    assert torch.equal(dmattn_func(q, k, v, fresh, None, True), first)

    dmattn_func(q[:, :20], k, v, intervals, None, True)
    assert len(intervals._preparations) == 2

    intervals.start[..., :25] = dims.seqlen_q  # the first 25 keys are seen by no row now
    changed = dmattn_func(q, k, v, intervals, None, True)
    truth = attention_reference(q, k, v, intervals, None, True)
    low = attention_reference(q, k, v, intervals, None, True, upcast=False)
    _check("out after a write", changed, truth, low, torch.float16)
    assert not torch.equal(changed, first)


def test_intervals_are_never_made_dense(device):
    """No (Lq, Lk) tensor anywhere in a call: the largest allocation is O(Lk) per head, or the
    outputs and the activity map."""
    from attn_helpers import AllocationWatch

    dims = Dims(1, 200, 210, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    intervals = random_intervals(dims, "Hk", "1", device, seed=5)
    with AllocationWatch() as watch:
        dmattn_func(q, k, v, intervals, None, True)
    assert watch.largest_fresh_bytes() < dims.seqlen_q * dims.seqlen_k
