"""dkdv with its GQA group's query heads split into shares: each share's program writes fp32
partials of dk and dv, and the last share of each key block to finish sums them. Whether a shape splits depends on its grid
and the GPU, so each case runs with the split forced on and off and checks every gradient
against float64 autograd of the reference; the bias kinds cover each way its gradient is made
(summed rows, dq-written tiles with and without atomics, dkdv-written tiles)."""

from __future__ import annotations

import pytest
import torch

from attn_helpers import (Dims, assert_deterministic_grads, backward_schedule, forcing,
                          random_problem, run_backward)
from kernels import prepare_mask
from kernels.planning.inputs import AttnShape
from kernels.planning.backward_schedule import dkdv_head_shares
from kernels.planning.problem import Problem

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


def _options(dims: Dims, split: bool, fused: bool = False, **more) -> dict:
    """kernel_options splitting dkdv as far as the group allows (or not at all), fused with dq
    in one launch or not."""
    return {"backward": "fused" if fused else "dq+dkdv",
            "dkdv_head_shares": dims.heads_q // dims.heads_kv if split else 1, **more}


@pytest.mark.parametrize("split", (True, False), ids=("shares", "whole-group"))
@pytest.mark.parametrize("dims,mask_axes,bias_axes,causal", CASES)
def test_head_shares_give_the_reference_gradients(dims, mask_axes, bias_axes, causal, split,
                                                  device):
    options = _options(dims, split)
    q, k, v, mask, bias = random_problem(dims, torch.bfloat16, device,
                                         mask=mask_axes or "1x1x1x1", bias=bias_axes,
                                         keep=0.6)
    mask = mask if mask_axes else None
    run_backward(q, k, v, mask, bias, causal, func=forcing(**options))
    bwd = backward_schedule(q, k, v, mask, bias, causal, kernel_options=options)
    group = dims.heads_q // dims.heads_kv
    assert bwd.general.dkdv_head_shares == (group if split else 1)
    # One-row biases: with shares, each key block's last share sums the group's rows.
    assert bwd.general.dkdv_group_rows == (split and bias_axes.endswith("x1xLk"))


@pytest.mark.parametrize("bias_axes", ("1xHkx1xLk", "BxHqxLqxLk"), ids=("kv_row", "q_full"))
def test_head_shares_in_the_fused_launch(bias_axes, device):
    """The fused launch's dkdv programs split the group too, and merge like the dkdv launch
    (with a one-row bias, its group rows as well), beside split-K dq programs."""
    dims = Dims(1, 9, 150, heads_q=4, heads_kv=2, head_dim=40)
    options = _options(dims, True, fused=True, dq_key_splits=3)
    q, k, v, mask, bias = random_problem(dims, torch.bfloat16, device, mask="BxHkxLqxLk",
                                         bias=bias_axes, keep=0.6)
    run_backward(q, k, v, mask, bias, True, func=forcing(**options))
    bwd = backward_schedule(q, k, v, mask, bias, True, kernel_options=options)
    general = bwd.general
    assert (bwd.route.value, general.dkdv_head_shares, general.dq_key_splits) == ("fused", 2, 3)
    assert general.dkdv_group_rows == (bias_axes == "1xHkx1xLk")


@pytest.mark.parametrize("fused", (False, True), ids=("separate", "fused"))
def test_head_shares_are_deterministic(fused, device):
    """The shares' partials are summed in share order whichever share finishes last: two runs
    give identical bits. The mask is prepared, so both runs share one plan: on a GPU the
    second run reuses the plan's kept arrival counters, which the first must have left at
    zero."""
    dims = Dims(1, 37, 61, heads_q=4, heads_kv=2, head_dim=40)
    options = _options(dims, True, fused)
    q, k, v, mask, bias = random_problem(dims, torch.float16, device, mask="BxHkxLqxLk",
                                         bias="1xHkx1xLk", keep=0.5)
    prepared = prepare_mask(mask, q, k, True)
    assert_deterministic_grads(q, k, v, prepared, bias, True, func=forcing(**options))
    bwd = backward_schedule(q, k, v, prepared, bias, True, deterministic=True,
                            kernel_options=options)
    assert bwd.general.dkdv_head_shares == 2
    assert bwd.route.value == ("fused" if fused else "dq+dkdv")


def test_dkdv_tiles_keep_the_whole_group(device):
    """A deterministic gradient of a bias shared by a group's heads is summed by dkdv over the
    whole group in order, so that plan never splits, however small its grid, and a forced
    split is refused."""
    dims = Dims(1, 20, 30, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v, mask, bias = random_problem(dims, torch.bfloat16, device, mask="1x1x1x1",
                                         bias="1xHkxLqxLk")
    run_backward(q, k, v, None, bias, True, deterministic=True)
    bwd = backward_schedule(q, k, v, None, bias, True, deterministic=True)
    assert bwd.general.dkdv_head_shares == 1
    assert bwd.dbias_mode.value == "dkdv-tiles-ordered"
    with pytest.raises(ValueError, match="dkdv_head_shares"):
        backward_schedule(q, k, v, None, bias, True, deterministic=True,
                          kernel_options={"dkdv_head_shares": 2})


@pytest.mark.parametrize("group,programs,limit,expected", [
    (4, 64, 264, 4),   # B1 H8/2 L2048: 256 programs fit two waves of 132
    (4, 64, 132, 2),   # one wave: 128
    (4, 200, 264, 1),  # already most of two waves: 400 would not fit
    (6, 40, 264, 6),   # any divisor of the group, 240
    (6, 50, 264, 3),   # 300 > 264, 150 fits
    (1, 8, 264, 1),    # no group to split
])
def test_share_count_is_the_largest_divisor_that_fits(group, programs, limit, expected):
    shape = AttnShape(batch=1, heads_q=2 * group, heads_kv=2, seqlen_q=64, seqlen_k=64,
                      head_dim=64)
    # tuning.DKDV_SHARE_WAVES is 2: the limit is two waves of limit // 2 multiprocessors.
    problem = Problem(shape, torch.bfloat16, torch.device("cpu"), interpreted=False,
                      multiprocessors=limit // 2, is_causal=False, softmax_scale=0.125)
    assert dkdv_head_shares(problem, programs) == expected
