"""Decode's gather route: the forward reads only the keys its mask keeps.

Against the float64 reference (``attn_helpers.run_forward``: empty rows exactly 0 and -inf,
poisoned outputs, no mask copies) with the route forced, on lists of length 0, 1 and all keys,
keys kept by some query rows and not others, odd lengths, GQA/MQA, broadcast mask and bias
shapes, every mask format, and key shares that merge in the launch; and which calls the
schedule sends there by itself.
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch

from attn_helpers import Dims, forcing, random_bias, random_mask, random_qkv
from attn_helpers import run_forward as checked_forward
from kernels import KeyIntervals, dmattn_func, prepare_mask, schedule_for, topk_intervals
from kernels import call_plan
from kernels.planning import tuning

GATHER = forcing(forward_route="gather")


def run_forward(q, k, v, mask, bias=None, causal=False, func=GATHER):
    """(out, lse) of ``func``, checked by ``attn_helpers.run_forward`` (fresh outputs
    poisoned, no mask or bias copied, the float64 reference)."""
    run = checked_forward(q, k, v, mask, bias, causal, func=func)
    return run.out, run.lse
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


def _long_lists(device, heads) -> tuple[Dims, int]:
    """(dims, window) of one decode row whose list spans enough key blocks for several shares
    (64-key blocks on a GPU, 16 interpreted)."""
    seqlen_k, window = (20000, 2400) if device.type == "cuda" else (3000, 300)
    return Dims(1, 1, seqlen_k, *heads, 16), window


def test_key_shares_merge_in_the_launch(device):
    """Long enough lists that the schedule gives them several shares."""
    dims, window = _long_lists(device, heads=(2, 1))
    q, k, v = random_qkv(dims, torch.float16, device)
    mask = topk_mask(dims, window, False, device)
    tile = schedule_for(q, k, v, mask, for_backward=False,
                        kernel_options={"forward_route": "gather"}).forward.gather
    assert tile.key_splits > 1
    run_forward(q, k, v, mask, func=GATHER)


@pytest.mark.parametrize("programs", [1, 7, 64, 132, 500, 528, 529, 4000])
def test_key_shares_fill_whole_waves(programs):
    """The shares never leave a partial last wave: programs x shares fit in
    ``GATHER_PROGRAMS_PER_SM`` per multiprocessor wherever one share a list does."""
    from kernels.planning.gather_decode import gather_splits
    multiprocessors, key_blocks = 132, 512
    slots = tuning.GATHER_PROGRAMS_PER_SM * multiprocessors
    splits = gather_splits(programs, key_blocks, multiprocessors)
    assert splits >= 1
    if programs <= slots:
        assert programs * splits <= slots
        assert programs * (splits + 1) > slots or splits == tuning.MAX_KEY_SPLITS
    else:
        assert splits == 1
    assert gather_splits(programs, 3, multiprocessors) == 1


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


def test_max_kept_of_a_top_w_selection_bounds_the_keys_its_rows_keep_together(device):
    """``topk_intervals``' ``max_kept`` (W + Lq - 1 causal, W not, at most Lk) holds for
    biases with many ties (integers in [0, 4)) and every row count up to 20."""
    rng = random.Random(7)
    for _ in range(12):
        seqlen_q, seqlen_k = rng.randint(1, 20), rng.randint(1, 90)
        window, causal = rng.randint(1, 12), rng.random() < 0.6
        bias = torch.randint(0, 4, (2, 2, 1, seqlen_k), device=device).float()
        chosen = topk_intervals(bias, window, seqlen_q=seqlen_q, is_causal=causal)
        together = chosen.to_dense(seqlen_q).any(dim=2).sum(-1).max().item()
        assert chosen.max_kept == min(seqlen_k, window + seqlen_q - 1 if causal else window)
        assert together <= chosen.max_kept


@pytest.mark.parametrize("rows, causal", [(1, True), (4, False), (4, True), (16, True)],
                         ids=["decode", "q4-full", "q4-causal", "q16-causal"])
def test_a_selection_that_lists_its_keys_spares_the_list_passes(device, monkeypatch, rows,
                                                                 causal):
    """``topk_intervals`` of one window per row, or of a few causal rows off the selection's
    CUDA graphs (``_few_rows``), lists the kept keys as the list passes would: the step
    launches the forward alone, with the bits of the same intervals without lists."""
    if device.type == "cuda" and causal and rows > 1:  # this form would be captured
        monkeypatch.setattr(importlib.import_module("kernels.topk_ops"), "GRAPH_MAX_ELEMENTS", 0)
    from kernels.runtime import launch

    dims = Dims(2, rows, 320, 4, 2, 40)  # lists of 24 + 15 keys: 1/8 of 320
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    bias = random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), torch.bfloat16, device)
    chosen = topk_intervals(bias, 24, seqlen_q=rows, is_causal=causal)
    assert chosen._kept_lists is not None
    bare = KeyIntervals(chosen.start, chosen.end, max_kept=chosen.max_kept)
    launched = []
    original = launch.PlannedLaunch.__call__
    monkeypatch.setattr(launch.PlannedLaunch, "__call__", lambda self, *args: (
        launched.append(self.kernel.__name__), original(self, *args))[1])
    listed = dmattn_func(q, k, v, chosen, bias, causal, return_lse=True)
    assert launched == ["_gather_decode_kernel"]
    launched.clear()
    built = dmattn_func(q, k, v, bare, bias, causal, return_lse=True)
    assert launched == ["_kept_counts_kernel", "_kept_keys_kernel", "_gather_decode_kernel"]
    for a, b in zip(listed, built):
        assert torch.equal(a, b)
    run_forward(q, k, v, chosen, bias, causal=causal, func=dmattn_func)


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
    many = prepare_mask(random_mask((2, 2, 2, 512), device, keep=0.3), q, k, False)
    sched = schedule_for(q, k, v, many, for_backward=False)
    assert sched.forward.route == "gather" and sched.forward.gather.capacity == many.kept_keys


@pytest.mark.parametrize("keep", [0.05, 1.0], ids=["keep5", "keep100"])
def test_a_decode_bool_mask_takes_the_route_prepared_or_not(device, monkeypatch, no_kept_plans,
                                                            keep):
    """Whatever it keeps: read by the call, its list pass counts on the device (lists sized for
    every key); prepared, the same route with lists of its count, and the same bits. With
    gradients, or with the rule off, the tile walk reads it."""
    dims = Dims(2, 1, 512, 4, 2, 16)
    q, k, v = random_qkv(dims, torch.float16, device)
    mask = random_mask((2, 2, 1, 512), device, keep=keep)
    sched = schedule_for(q, k, v, mask, for_backward=False)
    assert sched.forward.route == "gather" and sched.forward.gather.capacity == 512
    out, lse = run_forward(q, k, v, mask, func=dmattn_func)
    prepared = prepare_mask(mask, q, k, False)
    sched = schedule_for(q, k, v, prepared, for_backward=False)
    assert sched.forward.route == "gather"
    assert sched.forward.gather.capacity == prepared.kept_keys
    prepared_out, prepared_lse = run_forward(q, k, v, prepared, func=dmattn_func)
    assert torch.equal(out, prepared_out) and torch.equal(lse, prepared_lse)
    assert schedule_for(q, k, v, mask, for_backward=True).forward.route == "triton"
    monkeypatch.setattr(tuning, "GATHER_TAKES_BOOL_MASKS", False)
    call_plan._mask_plans.clear()  # plans are kept by the mask's form, made under the rule
    assert schedule_for(q, k, v, mask, for_backward=False).forward.route == "triton"
    call_plan._mask_plans.clear()  # none made without the rule outlives the test


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


def _gather_plans(prepared) -> list:
    """The gather plans a prepared mask keeps (one per call signature)."""
    return [kept.plan.gather for kept in prepared.plans.values() if kept.plan.gather]


def test_a_prepared_mask_keeps_its_lists_after_its_first_call(device):
    """A prepared mask cannot change between calls, so its first call keeps the lists it made
    and later calls launch the forward alone, with the same bits; a new mask makes its own."""
    dims = Dims(2, 1, 700, 4, 2, 32)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    bias = torch.randn(2, 2, 1, 700, device=device, dtype=torch.bfloat16)
    chosen = topk_mask(dims, 40, True, device)
    prepared = prepare_mask(chosen.to_dense(1), q, k, True)
    first = run_forward(q, k, v, prepared, bias, causal=True, func=dmattn_func)
    (plan,) = _gather_plans(prepared)
    assert plan.kept_lists is not None
    kept = plan.kept_lists[0].data_ptr()
    again = run_forward(q, k, v, prepared, bias, causal=True, func=dmattn_func)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert plan.kept_lists[0].data_ptr() == kept
    other = prepare_mask(topk_mask(dims, 40, True, device).to_dense(1), q, k, True)
    run_forward(q, k, v, other, bias, causal=True, func=dmattn_func)
    assert _gather_plans(other)[0].kept_lists[0].data_ptr() != kept
    # Intervals used once are read by their call: no plan of theirs keeps lists.
    run_forward(q, k, v, topk_mask(dims, 40, True, device), bias, causal=True,
                func=dmattn_func)


def test_lists_are_not_kept_from_a_call_that_only_compiles(device):
    """Under ``compile_only`` (the warm-up) launches write nothing, so the lists of such a
    call are not kept: the next call makes them."""
    from concurrent.futures import ThreadPoolExecutor

    from kernels.runtime.launch import compile_only

    dims = Dims(1, 1, 500, 4, 2, 32)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    prepared = prepare_mask(topk_mask(dims, 30, False, device).to_dense(1), q, k, False)
    with ThreadPoolExecutor(2) as executor, compile_only(executor):
        dmattn_func(q, k, v, prepared)
    (plan,) = _gather_plans(prepared)
    assert plan.kept_lists is None
    run_forward(q, k, v, prepared, func=dmattn_func)
    assert plan.kept_lists is not None


# -- a seeded fuzz, and what the route must work under

BIAS_SHAPES = (None, ("B", "Hk", "1", "Lk"), ("1", "1", "Lq", "Lk"), ("B", "Hq", "Lq", "Lk"),
               ("1", "Hk", "1", "1"))


def test_a_seeded_fuzz_of_the_route(device):
    """Random decode calls through the forced route: 1-16 query rows, caches of 1-5000 keys
    (300 under the interpreter), head dims 40-256 (16 and 40 under the interpreter), MHA, GQA
    and MQA, windows from 1 key to a quarter of the cache, intervals as given, prepared or as
    a bool mask, broadcast bias shapes, causal or not. 40 calls on a GPU, 6 interpreted."""
    on_gpu = device.type == "cuda"
    rng = random.Random(56)
    for _ in range(40 if on_gpu else 6):
        heads_kv = rng.choice([1, 2, 4])
        head_dim = rng.choice([40, 64, 80, 96, 128, 256] if on_gpu else [16, 40])
        dims = Dims(rng.randint(1, 3), rng.randint(1, 16), rng.randint(1, 5000 if on_gpu else 300),
                    heads_kv * rng.choice([1, 2, 4]), heads_kv, head_dim)
        dtype = rng.choice([torch.float16, torch.bfloat16] +
                           ([torch.float32] if head_dim <= 128 else []))
        causal = rng.random() < 0.5
        q, k, v = random_qkv(dims, dtype, device)
        mask = topk_mask(dims, rng.randint(1, max(1, dims.seqlen_k // 4)), causal, device)
        form = rng.choice(["intervals", "prepared", "bool"])
        if form == "bool":
            mask = mask.to_dense(dims.seqlen_q)
        elif form == "prepared":
            mask = prepare_mask(mask, q, k, causal)
        bias_shape = rng.choice(BIAS_SHAPES)
        bias = None if bias_shape is None else random_bias(dims.operand_shape(*bias_shape), dtype,
                                                           device)
        run_forward(q, k, v, mask, bias, causal=causal, func=GATHER)


def test_deterministic_calls_take_the_route_and_repeat_their_bits(device):
    """The shares' partials merge in share order (``partials``), so the route's results are
    reproducible, and ``deterministic=True`` keeps it."""
    dims, window = _long_lists(device, heads=(4, 2))
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    mask = topk_mask(dims, window, True, device)
    schedule = schedule_for(q, k, v, mask, is_causal=True, deterministic=True,
                            for_backward=False)
    assert schedule.forward.route == "gather" and schedule.forward.gather.key_splits > 1
    first = dmattn_func(q, k, v, mask, is_causal=True, deterministic=True, return_lse=True)
    for _ in range(3):
        again = dmattn_func(q, k, v, mask, is_causal=True, deterministic=True, return_lse=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def _gather_runs(monkeypatch) -> list:
    """The gather route's calls made from now on (one entry each)."""
    from kernels.planning.gather_decode import GatherDecodePlan

    runs = []
    original = GatherDecodePlan.run
    monkeypatch.setattr(GatherDecodePlan, "run",
                        lambda self, *args, **kw: runs.append(1) or original(self, *args, **kw))
    return runs


