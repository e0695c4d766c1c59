"""dkdv with its GQA group's query heads split into shares: each share's program writes fp32
partials of dk and dv, and the last share of each key block to finish sums them. Whether a shape splits depends on its grid
and the GPU, so each case runs with the split forced on and off and checks every gradient
against float64 autograd of the reference; the bias kinds cover each way its gradient is made
(summed rows, dq-written tiles with and without atomics, dkdv-written tiles)."""

from __future__ import annotations

import pytest
import torch

from attn_helpers import (Dims, assert_deterministic_grads, random_problem,
                          record_backward_plans, run_backward)
from kernels import backward, prepare_mask
from kernels._checks import AttnShape

# (dims, mask axes or None, bias axes or None, causal)
CASES = [
    # A one-row bias per kv head: with shares, summed per query head, then over the group.
    pytest.param(Dims(1, 40, 70, heads_q=4, heads_kv=2, head_dim=40), "BxHkxLqxLk",
                 "1xHkx1xLk", True, id="kv_row"),
    # A one-row bias shared by batch and heads: dkdv sums the group, torch the rest.
    pytest.param(Dims(2, 30, 45, heads_q=4, heads_kv=2, head_dim=40), None, "1x1x1xLk", False,
                 id="row_shared"),
    # A full bias per query head: dq stores each tile once.
    pytest.param(Dims(2, 33, 47, heads_q=6, heads_kv=2, head_dim=16), None, "BxHqxLqxLk",
                 False, id="q_full"),
    # A full bias per kv head: the group's query heads add atomically in dq.
    pytest.param(Dims(1, 50, 50, heads_q=4, heads_kv=1, head_dim=80), "1x1xLqxLk", "1xHkxLqxLk",
                 True, id="mqa-kv_full"),
]


def _forced(monkeypatch, split: bool, fused: bool = False) -> list:
    """Plans made from now on split dkdv as far as the group allows (or never), fused with dq
    in one launch or not; returns the list they are recorded in."""
    monkeypatch.setattr(backward, "FUSE_MAX_WAVES", 10**9 if fused else 0)
    monkeypatch.setattr(backward, "DKDV_SHARE_WAVES", 10**9 if split else 0)
    return record_backward_plans(monkeypatch)


@pytest.mark.usefixtures("no_kept_plans")  # a kept plan would keep its launch plan
@pytest.mark.parametrize("split", (True, False), ids=("shares", "whole-group"))
@pytest.mark.parametrize("dims,mask_axes,bias_axes,causal", CASES)
def test_head_shares_give_the_reference_gradients(dims, mask_axes, bias_axes, causal, split,
                                                  device, monkeypatch):
    made = _forced(monkeypatch, split)
    q, k, v, mask, bias = random_problem(dims, torch.bfloat16, device,
                                         mask=mask_axes or "1x1x1x1", bias=bias_axes,
                                         keep=0.6)
    run_backward(q, k, v, mask if mask_axes else None, bias, causal)
    group = dims.heads_q // dims.heads_kv
    assert [plan.head_shares for plan in made] == [group if split else 1]
    # One-row biases: with shares, each key block's last share sums the group's rows.
    assert made[0].group_rows == (split and bias_axes.endswith("x1xLk"))


@pytest.mark.usefixtures("no_kept_plans")
@pytest.mark.parametrize("bias_axes", ("1xHkx1xLk", "BxHqxLqxLk"), ids=("kv_row", "q_full"))
def test_head_shares_in_the_fused_launch(bias_axes, device, monkeypatch):
    """The fused launch's dkdv programs split the group too, and merge like the dkdv launch
    (with a one-row bias, its group rows as well), beside split-K dq programs."""
    made = _forced(monkeypatch, True, fused=True)
    monkeypatch.setattr(backward, "dq_key_splits", lambda *args: 3)
    dims = Dims(1, 9, 150, heads_q=4, heads_kv=2, head_dim=40)
    q, k, v, mask, bias = random_problem(dims, torch.bfloat16, device, mask="BxHkxLqxLk",
                                         bias=bias_axes, keep=0.6)
    run_backward(q, k, v, mask, bias, True)
    assert [(plan.fused is not None, plan.head_shares, plan.splits) for plan in made] == \
        [(True, 2, 3)]
    assert made[0].group_rows == (bias_axes == "1xHkx1xLk")


@pytest.mark.usefixtures("no_kept_plans")
@pytest.mark.parametrize("fused", (False, True), ids=("separate", "fused"))
def test_head_shares_are_deterministic(fused, device, monkeypatch):
    """The shares' partials are summed in share order whichever share finishes last: two runs
    give identical bits. The mask is prepared, so both runs share one plan: on a GPU the
    second run reuses the plan's kept arrival counters, which the first must have left at
    zero."""
    made = _forced(monkeypatch, True, fused)
    dims = Dims(1, 37, 61, heads_q=4, heads_kv=2, head_dim=40)
    q, k, v, mask, bias = random_problem(dims, torch.float16, device, mask="BxHkxLqxLk",
                                         bias="1xHkx1xLk", keep=0.5)
    assert_deterministic_grads(q, k, v, prepare_mask(mask, q, k, True), bias, True)
    assert [(plan.head_shares, plan.fused is not None) for plan in made] == [(2, fused)]


@pytest.mark.usefixtures("no_kept_plans")
def test_dkdv_tiles_keep_the_whole_group(device, monkeypatch):
    """A deterministic gradient of a bias shared by a group's heads is summed by dkdv over the
    whole group in order, so that plan never splits, however small its grid."""
    made = _forced(monkeypatch, True)
    dims = Dims(1, 20, 30, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v, mask, bias = random_problem(dims, torch.bfloat16, device, mask="1x1x1x1",
                                         bias="1xHkxLqxLk")
    run_backward(q, k, v, None, bias, True, deterministic=True)
    assert [(plan.head_shares, plan.dbias.dkdv_tiles) for plan in made] == [(1, True)]


@pytest.mark.parametrize("group,programs,limit,expected", [
    (4, 64, 264, 4),   # B1 H8/2 L2048: 256 programs fit two waves of 132
    (4, 64, 132, 2),   # one wave: 128
    (4, 200, 264, 1),  # already most of two waves: 400 would not fit
    (6, 40, 264, 6),   # any divisor of the group, 240
    (6, 50, 264, 3),   # 300 > 264, 150 fits
    (1, 8, 264, 1),    # no group to split
])
def test_share_count_is_the_largest_divisor_that_fits(group, programs, limit, expected,
                                                      monkeypatch):
    monkeypatch.setattr(backward, "multiprocessors", lambda device, interpreted: limit // 2)
    monkeypatch.setattr(backward, "DKDV_SHARE_WAVES", 2)
    shape = AttnShape(batch=1, heads_q=2 * group, heads_kv=2, seqlen_q=64, seqlen_k=64,
                      head_dim=64)
    assert backward.dkdv_head_shares(shape, programs, torch.device("cpu")) == expected
