"""Decode's gather route: the forward reads only the keys its mask keeps.

Against the float64 reference (``attn_helpers.run_forward``: empty rows exactly 0 and -inf,
poisoned outputs, no mask copies) with the route forced, on lists of length 0, 1 and all keys,
keys kept by some query rows and not others, odd lengths, GQA/MQA, broadcast mask and bias
shapes, every mask format, and key shares that merge in the launch; and which calls the
schedule sends there by itself.
"""

from __future__ import annotations

import pytest
import torch

from attn_helpers import (AllocationWatch, Dims, assert_close_to_reference,
                          assert_empty_rows_and_finite, forcing, random_bias, random_mask,
                          random_qkv)
from kernels import (KeyIntervals, attention_reference, dmattn_func, prepare_mask, schedule_for,
                     topk_intervals)
from kernels.planning import tuning

GATHER = forcing(forward_route="gather")


def run_forward(q, k, v, mask, bias=None, causal=False, func=GATHER):
    """(out, lse) of ``func`` under an AllocationWatch (fresh outputs poisoned, no mask or bias
    copied), checked against the float64 reference: empty rows exactly 0 and -inf."""
    watched = tuple(t for t in (mask, bias) if isinstance(t, torch.Tensor))
    with AllocationWatch(watched=watched) as watch:
        out, lse = func(q, k, v, mask, bias, causal, None, return_lse=True)
    assert not watch.copies, f"mask or bias copied: {watch.copies}"
    if hasattr(mask, "mask"):  # a PreparedMask: the reference reads the mask it holds
        mask = mask.mask
    ref_out, ref_lse = attention_reference(q, k, v, mask, bias, causal, return_lse=True)
    low_out, low_lse = attention_reference(q, k, v, mask, bias, causal, return_lse=True,
                                           upcast=False)
    assert_empty_rows_and_finite(out, lse, ref_lse)
    assert_close_to_reference("out", out, ref_out, low_out, q.dtype)
    assert_close_to_reference("lse", lse, ref_lse, low_lse, q.dtype)
    return out, lse
DTYPES = (pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float32, id="fp32"))


