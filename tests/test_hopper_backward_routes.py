"""The Hopper route of the backward, host side, on every machine: when the schedule takes it
(``planning.hopper_backward``: the walks of its key-block programs, split heads, the grid's
order, the spread dQ staging), forcing it, and what it refuses with the reason. The kernel
against the reference is in ``test_hopper_backward.py``; its buffers and Triton launches in
``test_hopper_backward_buffers.py``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hopper_helpers import hopper_problem, sized
from kernels.planning import tuning
from kernels.planning.activity import ActivityMap
from kernels.planning.backward_schedule import BackwardRoute
from kernels.planning.hopper_backward import (active_walk_share, backward_list_tile,
                                              grid_order_group,
                                              hopper_backward_gap, longest_walk_share,
                                              mean_query_blocks, ordered_pairs)
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


@pytest.mark.parametrize("batch, heads_q, seqlen, window, hopper", [
    (1, 8, 2048, 256, False),  # bias.yaml: 4.2M pairs, the Triton backward 1.44x (H200, eager)
    (1, 8, 4096, 1024, False),  # 33.5M pairs: the Triton backward 1.21x
    (1, 16, 4096, 1024, True),  # headdim.yaml: 67M pairs, the bound; Hopper 1.24-1.44x
    (2, 16, 2048, 8192, True),  # W past Lk: every key of every row, 134M pairs
])
def test_key_ordered_top_w_takes_the_hopper_backward_from_enough_kept_pairs(
        monkeypatch, batch, heads_q, seqlen, window, hopper):
    """Key-ordered top-W intervals walk at most W keys a row: below
    ``HOPPER_BACKWARD_MIN_ORDERED_PAIRS`` kept pairs the default keeps the Triton backward, whose
    host path is shorter; forcing the Hopper route still takes it."""
    shape = sized(batch=batch, heads_q=heads_q, heads_kv=heads_q // 4, seqlen_q=seqlen,
                  seqlen_k=seqlen)
    layout = OperandLayout((batch, heads_q // 4, 1, seqlen), 4)
    ordered = dense_problem(shape=shape, mask=layout, tma_mask=True, intervals=True,
                            row_kept=window, is_causal=False)
    assert ordered_pairs(ordered) == batch * heads_q * seqlen * min(window, seqlen)
    assert (schedule(ordered).backward.route is BackwardRoute.HOPPER) == hopper
    assert schedule(ordered, HOPPER_OPTIONS).backward.route is BackwardRoute.HOPPER
    # The bound is what decides, and it reads key-ordered intervals only.
    unordered = replace(ordered, row_kept=None)
    unordered_route = schedule(unordered).backward.route
    monkeypatch.setattr(tuning, "HOPPER_BACKWARD_MIN_ORDERED_PAIRS", 0)
    assert schedule(ordered).backward.route is BackwardRoute.HOPPER
    monkeypatch.setattr(tuning, "HOPPER_BACKWARD_MIN_ORDERED_PAIRS", 1 << 62)
    assert schedule(ordered).backward.route is not BackwardRoute.HOPPER
    assert schedule(unordered).backward.route is unordered_route


def test_the_backward_option_names_the_hopper_route():
    with pytest.raises(ValueError, match="'hopper'"):
        normalize_options({"backward": "gluon"})


@pytest.mark.parametrize("batch, heads_q, heads_kv, seqlen, split_captured", [
    (1, 8, 2, 2048, True),  # bias.yaml: 7.8 whole, 1.9 split; 1.32x as CUDA graphs (H200)
    (1, 16, 4, 1024, True),  # 7.3 whole, 1.8 split
    (1, 16, 4, 512, False),  # 3.3 split, and walks of 5 query blocks
    (1, 4, 4, 4096, False),  # a group of one has nothing to split
])
def test_a_captured_backward_splits_long_walks_by_gpu_time(monkeypatch, batch, heads_q,
                                                           heads_kv, seqlen, split_captured):
    """With ``tuning.HOPPER_BACKWARD_SPLIT_CAPTURED`` a captured problem whose whole groups
    fail the longest-walk share takes the Hopper backward split where a program per query head
    comes within ``tuning.HOPPER_BACKWARD_CAPTURED_MAX_SPLIT_SHARE``; the eager problem, the
    option off, and a forced route or split decide as before."""
    shape = sized(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen,
                  seqlen_k=seqlen)
    eager = dense_problem(shape=shape)
    captured = replace(eager, captured=True)
    assert schedule(eager).backward.route is not BackwardRoute.HOPPER
    monkeypatch.setattr(tuning, "HOPPER_BACKWARD_SPLIT_CAPTURED", False)
    assert schedule(captured).backward == schedule(eager).backward
    monkeypatch.setattr(tuning, "HOPPER_BACKWARD_SPLIT_CAPTURED", True)
    assert schedule(eager).backward.route is not BackwardRoute.HOPPER
    backward = schedule(captured).backward
    assert (backward.route is BackwardRoute.HOPPER) == split_captured
    assert backward.split_heads == split_captured
    whole = normalize_options({"backward_split_heads": False})
    assert schedule(captured, whole).backward.route is not BackwardRoute.HOPPER
    triton = normalize_options({"backward": "dq+dkdv"})
    assert schedule(captured, triton).backward.route is BackwardRoute.SEPARATE


def causal_band_activity(query_blocks: int, key_blocks: int, width: int | None) -> ActivityMap:
    """A (1, 2) activity map in the Hopper backward's tiles (64 query rows x 128 keys): every
    causal tile active (``width`` None), or a band of ``width`` key blocks at the diagonal."""
    rows = torch.arange(query_blocks)[:, None] * 64 // 128
    cols = torch.arange(key_blocks)[None]
    live = cols <= rows
    if width is not None:
        live &= cols > rows - width
    active = live.to(torch.int8).expand(1, 2, -1, -1).contiguous()
    activity = ActivityMap(active, 64, 128)
    activity.count_active_areas([(tuning.HOPPER_BACKWARD.block_m, tuning.HOPPER_BACKWARD.block_n)])
    return activity


@pytest.mark.parametrize("width, split", [
    (None, True),  # every causal tile active (a per-key top-W mask): share 1.0
    (3, False),  # a band of three key blocks at the diagonal (as sliding W256): share 0.33
])
def test_a_captured_masked_backward_splits_only_where_its_active_tiles_fill_the_walks(
        monkeypatch, width, split):
    """A captured masked backward takes the split where the prepared mask's counted active
    tiles hold at least ``tuning.HOPPER_BACKWARD_CAPTURED_MIN_ACTIVE_SHARE`` of the unmasked
    walks (H200, bias.yaml's block top-W rows lost 0.85-0.88x split); a mask whose tiles were
    not counted keeps whole groups."""
    monkeypatch.setattr(tuning, "HOPPER_BACKWARD_SPLIT_CAPTURED", True)
    shape = sized(batch=1, heads_q=8, heads_kv=2, seqlen_q=2048, seqlen_k=2048)
    masked = dense_problem(shape=shape, captured=True, tma_mask=True, prepared=True,
                           mask=OperandLayout((1, 2, 2048, 2048), 4))
    activity = causal_band_activity(32, 16, width)
    share = active_walk_share(replace(masked, activity=activity))
    assert (share >= tuning.HOPPER_BACKWARD_CAPTURED_MIN_ACTIVE_SHARE) == split
    assert share == pytest.approx(1.0 if width is None else 90 / 272)
    backward = schedule(replace(masked, activity=activity)).backward
    assert backward.split_heads == split
    assert (backward.route is BackwardRoute.HOPPER) == split
    assert not schedule(masked).backward.split_heads  # uncounted
