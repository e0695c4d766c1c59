"""The Hopper route of the backward (Gluon, ``kernels.hopper_device.attention_backward``).

Host side, on every machine: forcing it, and what it refuses with the reason. Device side
(marked ``hopper``; Gluon has no interpreter): dq, dk and dv against the float64 reference on
awkward shapes, GQA/MQA, both dtypes, causal or not; every test counts the route each backward
took, so a silent fallback fails it. Its offline compile is in ``test_hopper_offline.py``.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from attn_helpers import (Dims, forcing, random_bias, random_intervals, random_mask,
                          random_qkv, run_backward)
from kernels import prepare_mask, topk_intervals
from hopper_helpers import (MASKED_SHAPES, band, fuzzed_dims, fuzzed_mask, hopper_problem,
                            shape_id, sized)
from kernels import record_routes
from kernels.planning import tuning
from kernels.planning.backward_schedule import BackwardRoute
from kernels.planning.hopper_backward import (backward_list_tile, grid_order_group,
                                              hopper_backward_gap, longest_walk_share,
                                              mean_query_blocks)
from kernels.planning.problem import OperandLayout, Problem
from kernels.planning.schedule import activity_tiles, normalize_options, schedule

HOPPER_OPTIONS = normalize_options({"backward": "hopper"})


def dense_problem(**changes) -> Problem:
    """A causal dense problem the Hopper route covers (``hopper_helpers.hopper_problem``)."""
    return hopper_problem(**{"is_causal": True, **changes})


def test_forcing_the_hopper_backward_schedules_it():
    sched = schedule(dense_problem(), HOPPER_OPTIONS)
    assert sched.backward.route is BackwardRoute.HOPPER
    assert sched.backward.launches == tuning.HOPPER_BACKWARD
    assert "backward: route=hopper" in str(sched)


@pytest.mark.parametrize("seqlen, head_dim, causal, extra, hopper", [
    (512, 128, False, {}, True),  # walks 8 query blocks: 1.17x the Triton backward (H200)
    (256, 128, False, {}, False),  # 4: not measured
    (1024, 128, True, {}, True),  # 9, causal: 1.10x in grouped order
    (512, 128, True, {}, False),  # 5, causal: 0.76x
    (2048, 128, True, {}, True),  # 17, causal: about 1.2x in grouped order
    (4096, 128, True, {}, True),  # 33: 1.37x
    (1024, 64, False, {}, False),  # 16: 0.74x
    (2048, 64, False, {}, True),  # 32: 1.02x
    (2048, 64, True, {}, False),  # 17: 0.93x
    (8192, 128, True, {"deterministic": True}, False),  # 0.89x
    (2048, 128, False, {"deterministic": True}, False),  # 32: 0.96x
    (8192, 128, False, {"deterministic": True}, True),  # 128: 1.13x
    (8192, 128, True, {"capability": (8, 0)}, False),  # not covered
], ids=["D128-L512", "D128-L256", "D128-L1024-causal", "D128-L512-causal",
        "D128-L2048-causal", "D128-L4096-causal", "D64-L1024", "D64-L2048", "D64-L2048-causal",
        "deterministic-causal", "deterministic-L2048", "deterministic-L8192", "ampere"])
def test_the_default_takes_the_hopper_backward_where_it_was_measured_ahead(seqlen, head_dim,
                                                                           causal, extra,
                                                                           hopper):
    """The measured grids: B x L = 16384, H16 at D128, H16/4 at D64."""
    heads_kv = 16 if head_dim > 64 else 4
    shape = sized(batch=16384 // seqlen, seqlen_q=seqlen, seqlen_k=seqlen, head_dim=head_dim,
                  heads_q=16, heads_kv=heads_kv)
    problem = dense_problem(shape=shape, is_causal=causal, **extra)
    assert (schedule(problem).backward.route is BackwardRoute.HOPPER) == hopper


@pytest.mark.parametrize("batch, heads_q, heads_kv, seqlen, hopper, split", [
    (1, 16, 4, 4096, True, True),  # headdim.yaml: share 2.0 whole, 0.5 a program per head
    (1, 4, 4, 4096, False, False),  # 2.0, and a group of one has nothing to split
    (1, 16, 4, 1024, False, False),  # 7.3 whole, 1.8 split
    (1, 16, 4, 8192, True, False),  # models.yaml: about 1.0, 1.25x
    (2, 16, 4, 4096, True, False),  # dense.yaml: 1.0
])
def test_grids_waiting_on_their_longest_program_split_heads_or_take_triton(
        monkeypatch, batch, heads_q, heads_kv, seqlen, hopper, split):
    shape = sized(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen,
                  seqlen_k=seqlen)
    problem = dense_problem(shape=shape)
    monkeypatch.setattr(tuning, "HOPPER_BACKWARD_SPLIT_LONG_WALKS", True)
    backward = schedule(problem).backward
    assert (backward.route is BackwardRoute.HOPPER) == hopper
    assert (hopper and backward.split_heads) == split
    monkeypatch.setattr(tuning, "HOPPER_BACKWARD_SPLIT_LONG_WALKS", False)
    backward = schedule(problem).backward
    assert (backward.route is BackwardRoute.HOPPER) == (hopper and not split)
    assert not backward.split_heads


def test_the_longest_walk_share_compares_one_program_with_the_even_share():
    """B1 H16/4 L4096 causal: key block 0 walks 64 query blocks for each of 4 query heads
    (256), the 128 programs together 4 x 4 x 1056 over 132 multiprocessors (128): share 2."""
    causal = dense_problem(shape=sized(batch=1, seqlen_q=4096, seqlen_k=4096))
    assert longest_walk_share(causal) == pytest.approx(256 / (16 * 1056 / 132))
    # A program per query head walks 64 of the 512 programs' 16 x 1056.
    assert longest_walk_share(causal, split_heads=True) == pytest.approx(64 / (16 * 1056 / 132))
    few = replace(causal, is_causal=False, shape=sized(batch=1, heads_q=4, heads_kv=4))
    assert longest_walk_share(few) == pytest.approx(132 / (4 * 32))  # 128 programs, one wave
    assert longest_walk_share(replace(causal, multiprocessors=4096)) > 30


def test_the_mean_walk_counts_the_query_blocks_each_key_block_sees():
    """Causal, bottom-right aligned: key block j of 128 keys is seen from row 128 j - (Lk - Lq)
    on; key blocks no row sees are not counted."""
    full = dense_problem(shape=sized(seqlen_q=1000, seqlen_k=300), is_causal=False)
    assert mean_query_blocks(full) == 16  # ceil(1000 / 64)
    causal = replace(full, is_causal=True)
    assert mean_query_blocks(causal) == (6 + 4 + 2) / 3  # key block j from row 700 + 128 j
    square = dense_problem(shape=sized(seqlen_q=256, seqlen_k=256), is_causal=True)
    assert mean_query_blocks(square) == (4 + 2) / 2
    wide = dense_problem(shape=sized(seqlen_q=64, seqlen_k=1024), is_causal=True)
    assert mean_query_blocks(wide) == 1


def test_the_causal_grid_orders_in_groups_only_where_asked(monkeypatch):
    causal = dense_problem(shape=sized(seqlen_q=2048, seqlen_k=2048))  # 16 key blocks
    assert grid_order_group(causal, 16, 8) == 33  # 4 waves by default: 4 x 132 / 16
    monkeypatch.setattr(tuning, "HOPPER_BACKWARD_CAUSAL_GROUP_WAVES", None)
    assert grid_order_group(causal, 16, 8) is None
    monkeypatch.setattr(tuning, "HOPPER_BACKWARD_CAUSAL_GROUP_WAVES", 2)
    assert grid_order_group(causal, 16, 8) == 17  # 2 x 132 programs over 16 key blocks
    assert grid_order_group(causal, 1000, 8) == 1
    assert grid_order_group(replace(causal, is_causal=False), 16, 8) is None


def test_key_ordered_intervals_start_their_longest_walks_first(monkeypatch):
    """Key-ordered top-W intervals run non-causal with their longest walks in the first key
    blocks: the grid goes by key block over all units by default, in groups where the tuning
    asks; the same intervals causal (not ordered) keep the causal groups, and a non-causal
    grid of intervals without their order goes by unit."""
    intervals = dict(mask=OperandLayout((2, 4, 1, 4096), 4), tma_mask=True, intervals=True)
    ordered = dense_problem(**intervals, row_kept=1024, is_causal=False)
    assert grid_order_group(ordered, 32, 32) == 32
    assert grid_order_group(replace(ordered, is_causal=True), 32, 32) == 17  # 4 x 132 / 32
    assert grid_order_group(replace(ordered, row_kept=None), 32, 32) is None
    monkeypatch.setattr(tuning, "HOPPER_BACKWARD_ORDERED_GROUP_WAVES", 2)
    assert grid_order_group(ordered, 32, 32) == 9  # 2 x 132 / 32


@pytest.mark.parametrize("changes, reason", [
    ({"mask": OperandLayout((2, 4, 1, 4096), 4), "tma_mask": True},
     "not yet a mask of one row"),
    ({"bias": OperandLayout((2, 4, 4096, 4096), 4)}, "not yet a bias with a row per query"),
    ({"deterministic": True, "mask": OperandLayout((2, 4, 4096, 4096), 4), "tma_mask": True},
     "in any order"),
    ({"capability": (8, 0)}, "compute capability 9.0"),
    ({"dtype": torch.float32}, "float16 or bfloat16"),
    ({"tma_operands": False}, "TMA"),
], ids=["one-row", "full-bias", "masked-deterministic", "ampere", "fp32", "strides"])
def test_what_the_hopper_backward_does_not_cover_is_refused_with_the_reason(changes, reason):
    problem = dense_problem(**changes)
    assert reason in hopper_backward_gap(problem)
    with pytest.raises(ValueError, match=f"'hopper' does not cover this call: .*{reason}"):
        schedule(problem, HOPPER_OPTIONS)


@pytest.mark.parametrize("changes", [
    {"mask": OperandLayout((2, 4, 4096, 4096), 4), "tma_mask": True},
    {"mask": OperandLayout((2, 4, 1, 4096), 4), "tma_mask": True, "intervals": True},
    {"bias": OperandLayout((2, 4, 1, 4096), 4)},
    {"deterministic": True},
], ids=["mask", "intervals", "bias-row", "deterministic"])
def test_masks_intervals_a_bias_row_and_deterministic_take_the_hopper_backward(changes):
    problem = dense_problem(**changes)
    assert hopper_backward_gap(problem) is None
    assert schedule(problem, HOPPER_OPTIONS).backward.route is BackwardRoute.HOPPER


def test_a_masked_problem_puts_the_hopper_backwards_list_tile_in_the_activity_map():
    """A prepared mask's map, built before any call's options are known, divides the Hopper
    backward's tile."""
    problem = dense_problem(mask=OperandLayout((2, 4, 4096, 4096), 4), tma_mask=True)
    tile = (tuning.HOPPER_BACKWARD.block_m, tuning.HOPPER_BACKWARD.block_n)
    assert backward_list_tile(problem) == tile
    assert tile in activity_tiles(problem, schedule(problem).forward)