def topk_mask(dims: Dims, window: int, causal: bool, device, heads: int | None = None):
    """``topk_intervals`` of a random per-key bias (B, heads, 1, Lk), as Doge decodes."""
    heads = dims.heads_kv if heads is None else heads
    selection = torch.randn(dims.batch, heads, 1, dims.seqlen_k, device=device)
    return topk_intervals(selection, window, seqlen_q=dims.seqlen_q, is_causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_topk_intervals_decode_matches_the_reference(device, dtype, causal, rows):
    dims = Dims(2, rows, 300, 4, 2, 40)
    q, k, v = random_qkv(dims, dtype, device)
    mask = topk_mask(dims, 24, causal, device)
    assert schedule_for(q, k, v, mask, is_causal=causal, for_backward=False,
                        kernel_options={"forward_route": "gather"}).forward.route == "gather"
    run_forward(q, k, v, mask, causal=causal, func=GATHER)


@pytest.mark.parametrize("bias_shape", [("B", "Hk", "1", "Lk"), ("1", "1", "Lq", "Lk"),
                                        ("B", "Hq", "Lq", "Lk"), ("1", "Hk", "1", "1")],
                         ids=["kv_row", "shared_full", "full", "per_head"])
def test_a_bias_is_read_at_the_kept_keys(device, bias_shape):
    dims = Dims(2, 3, 97, 4, 2, 16)
    q, k, v = random_qkv(dims, torch.float16, device)
    bias = random_bias(dims.operand_shape(*bias_shape), torch.float16, device)
    mask = topk_mask(dims, 9, True, device)
    run_forward(q, k, v, mask, bias, causal=True, func=GATHER)


@pytest.mark.parametrize("mask_shape", [("B", "Hk", "Lq", "Lk"), ("1", "1", "Lq", "Lk"),
                                        ("B", "Hq", "Lq", "Lk"), ("B", "1", "1", "Lk")],
                         ids=["per_kv_head", "shared", "per_query_head", "one_row"])
@pytest.mark.parametrize("prepared", [False, True], ids=["given", "prepared"])
def test_a_bool_mask_whose_rows_keep_different_keys(device, mask_shape, prepared):
    dims = Dims(2, 5, 129, 6, 2, 16)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    mask = random_mask(dims.operand_shape(*mask_shape), device, keep=0.1)
    given = prepare_mask(mask, q, k, True) if prepared else mask
    run_forward(q, k, v, given, causal=True)


@pytest.mark.parametrize("heads", [(4, 4), (4, 1), (6, 3)], ids=["mha", "mqa", "gqa"])
def test_gqa_and_mqa(device, heads):
    dims = Dims(1, 2, 200, *heads, 16)
    q, k, v = random_qkv(dims, torch.float16, device)
    run_forward(q, k, v, topk_mask(dims, 16, True, device), causal=True, func=GATHER)


def test_a_mask_per_query_head(device):
    dims = Dims(1, 1, 150, 4, 2, 16)
    q, k, v = random_qkv(dims, torch.float16, device)
    mask = topk_mask(dims, 10, True, device, heads=dims.heads_q)
    run_forward(q, k, v, mask, causal=True, func=GATHER)


def test_lists_of_no_key_one_key_and_every_key(device):
    dims = Dims(2, 2, 70, 2, 1, 16)
    q, k, v = random_qkv(dims, torch.float16, device)
    nothing = torch.full((2, 1, 70), 5, dtype=torch.int32, device=device)
    out, lse = run_forward(q, k, v, KeyIntervals(nothing, nothing), func=GATHER)
    assert torch.isneginf(lse).all() and (out == 0).all()
    start = torch.zeros(2, 1, 70, dtype=torch.int32, device=device)
    one = start.clone()
    one[..., 33] = 2  # key 33 alone, seen by rows 0 and 1
    run_forward(q, k, v, KeyIntervals(torch.where(one > 0, 0, 2).to(torch.int32), one),
                func=GATHER)
    run_forward(q, k, v, KeyIntervals(start, start + 2), func=GATHER)  # W = Lk
    run_forward(q, k, v, KeyIntervals(start, start + 2), causal=True, func=GATHER)


def test_odd_lengths_and_fewer_keys_than_rows(device):
    for lq, lk in ((1, 1), (16, 3), (7, 17)):
        dims = Dims(1, lq, lk, 2, 2, 16)
        q, k, v = random_qkv(dims, torch.float16, device)
        mask = topk_mask(dims, 2, True, device)
        run_forward(q, k, v, mask, causal=True, func=GATHER)


def test_key_shares_merge_in_the_launch(device):
    """Long enough lists that the schedule gives them several shares."""
    dims = Dims(1, 1, 600, 2, 1, 16)
    q, k, v = random_qkv(dims, torch.float16, device)
    mask = topk_mask(dims, 300, False, device)
    tile = schedule_for(q, k, v, mask, for_backward=False,
                        kernel_options={"forward_route": "gather"}).forward.gather
    assert tile.key_splits > 1
    run_forward(q, k, v, mask, func=GATHER)


# -- the schedule's choice
def test_the_schedule_takes_the_route_for_a_small_top_w_of_many_keys(device):
    dims = Dims(2, 1, 512, 4, 2, 16)
    q, k, v = random_qkv(dims, torch.float16, device)
    small = topk_mask(dims, 512 // 16, True, device)
    assert small.max_kept == 32
    sched = schedule_for(q, k, v, small, is_causal=True, for_backward=False)
    assert sched.forward.route == "gather" and "forward: route=gather" in str(sched)
    assert sched.forward.gather.capacity == 32
    run_forward(q, k, v, small, causal=True)
    wide = topk_mask(dims, 512 // 4, True, device)
    assert schedule_for(q, k, v, wide, is_causal=True, for_backward=False).forward.route \
        == "triton"


def test_the_route_stays_off_for_gradients_long_queries_and_unbounded_masks(device):
    dims = Dims(1, 1, 512, 2, 2, 16)
    q, k, v = random_qkv(dims, torch.float16, device)
    mask = topk_mask(dims, 8, True, device)
    assert schedule_for(q, k, v, mask, is_causal=True, for_backward=False).forward.route \
        == "gather"
    assert schedule_for(q, k, v, mask, is_causal=True).forward.route == "triton"
    long_dims = Dims(1, tuning.GATHER_MAX_ROWS + 1, 512, 2, 2, 16)
    ql, kl, vl = random_qkv(long_dims, torch.float16, device)
    long_mask = topk_mask(long_dims, 8, True, device)
    assert schedule_for(ql, kl, vl, long_mask, is_causal=True,
                        for_backward=False).forward.route == "triton"
    unbounded = KeyIntervals(mask.start, mask.end)
    assert schedule_for(q, k, v, unbounded, is_causal=True, for_backward=False).forward.route \
        == "triton"


@pytest.mark.parametrize("case, reason", [
    ("no_mask", "the call has no mask"),
    ("long", "at most 16 query rows"),
])
def test_forcing_the_route_where_it_cannot_apply_says_why(device, case, reason):
    rows = 1 if case == "no_mask" else 17
    dims = Dims(1, rows, 64, 2, 2, 16)
    q, k, v = random_qkv(dims, torch.float16, device)
    mask = None if case == "no_mask" else topk_mask(dims, 4, True, device)
    with pytest.raises(ValueError, match=r"'gather' does not cover this call: .*" + reason):
        dmattn_func(q, k, v, mask, kernel_options={"forward_route": "gather"})


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_max_kept_is_a_positive_int(bad):
    start = torch.zeros(1, 1, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="KeyIntervals max_kept must be a positive int"):
        KeyIntervals(start, start + 1, max_kept=bad)


def test_the_gather_route_waits_for_nothing(device):
    """Two launches, no read of device memory by the host (``SyncWatch``), so a CUDA graph can
    replay a decode step."""
    from attn_helpers import SyncWatch

    dims = Dims(1, 1, 256, 2, 1, 16)
    q, k, v = random_qkv(dims, torch.float16, device)
    mask = topk_mask(dims, 8, True, device)
    dmattn_func(q, k, v, mask, is_causal=True)  # plans
    with SyncWatch() as watch:
        dmattn_func(q, k, v, mask, is_causal=True)
    assert not watch.syncs, f"host waits: {watch.syncs}"


def test_a_prepared_decode_mask_counts_its_kept_keys_and_takes_the_route(device):
    dims = Dims(2, 2, 512, 4, 2, 16)
    q, k, v = random_qkv(dims, torch.float16, device)
    few = torch.zeros(2, 2, 2, 512, dtype=torch.bool, device=device)
    few[0, 0, 0, 5:30] = True  # 25 keys by row 0 and 10 more by row 1: a list of 35
    few[0, 0, 1, 20:45] = True
    few[1, 1, 1, 300:340] = True  # 40 keys: the longest list
    prepared = prepare_mask(few, q, k, False)
    assert prepared.kept_keys == 40
    sched = schedule_for(q, k, v, prepared, for_backward=False)
    assert sched.forward.route == "gather" and sched.forward.gather.capacity == 40
    run_forward(q, k, v, prepared, func=dmattn_func)
    many = random_mask((2, 2, 2, 512), device, keep=0.3)
    assert schedule_for(q, k, v, prepare_mask(many, q, k, False),
                        for_backward=False).forward.route == "triton"


def test_prepared_intervals_count_their_kept_keys(device):
    dims = Dims(1, 3, 300, 2, 2, 16)
    q, k, v = random_qkv(dims, torch.float16, device)
    start = torch.full((1, 2, 300), 3, dtype=torch.int32, device=device)
    start[0, 0, 100:110] = 1  # row 1 and 2 of the query rows: 10 keys on head 0
    start[0, 1, 7] = 0
    intervals = KeyIntervals(start, start.new_full(start.shape, 3))
    prepared = prepare_mask(intervals, q, k, True)
    assert prepared.kept_keys == 10
    assert schedule_for(q, k, v, prepared, is_causal=True,
                        for_backward=False).forward.route == "gather"
    run_forward(q, k, v, prepared, causal=True, func=dmattn_func)
