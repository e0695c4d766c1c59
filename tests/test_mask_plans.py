"""Plans for bool masks that are not prepared (``call_plan._mask_plans``): a new mask tensor of
a layout already seen takes the kept plan, and only its values are read per call (one activity
pass, then the tile lists), as a model's padding or causal mask is, new each step.

The oracle is the same call planned afresh (``MAX_MASK_PLANS`` 0: checks, schedule and plan on
every call, as before such plans were kept): every output and gradient must be equal bit for
bit, with masks whose values change from call to call, and with them which tiles are active
and which full, on the general and the packed (decode) backward, with GQA and a bias
gradient."""

from __future__ import annotations

import pytest
import torch

from attn_helpers import (AllocationWatch, Dims, SyncWatch, forward_plans_made, grads_of,
                          random_bias, random_mask, random_qkv)
from kernels import call_plan, dmattn_func, schedule_for
from kernels.planning.backward_schedule import BackwardRoute

pytestmark = pytest.mark.usefixtures("no_kept_plans")

# dims, mask shape, bias shape, backward route
FORMS = [
    pytest.param(Dims(2, 37, 53, heads_q=4, heads_kv=2, head_dim=16), "BxHkxLqxLk",
                 "BxHkx1xLk", BackwardRoute.FUSED, id="gqa-kv_row-bias"),
    pytest.param(Dims(1, 33, 40, heads_q=2, heads_kv=2, head_dim=16), "1x1xLqxLk",
                 "1xHqxLqxLk", BackwardRoute.SEPARATE, id="mha-full-bias-dq+dkdv"),
    pytest.param(Dims(1, 1, 97, heads_q=4, heads_kv=2, head_dim=16), "1xHkxLqxLk",
                 "1xHkx1xLk", BackwardRoute.PACKED, id="decode-packed"),
]