@pytest.mark.parametrize("options, message", [
    ({"backward_dq_spread": True, "backward": "fused"}, "'backward' 'fused' conflict"),
    ({"backward_dq_spread": True, "backward": "hopper"}, None),
])
def test_the_spread_dq_staging_is_the_hopper_backwards_at_head_dim_128(options, message):
    problem = dense_problem()
    options = normalize_options(options)
    if message:
        with pytest.raises(ValueError, match=message):
            schedule(problem, options)
        return
    assert schedule(problem, options).backward.dq_spread
    assert schedule(problem, HOPPER_OPTIONS).backward.dq_spread  # on by default at 128
    off = normalize_options({**HOPPER_OPTIONS, "backward_dq_spread": False})
    assert not schedule(problem, off).backward.dq_spread
    narrow = dense_problem(shape=sized(head_dim=64))
    assert not schedule(narrow, HOPPER_OPTIONS).backward.dq_spread
    with pytest.raises(ValueError, match="head dim 128's columns, not 64's"):
        schedule(narrow, options)


@pytest.mark.parametrize("changes, options, message", [
    ({}, {"backward_split_heads": True, "backward": "fused"}, "'backward' 'fused' conflict"),
    ({"deterministic": True}, {"backward_split_heads": True}, "deterministic=True"),
    ({"shape": sized(heads_q=4, heads_kv=4)}, {"backward_split_heads": True},
     "a group of 1"),
    ({}, {"backward_split_heads": True}, None),
])
def test_split_heads_are_the_hopper_backwards_where_a_group_splits(changes, options, message):
    problem = dense_problem(**changes)
    options = normalize_options({"backward": "hopper", **options})
    if message:
        with pytest.raises(ValueError, match=message):
            schedule(problem, options)
        return
    sched = schedule(problem, options)
    assert sched.backward.split_heads and "split_heads=True" in str(sched)
    assert not schedule(problem, HOPPER_OPTIONS).backward.split_heads  # no mask: off