def _decode_step(dims: Dims, device, window: int):
    """A Doge decode step: the top-``window`` keys of a per-key bias chosen inside the step."""
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    bias = torch.randn(dims.batch, dims.heads_kv, 1, dims.seqlen_k, device=device,
                       dtype=torch.bfloat16)

    def step(q, k, v, bias):
        chosen = topk_intervals(bias, window, seqlen_q=q.shape[1], is_causal=True)
        return dmattn_func(q, k, v, chosen, bias, is_causal=True)

    return step, (q, k, v, bias)


def test_a_decode_step_with_its_selection_replays_in_a_cuda_graph(device, monkeypatch):
    """The selection and both launches wait for nothing, so a CUDA graph captures the whole
    step and replays it on new values; under the interpreter the step runs eagerly."""
    dims = Dims(2, 1, 1000, 8, 2, 128 if device.type == "cuda" else 16)
    step, inputs = _decode_step(dims, device, 32)
    runs = _gather_runs(monkeypatch)
    step(*inputs)  # plans and compiles outside the capture
    assert runs, "the decode step did not take the gather route"
    if device.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step(*inputs)

        def replay():
            graph.replay()
            return captured
    else:
        def replay():
            return step(*inputs)
    for _ in range(2):
        for t in inputs:
            t.copy_(torch.randn_like(t))
        assert torch.equal(replay(), step(*inputs))