def mask_sets(dims: Dims, shape: tuple, device) -> list[torch.Tensor]:
    """New masks of one layout whose values change from one to the next: only the first keys
    kept, then only the last ones, then none, then random ones."""
    keys = torch.arange(dims.seqlen_k, device=device)
    lk = dims.seqlen_k
    first = (keys < lk // 3).expand(shape).contiguous()
    last = (keys >= lk - lk // 3).expand(shape).contiguous()
    torch.manual_seed(0)
    return [first, last, torch.zeros(shape, dtype=torch.bool, device=device),
            random_mask(shape, device, keep=0.3), random_mask(shape, device, keep=0.8)]


def fwd_bwd(q, k, v, mask, bias, grad_out, options):
    """(out, lse, dq, dk, dv, dbias) of one causal call with gradients."""
    q, k, v, bias = (t.detach().requires_grad_() for t in (q, k, v, bias))
    out, lse = dmattn_func(q, k, v, mask, bias, True, return_lse=True, kernel_options=options)
    return (out, lse, *torch.autograd.grad(out, (q, k, v, bias), grad_out))


def no_grad_forward(q, k, v, mask, bias, options):
    with torch.no_grad():
        return dmattn_func(q, k, v, mask, bias, True, return_lse=True, kernel_options=options)


def assert_equal_bits(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {i} differs"


@pytest.mark.parametrize("dims,mask_shape,bias_shape,route", FORMS)
def test_new_masks_take_the_kept_plan_with_the_bits_of_planning_afresh(
        dims, mask_shape, bias_shape, route, device, monkeypatch):
    dtype = torch.float16
    q, k, v = random_qkv(dims, dtype, device)
    bias = random_bias(dims.operand_shape(*bias_shape.split("x")), dtype, device)
    grad_out = torch.randn(q.shape, device=device).to(dtype)
    options = {"backward": route.value}
    masks = mask_sets(dims, dims.operand_shape(*mask_shape.split("x")), device)
    assert schedule_for(q, k, v, masks[0], bias, True, kernel_options=options,
                        bias_requires_grad=True).backward.route is route
    call_plan._mask_plans.clear()

    monkeypatch.setattr(call_plan, "MAX_MASK_PLANS", 0)
    afresh = [(fwd_bwd(q, k, v, m, bias, grad_out, options),
               no_grad_forward(q, k, v, m, bias, options)) for m in masks]
    assert not call_plan._mask_plans
    monkeypatch.undo()

    made = forward_plans_made(monkeypatch)
    # Fresh allocations are poisoned: a list or map entry the call leaves unwritten shows.
    with AllocationWatch():
        for mask, (want, want_no_grad) in zip(masks, afresh):
            assert_equal_bits(fwd_bwd(q, k, v, mask.clone(), bias, grad_out, options), want)
            assert_equal_bits(no_grad_forward(q, k, v, mask.clone(), bias, options),
                              want_no_grad)
    # One plan with a backward, one without (its map is only as fine as the forward's tile).
    assert len(made) == 2 and len(call_plan._mask_plans) == 2
    for plan in made:  # a kept plan holds no tensor of the call that made it
        assert plan.lists_per_call and plan.activity is None and plan.list_table is None
        assert plan.schedule.problem.activity is None


def test_forwards_of_several_layers_then_their_backwards(device):
    """Layers of one form run their forwards, then the backwards in reverse (a model's step):
    each backward walks the lists of its own forward's mask."""
    dims = Dims(2, 37, 53, heads_q=4, heads_kv=2, head_dim=16)
    dtype = torch.float16
    masks = mask_sets(dims, dims.operand_shape("B", "1", "Lq", "Lk"), device)[:3]
    layers = [(*random_qkv(dims, dtype, device),
               random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), dtype, device))
              for _ in masks]
    grad_outs = [torch.randn(layer[0].shape, device=device).to(dtype) for layer in layers]
    alone = [grads_of(dmattn_func, q, k, v, m, bias, True, None, g)
             for (q, k, v, bias), m, g in zip(layers, masks, grad_outs)]
    leaves = [[t.detach().requires_grad_() for t in layer] for layer in layers]
    outs = [dmattn_func(*leaf[:3], m, leaf[3], True) for leaf, m in zip(leaves, masks)]
    assert len(call_plan._mask_plans) == 1
    loss = sum((out * g).sum() for out, g in zip(outs, grad_outs))
    grads = torch.autograd.grad(loss, [t for leaf in leaves for t in leaf])
    for i, want in enumerate(alone):
        assert_equal_bits(grads[4 * i:4 * i + 4], (want.dq, want.dk, want.dv, want.dbias))


def test_each_layout_of_mask_gets_its_own_plan(device, monkeypatch):
    """A plan is never taken by a mask of another layout (broadcast axes, strides) or by a
    call differing in causality: each gets its own plan, with the bits of planning afresh."""
    dims = Dims(2, 21, 37, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    full = random_mask(dims.operand_shape("B", "Hk", "Lq", "Lk"), device, keep=0.5)
    cases = [("full", full, True),
             ("one head", full[:, :1].contiguous(), True),
             ("query heads", full.repeat_interleave(2, dim=1), True),
             ("batch broadcast", full[:1], True),
             ("keys only", full[:, :, :1].contiguous(), True),
             ("non-contiguous", full.transpose(2, 3).contiguous().transpose(2, 3), True),
             ("not causal", full, False)]

    def call(mask, causal):
        with torch.no_grad():
            return dmattn_func(q, k, v, mask, None, causal, return_lse=True)

    monkeypatch.setattr(call_plan, "MAX_MASK_PLANS", 0)
    afresh = [call(m, causal) for _, m, causal in cases]
    monkeypatch.setattr(call_plan, "MAX_MASK_PLANS", len(cases))
    for (name, m, causal), want in zip(cases, afresh):
        assert_equal_bits(call(m.clone(), causal), want)
    assert len(call_plan._mask_plans) == len(cases)
    for (name, m, causal), want in zip(cases, afresh):  # and again, from the kept plans
        assert_equal_bits(call(m.clone(), causal), want)
    assert len(call_plan._mask_plans) == len(cases)


def test_a_mask_of_another_dtype_is_still_refused(device):
    """A kept plan of a bool layout is never taken by a float mask of the same shape: the
    call is checked and refused as before."""
    dims = Dims(1, 9, 17, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    mask = random_mask(dims.operand_shape("1", "1", "Lq", "Lk"), device)
    with torch.no_grad():
        dmattn_func(q, k, v, mask, None, True)
        with pytest.raises(TypeError, match="attn_mask"):
            dmattn_func(q, k, v, mask.float(), None, True)


def test_a_kept_mask_plan_reads_no_value_back(device):
    """A call taking a kept plan waits for nothing on the device (a CUDA graph can capture it):
    its per-call work is the activity pass, the list compactions and the kernels."""
    dims = Dims(1, 17, 33, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    bias = random_bias(dims.operand_shape("1", "Hk", "1", "Lk"), torch.float16, device)
    grad_out = torch.randn(q.shape, device=device).to(q.dtype)
    shape = dims.operand_shape("1", "Hk", "Lq", "Lk")
    grads_of(dmattn_func, q, k, v, random_mask(shape, device), bias, True, None, grad_out)
    assert len(call_plan._mask_plans) == 1
    with SyncWatch() as watch:
        grads_of(dmattn_func, q, k, v, random_mask(shape, device), bias, True, None, grad_out)
    assert not watch.syncs, f"ops that wait for the device: {watch.syncs}"
    assert len(call_plan._mask_plans) == 1