def test_split_heads_are_the_default_for_key_ordered_top_w_intervals(monkeypatch):
    """Key-ordered top-W intervals (``row_kept`` known, causality folded in) split; the same
    intervals causal (not ordered), a bool mask and no mask keep whole groups."""
    intervals = dict(mask=OperandLayout((2, 4, 1, 4096), 4), tma_mask=True, intervals=True)
    ordered = dense_problem(**intervals, row_kept=1024, is_causal=False)
    assert schedule(ordered, HOPPER_OPTIONS).backward.split_heads
    assert not schedule(replace(ordered, is_causal=True), HOPPER_OPTIONS).backward.split_heads
    assert not schedule(replace(ordered, row_kept=None), HOPPER_OPTIONS).backward.split_heads
    bool_mask = dense_problem(mask=OperandLayout((2, 4, 4096, 4096), 4), tma_mask=True,
                              is_causal=False)
    assert not schedule(bool_mask, HOPPER_OPTIONS).backward.split_heads
    off = normalize_options({**HOPPER_OPTIONS, "backward_split_heads": False})
    assert not schedule(ordered, off).backward.split_heads
    # A kv_row bias's gradient: rows summed over the group, or split, a row per query head.
    biased = replace(ordered, bias=OperandLayout((2, 4, 1, 4096), 4), bias_grad=True)
    split_rows = schedule(biased, HOPPER_OPTIONS).backward.dbias
    assert not split_rows.sum_group and split_rows.buffer_shape == (2, 16, 1, 4096)
    assert split_rows.buffer_dtype == torch.float32 and split_rows.bias_shape == (2, 4, 1, 4096)
    assert schedule(biased, off).backward.dbias.sum_group
    monkeypatch.setattr(tuning, "HOPPER_BACKWARD_SPLIT_ORDERED_HEADS", False)
    assert not schedule(ordered, HOPPER_OPTIONS).backward.split_heads