def test_a_compiled_decode_step_takes_the_route(device, monkeypatch):
    """Under ``torch.compile(fullgraph=True)`` the intervals' ``max_kept`` crosses the op, so
    the compiled step takes the gather route and gives eager's bits."""
    torch._dynamo.reset()
    dims = Dims(1, 1, 1000, 4, 2, 16)
    step, inputs = _decode_step(dims, device, 24)
    runs = _gather_runs(monkeypatch)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(*inputs)
    assert runs, "the compiled step did not take the gather route"
    assert torch.equal(got, step(*inputs))
    torch._dynamo.reset()


def test_the_irregular_suite_holds_decode_cases_that_take_the_route(device):
    """``dmbench equiv --irregular`` checks the gather route: its inference pass runs the
    suite's decode cases under top-W masks of at most 1/8 of the keys through it."""
    from dmbench.irregular import irregular_cases
    from dmbench.problem import make_problem

    taken = 0
    for large in (False, True):
        for case in irregular_cases(large):
            if not (case.mask == "topk" and case.seqlen_q <= tuning.GATHER_MAX_ROWS
                    and case.window * 8 <= case.seqlen_k and case.bias == "kv_row"):
                continue
            if large:  # the GPU sizes: the route's choice from the shapes alone
                assert case.window + case.seqlen_q - 1 <= case.seqlen_k / 8, case.case_id
                continue
            p = make_problem(case, device)
            mask = (p.mask if case.mask_format == "intervals"
                    else prepare_mask(p.mask, p.q, p.k, case.causal))
            schedule = schedule_for(p.q, p.k, p.v, mask, p.bias, is_causal=case.causal,
                                    for_backward=False)
            assert schedule.forward.route == "gather", case.case_id
            taken += 1
    assert taken >= 3

