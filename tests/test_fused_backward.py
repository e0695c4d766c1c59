"""The backward's two launch plans: dq and dkdv as separate launches (dkdv reads the delta dq
stored), or one fused launch of both kinds of program (each rebuilds delta itself). Which one
a shape takes depends on its grid and the GPU, so each case here runs with each plan forced and
checks every gradient against float64 autograd of the reference."""

from __future__ import annotations

import pytest
import torch

from attn_helpers import Dims, backward_schedule, forcing, random_problem, run_backward
from kernels.planning.backward_schedule import BackwardRoute

SPLIT_DIMS = Dims(1, 9, 1031, heads_q=4, heads_kv=2, head_dim=40)  # 18 rows per group
# (dims, mask axes or None, bias axes or None, causal): what a plan change could break.
CASES = [
    # GQA with a mask and a one-row bias (dbias summed over rows and the group's heads).
    pytest.param(Dims(2, 17, 33, heads_q=4, heads_kv=2, head_dim=16), "BxHkxLqxLk",
                 "1xHkx1xLk", True, id="gqa-mask-kv_row"),
    # A bias shared by every head and batch: atomic dbias across programs.
    pytest.param(Dims(2, 33, 17, heads_q=4, heads_kv=2, head_dim=40), None, "1x1xLqxLk", True,
                 id="lq>lk-shared-bias"),
    # A per-kv-head full bias: the group's heads add into one tile (load-add-store).
    pytest.param(Dims(1, 20, 97, heads_q=4, heads_kv=1, head_dim=80), "1x1xLqxLk", "1xHkxLqxLk",
                 False, id="mqa-full-bias"),
    # A few query rows over many keys: dq splits the keys (partials the last share sums).
    # (Decode itself, with at most 16 rows per GQA group, takes the packed backward.)
    pytest.param(SPLIT_DIMS, "BxHkxLqxLk", "BxHkx1xLk", True, id="few-rows-split"),
]


@pytest.mark.parametrize("route", (BackwardRoute.FUSED, BackwardRoute.SEPARATE),
                         ids=("fused", "separate"))
@pytest.mark.parametrize("dims,mask_axes,bias_axes,causal", CASES)
def test_both_launch_plans_give_the_reference_gradients(dims, mask_axes, bias_axes, causal,
                                                         route, device):
    q, k, v, mask, bias = random_problem(dims, torch.bfloat16, device,
                                         mask=mask_axes or "1x1x1x1", bias=bias_axes or "1x1x1x1",
                                         keep=0.6)
    mask, bias = (mask if mask_axes else None), (bias if bias_axes else None)
    options = {"backward": route.value}
    run_backward(q, k, v, mask, bias, causal, func=forcing(**options))
    bwd = backward_schedule(q, k, v, mask, bias, causal, kernel_options=options)
    assert bwd.route is route
    if dims == SPLIT_DIMS:
        assert bwd.general.dq_key_splits > 1, "this case must split dq over the keys"