def test_the_backward_option_names_the_hopper_route():
    with pytest.raises(ValueError, match="'hopper'"):
        normalize_options({"backward": "gluon"})


# -- device side: a Hopper GPU
FORCED = forcing(backward="hopper")


def HOPPER(*args, **kwargs):
    """``dmattn_func`` with its backward forced onto the Hopper route (counted when the
    gradients are taken, in ``_backward_on_hopper``)."""
    return FORCED(*args, **kwargs)


def _backward_on_hopper(q, k, v, causal, mask=None):
    with record_routes() as routes:
        run = run_backward(q, k, v, mask, causal=causal, func=HOPPER)
    assert routes.backward and set(routes.backward) == {"hopper"}, routes.describe()
    return run


SHAPES = [  # (batch, Lq, Lk, Hq, Hk, D)
    (1, 1, 1, 1, 1, 64),
    (2, 17, 97, 4, 2, 128),
    (1, 97, 17, 3, 3, 40),
    (2, 1025, 1025, 4, 1, 80),
    (1, 300, 700, 6, 2, 64),
    (3, 300, 129, 2, 1, 128),
    (1, 1000, 1000, 8, 8, 16),
]


@pytest.mark.hopper
@pytest.mark.parametrize("sizes", SHAPES, ids=shape_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_hopper_backward_matches_the_reference(device, sizes, causal, dtype):
    q, k, v = random_qkv(Dims(*sizes), dtype, device)
    _backward_on_hopper(q, k, v, causal)


@pytest.mark.hopper
@pytest.mark.parametrize("sizes", [(2, 1025, 1025, 4, 1, 80), (3, 300, 700, 6, 2, 64),
                                   (2, 2048, 2048, 4, 2, 128)], ids=shape_id)
@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "deterministic"])
def test_a_causal_grid_ordered_in_groups_matches_the_reference(device, monkeypatch, sizes,
                                                               deterministic):
    """``tuning.HOPPER_BACKWARD_CAUSAL_GROUP_WAVES``: groups of (batch, key head)s, each
    ordered by key block. 48 programs a group on 132 multiprocessors: at B2 Hk2 L2048 groups of
    3 and 1 (the last one smaller), the other shapes one group."""
    monkeypatch.setattr(tuning, "HOPPER_BACKWARD_CAUSAL_GROUP_WAVES", 0.37)
    q, k, v = random_qkv(Dims(*sizes), torch.bfloat16, device)
    with record_routes() as routes:
        run_backward(q, k, v, causal=True, deterministic=deterministic, func=FORCED)
    assert set(routes.backward) == {"hopper"}, routes.describe()


@pytest.mark.hopper
def test_hopper_backward_reads_strided_views(device):
    q, k, v = random_qkv(Dims(2, 333, 333, 4, 2, 64), torch.bfloat16, device, "bhld")
    _backward_on_hopper(q, k, v, True)


@pytest.mark.hopper
def test_an_unaligned_gradient_runs_the_triton_backward(device):
    q, k, v = random_qkv(Dims(1, 200, 200, 2, 2, 64), torch.bfloat16, device)
    grad = torch.randn(q.numel() + 1, device=device).to(q.dtype)[1:].view(q.shape)
    with record_routes() as routes:
        run_backward(q, k, v, causal=True, grad_out=grad, func=HOPPER)
    assert routes.backward and "hopper" not in routes.backward


@pytest.mark.hopper
def test_hopper_backward_on_random_shapes(device):
    """A seeded fuzz: lengths 1-2000, head dims 8-128 (multiples of 8), GQA/MQA, both dtypes,
    causal or not."""
    rng = random.Random(66)
    for _ in range(30):
        dims = fuzzed_dims(rng, max_batch=2, max_length=2000)
        q, k, v = random_qkv(dims, rng.choice([torch.bfloat16, torch.float16]), device)
        _backward_on_hopper(q, k, v, rng.random() < 0.5)


# -- the masked form (bool masks and KeyIntervals through the activity lists)

@pytest.mark.hopper
@pytest.mark.parametrize("sizes", MASKED_SHAPES, ids=shape_id)
@pytest.mark.parametrize("batch, heads", [("B", "Hq"), ("1", "Hk"), ("B", "1"), ("1", "1")],
                         ids=["B-Hq", "1-Hk", "B-1", "1-1"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("keep", [0.02, 0.5, 1.0], ids=["keep2", "keep50", "keep100"])
def test_masked_hopper_backward_matches_the_reference(device, sizes, batch,
                                                      heads, causal, keep):
    dims = Dims(*sizes)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    mask = random_mask(dims.operand_shape(batch, heads, "Lq", "Lk"), device, keep)
    _backward_on_hopper(q, k, v, causal, mask)


@pytest.mark.hopper
@pytest.mark.parametrize("window", [1, 100, 1024], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("prepared", [False, True], ids=["per-call", "prepared"])
def test_masked_hopper_backward_walks_the_full_blocks_of_a_band(device, window, prepared):
    dims = Dims(2, 2048, 2048, 4, 2, 128)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    mask = band(dims, window, device)
    if prepared:
        mask = prepare_mask(mask, q, k, is_causal=True)
    _backward_on_hopper(q, k, v, True, mask)



@pytest.mark.hopper
@pytest.mark.parametrize("split_heads", [False, True], ids=["whole", "split"])
def test_repeated_backwards_of_one_prepared_mask_each_match_the_reference(device, split_heads):
    """Calls of one plan reuse its kept scratch views and mask arguments: each of three
    backwards, with new inputs, a new gradient and the bias written in place between them,
    matches the reference (a stale descriptor or an accumulator not zeroed again fails)."""
    dims = Dims(2, 720, 720, 4, 2, 128)  # mask rows of 720 bytes: TMA reads them
    func = forcing(backward="hopper", backward_split_heads=split_heads)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    mask = prepare_mask(random_mask(dims.operand_shape("B", "Hk", "Lq", "Lk"), device, 0.3),
                        q, k, is_causal=True)
    bias = random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), torch.bfloat16, device)
    for seed in range(3):
        torch.manual_seed(seed)
        for t in (q, k, v):
            t.detach().normal_()
        bias.detach().normal_()
        with record_routes() as routes:
            run_backward(q, k, v, mask, bias, causal=True, func=func)
        assert set(routes.backward) == {"hopper"}, routes.describe()

# Both passes forced: the Hopper forward builds lists for KeyIntervals a call gives (the Triton
# forward may read them itself, leaving the backward no lists: it then runs the Triton one).
BOTH = forcing(forward_route="hopper", backward="hopper")


@pytest.mark.hopper
@pytest.mark.parametrize("sizes", MASKED_SHAPES, ids=shape_id)
@pytest.mark.parametrize("batch, heads", [("B", "Hq"), ("1", "Hk"), ("B", "1")],
                         ids=["B-Hq", "1-Hk", "B-1"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("prepared", [False, True], ids=["per-call", "prepared"])
def test_hopper_backward_of_intervals_matches_the_reference(device, sizes,
                                                            batch, heads, causal, prepared):
    """KeyIntervals: each warpgroup loads its keys' (start, end) words once per query head
    and tests the list's partial blocks with them."""
    dims = Dims(*sizes)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    mask = random_intervals(dims, heads, batch, device, seed=sizes[1])
    if prepared:
        mask = prepare_mask(mask, q, k, is_causal=causal)
    with record_routes() as routes:
        run_backward(q, k, v, mask, causal=causal, func=BOTH)
    assert set(routes.backward) == {"hopper"}, routes.describe()


@pytest.mark.hopper
def test_masked_hopper_backward_on_random_shapes(device):
    """A seeded fuzz of 100 backwards: lengths up to 1500 (odd key lengths through a mask
    sliced from rows padded to 16 bytes), head dims 8-128, GQA/MQA, every batch and head
    broadcast of the mask (a stride-0 expand too), keep 0-100% (empty rows and key blocks
    no row sees), causal or not, both dtypes, prepared masks."""
    rng = random.Random(166)
    for _ in range(100):
        dims = fuzzed_dims(rng, max_batch=2, max_length=1500)
        q, k, v = random_qkv(dims, rng.choice([torch.bfloat16, torch.float16]), device)
        mask = fuzzed_mask(rng, dims, device)
        causal = rng.random() < 0.5
        if rng.random() < 0.3:
            mask = prepare_mask(mask, q, k, is_causal=causal)
        _backward_on_hopper(q, k, v, causal, mask)


@pytest.mark.hopper
@pytest.mark.parametrize("sizes, window", [((2, 1000, 1000, 8, 2, 128), 100),
                                           ((1, 1500, 1500, 6, 3, 64), 300),
                                           ((3, 700, 700, 4, 1, 80), 64)],
                         ids=lambda v: shape_id(v) if isinstance(v, tuple) else f"W{v}")
@pytest.mark.parametrize("split", [None, False], ids=["default", "whole-groups"])
def test_key_ordered_top_w_backward_walks_longest_first_and_matches(device, monkeypatch,
                                                                    no_kept_plans, sizes,
                                                                    window, split):
    """Key-ordered top-W intervals of a kv_row bias (the transformers integration's form),
    whose grid goes by key block over all units (``grid_order_group``): dq, dk, dv and the
    bias gradient against the reference, split heads (the default) and whole groups. The
    lengths keep the intervals' int32 rows 16-byte aligned, as TMA reads them."""
    from kernels.planning import hopper_backward

    groups = []
    original = hopper_backward.grid_order_group

    def recorded(problem, key_blocks, units):
        groups.append((original(problem, key_blocks, units), units))
        return groups[-1][0]
    monkeypatch.setattr(hopper_backward, "grid_order_group", recorded)
    dims = Dims(*sizes)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    bias = random_bias((dims.batch, dims.heads_kv, 1, dims.seqlen_k), torch.bfloat16,
                       device).requires_grad_()
    intervals = topk_intervals(bias.detach(), window, order_keys=True)
    options = {"backward": "hopper"}
    if split is not None:
        options["backward_split_heads"] = split
    with record_routes() as routes:
        run_backward(q, k, v, intervals, bias, causal=True, func=forcing(**options))
    assert set(routes.backward) == {"hopper"}, routes.describe()
    units = dims.batch * (dims.heads_q if split is None else dims.heads_kv)
    assert groups and all(group == every == units for group, every in groups), groups


def assert_backwards_repeat_bitwise(q, k, v, bias, causal, func=FORCED):
    """Five forced Hopper backwards of one deterministic call give bitwise equal dq, dk, dv
    (and the bias's gradient)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v, bias) if t is not None]
    out = func(*leaves[:3], None, leaves[3] if bias is not None else None, causal,
               deterministic=True)
    grad = torch.randn_like(out)
    first = torch.autograd.grad(out, leaves, grad, retain_graph=True)
    for _ in range(4):
        again = torch.autograd.grad(out, leaves, grad, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


# -- the ordered dQ (deterministic=True)
@pytest.mark.hopper
@pytest.mark.parametrize("sizes", [(2, 1025, 1025, 4, 1, 80), (1, 300, 700, 6, 2, 64),
                                   (2, 2048, 2048, 4, 2, 128)],
                         ids=shape_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias-row"])
def test_deterministic_hopper_backward_is_bitwise_repeatable(device, sizes, causal, with_bias):
    """Five backwards of one call give bitwise equal dq, dk, dv (and a bias row's gradient),
    which match the reference (``run_backward``)."""
    dims = Dims(*sizes)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    bias = (random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), torch.bfloat16, device)
            if with_bias else None)
    with record_routes() as routes:
        run_backward(q, k, v, bias=bias, causal=causal, deterministic=True, func=FORCED)
    assert set(routes.backward) == {"hopper"}, routes.describe()
    assert_backwards_repeat_bitwise(q, k, v, bias, causal)


# -- a bias row and its gradient
@pytest.mark.hopper
@pytest.mark.parametrize("sizes", [(2, 300, 512, 4, 2, 128), (1, 1025, 1040, 4, 1, 80),
                                   (2, 17, 64, 2, 2, 64)],
                         ids=shape_id)
@pytest.mark.parametrize("batch, heads", [("B", "Hk"), ("1", "Hq"), ("B", "1")],
                         ids=["B-Hk", "1-Hq", "B-1"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_hopper_backward_of_a_bias_row_matches_the_reference(device, sizes, batch,
                                                             heads, causal, masked):
    """flash-dmattn's (B, Hk, 1, Lk) bias and its broadcasts, with its gradient (summed over
    the rows, and over the group where the bias has fewer heads than the queries), with and
    without a bool mask."""
    dims = Dims(*sizes)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    bias = random_bias(dims.operand_shape(batch, heads, "1", "Lk"), torch.bfloat16,
                       device).requires_grad_()
    mask = (random_mask(dims.operand_shape("B", "Hk", "Lq", "Lk"), device, 0.5) if masked
            else None)
    with record_routes() as routes:
        run_backward(q, k, v, mask, bias, causal=causal, func=FORCED)
    assert set(routes.backward) == {"hopper"}, routes.describe()


# -- the seeded fuzz of every form together
@pytest.mark.hopper
@pytest.mark.parametrize("part", [0, 1, 2], ids=lambda p: f"part{p}")
def test_hopper_backward_fuzz_of_every_form(device, part):
    """300 seeded backwards forced onto the Hopper route, in three parts of 100: lengths up to
    1500 (odd ones too), head dims 8-128, GQA/MQA, both dtypes, causal or not; no mask, a bool
    mask (every broadcast, keep 0-100%: empty rows and key blocks no row sees; per call or
    prepared) or KeyIntervals (prepared, or listed by a forced Hopper forward); a bias row in
    every broadcast with its gradient; deterministic=True without a mask, five backwards
    bitwise equal. Each against the float64 reference, and each took the Hopper route."""
    _fuzz_every_form(random.Random(660 + part), 100, device)


@pytest.mark.hopper
@pytest.mark.parametrize("part", [0, 1], ids=lambda p: f"part{p}")
def test_split_heads_on_every_form(device, part):
    """``kernel_options['backward_split_heads']`` True, a program per query head of each key
    block and dK, dV reduce-added in float32: 200 of the fuzz's backwards, in two parts of
    100, each with a GQA group of 2-4 heads and no deterministic=True."""
    _fuzz_every_form(random.Random(860 + part), 100, device,
                     options={"backward_split_heads": True})


@pytest.mark.hopper
@pytest.mark.parametrize("part", [0, 1], ids=lambda p: f"part{p}")
def test_the_unspread_dq_staging_on_every_form(device, part):
    """``kernel_options['backward_dq_spread']`` False, the staging head dim 128 takes without
    the spread: 120 of the fuzz's backwards at head dim 128, in two parts of 60."""
    _fuzz_every_form(random.Random(760 + part), 60, device, head_dim=128,
                     options={"backward_dq_spread": False})


def _fuzz_every_form(rng, count, device, head_dim=None, options=None):
    """``count`` of the fuzz's backwards (``test_hopper_backward_fuzz_of_every_form``), at
    ``head_dim`` where given, with these ``kernel_options`` besides the forced routes."""
    options = options or {}
    forced = forcing(backward="hopper", **options)
    both = forcing(forward_route="hopper", backward="hopper", **options)
    split = options.get("backward_split_heads", False)  # needs a group, not deterministic
    for _ in range(count):
        dims = fuzzed_dims(rng, max_batch=2, max_length=1500)
        if head_dim is not None:
            dims = replace(dims, head_dim=head_dim)
        if split and dims.heads_q == dims.heads_kv:
            dims = replace(dims, heads_q=dims.heads_kv * rng.choice([2, 3, 4]))
        dtype = rng.choice([torch.bfloat16, torch.float16])
        q, k, v = random_qkv(dims, dtype, device)
        causal = rng.random() < 0.5
        # A bool mask of one query row, a bias row of one key or its gradient over one query
        # row run the Triton backward.
        kind = rng.choice(["none", "bool", "intervals"] if dims.seqlen_q > 1 else
                          ["none", "intervals"])
        bias = None
        if min(dims.seqlen_q, dims.seqlen_k) > 1 and rng.random() < 0.4:
            shape = dims.operand_shape(rng.choice(["1", "B"]), rng.choice(["1", "Hk", "Hq"]),
                                       "1", "Lk")
            bias = random_bias(shape, dtype, device)
        deterministic = kind == "none" and rng.random() < 0.3 and not split
        mask, func = None, forced
        if kind == "bool":
            mask = fuzzed_mask(rng, dims, device)
            if rng.random() < 0.3:
                mask = prepare_mask(mask, q, k, is_causal=causal)
        elif kind == "intervals":
            # KeyIntervals' words are (Bm, Hm, Lk) int64: TMA reads them with a batch or head
            # axis only where Lk is even (16-byte strides), so odd key lengths share one row.
            heads, batch = rng.choice(["1", "Hk", "Hq"]), rng.choice(["1", "B"])
            if dims.seqlen_k % 2:
                heads, batch = "1", "1"
            mask = random_intervals(dims, heads, batch, device, seed=rng.randrange(1 << 30))
            if bias is not None or rng.random() < 0.5:  # the Hopper forward takes no bias
                mask = prepare_mask(mask, q, k, is_causal=causal)
            else:
                func = both
        case = f"{dims} {dtype} causal={causal} {kind} bias={bias is not None and bias.shape}"
        with record_routes() as routes:
            run_backward(q, k, v, mask, bias, causal=causal, deterministic=deterministic,
                         func=func)
        assert set(routes.backward) == {"hopper"}, f"{case}: {routes.describe()}"
        if deterministic:
            assert_backwards_repeat_bitwise(q, k, v, bias, causal, forced)
