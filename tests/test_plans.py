"""Call plans (kernels.call_plan): a repeat call signature reuses the forward plan (and the
backward plans it keeps) with no checks or planning, so everything a plan depends on must be in
the signature. Each test makes a plan with one call, then changes one thing and checks the next
call against the float64 reference: a signature that missed the change would launch with the
first call's strides, sizes or flags and fail."""

from __future__ import annotations

import math

import pytest
import torch

from attn_helpers import (Dims, assert_grads_close_to_reference, backward_schedules,
                          random_bias, random_mask, random_qkv, run_backward, run_forward)
from kernels import call_plan, dmattn_func, prepare_mask, schedule_for
from kernels.planning.backward_schedule import dkdv_stages
from kernels.planning.problem import OperandLayout, Problem
from kernels.planning.tuning import Tile

DIMS = Dims(batch=2, seqlen_q=17, seqlen_k=33, heads_q=4, heads_kv=2, head_dim=16)


# Every test plans afresh: an earlier test may have made a plan of the very signature a test
# here means to change to.
pytestmark = pytest.mark.usefixtures("no_kept_plans")


def _kept_plan(q, k, v, bias=None, causal=False, scale=None, bias_grad=False):
    """The plan kept for a mask-free call of this signature (None if there is none);
    ``bias_grad``: the call's bias gets a gradient (its schedule includes that backward)."""
    kept = call_plan._plans.get(call_plan.call_signature(q, k, v, bias, causal, scale,
                                                         bias_grad=bias_grad))
    return None if kept is None else kept.plan


def test_a_repeat_call_reuses_its_plan_and_stays_correct(device):
    q, k, v = random_qkv(DIMS, torch.float16, device)
    bias = random_bias(DIMS.operand_shape("1", "Hk", "1", "Lk"), torch.float16, device)
    run_forward(q, k, v, None, bias, True)
    plan = _kept_plan(q, k, v, bias, True)
    assert plan is not None
    q2, k2, v2 = random_qkv(DIMS, torch.float16, device)  # new data, same signature
    bias2 = random_bias(bias.shape, torch.float16, device)
    run_forward(q2, k2, v2, None, bias2, True)
    run_backward(q2, k2, v2, None, bias2, True)
    run_backward(q, k, v, None, bias, True)
    assert _kept_plan(q, k, v, bias, True) is plan
    # A call whose bias gets a gradient is a signature of its own, and its plan keeps the one
    # backward plan both backward runs used.
    grad_plan = _kept_plan(q, k, v, bias, True, bias_grad=True)
    assert grad_plan is not plan and not plan.backward_plans
    assert len(grad_plan.backward_plans) == 1


CHANGES = ("seqlen_q", "seqlen_k", "heads", "head_dim", "layout", "dtype", "causal", "scale",
           "bias_shape", "bias_strides")


def _changed(change: str, device):
    """(q, k, v, bias, causal, scale) of a first call, and of a second differing in ``change``."""
    def problem(dims=DIMS, dtype=torch.float16, layout="contiguous", bias_shape=None,
                causal=False, scale=None):
        q, k, v = random_qkv(dims, dtype, device, layout)
        bias = random_bias(bias_shape or dims.operand_shape("B", "Hq", "Lq", "Lk"), dtype,
                           device)
        return q, k, v, bias, causal, scale

    first = problem()
    second = {
        "seqlen_q": lambda: problem(Dims(2, 18, 33, 4, 2, 16)),
        "seqlen_k": lambda: problem(Dims(2, 17, 31, 4, 2, 16)),
        "heads": lambda: problem(Dims(2, 17, 33, 4, 4, 16)),
        "head_dim": lambda: problem(Dims(2, 17, 33, 4, 2, 40)),
        "layout": lambda: problem(layout="bhld"),
        "dtype": lambda: problem(dtype=torch.bfloat16),
        "causal": lambda: problem(causal=True),
        "scale": lambda: problem(scale=0.3),
        "bias_shape": lambda: problem(bias_shape=DIMS.operand_shape("1", "Hk", "Lq", "Lk")),
        "bias_strides": lambda: tuple(
            t.transpose(2, 3).contiguous().transpose(2, 3) if i == 3 else t
            for i, t in enumerate(problem())),
    }[change]()
    return first, second


@pytest.mark.parametrize("change", CHANGES)
def test_a_changed_signature_gets_its_own_plan(change, device):
    first, second = _changed(change, device)
    q, k, v, bias, causal, scale = first
    run_forward(q, k, v, None, bias, causal, scale)
    q, k, v, bias, causal, scale = second
    assert _kept_plan(q, k, v, bias, causal, scale) is None
    run_forward(q, k, v, None, bias, causal, scale)
    run_backward(q, k, v, None, bias, causal, scale)


def test_the_grad_signature_picks_the_backward_plan(device):
    """grad_out's strides pick the backward plan a forward plan keeps; ``deterministic`` (a
    shared bias's dbias is serialized) is part of the call's signature, whose schedule holds
    its backward."""
    q, k, v = random_qkv(DIMS, torch.float16, device)
    bias = random_bias(DIMS.operand_shape("1", "1", "Lq", "Lk"), torch.float16, device)
    run_backward(q, k, v, None, bias, True)
    strided = torch.randn(q.shape[0], q.shape[2], q.shape[1], q.shape[3], device=device)
    run_backward(q, k, v, None, bias, True, grad_out=strided.to(q.dtype).transpose(1, 2))
    run_backward(q, k, v, None, bias, True, deterministic=True)
    assert len(_kept_plan(q, k, v, bias, True, bias_grad=True).backward_plans) == 2
    deterministic = call_plan._plans.get(call_plan.call_signature(
        q, k, v, bias, True, None, deterministic=True, bias_grad=True)).plan
    assert len(deterministic.backward_plans) == 1
    assert deterministic.schedule.backward.dbias_mode.value == "dkdv-tiles-ordered"


def test_key_and_value_are_separate_pointers_even_when_first_the_same(device):
    q, k, v = random_qkv(DIMS, torch.float16, device)
    run_forward(q, k, k)
    run_forward(q, k, v)
    run_backward(q, k, v)


def test_a_kept_signature_still_reports_bad_input(device):
    q, k, v = random_qkv(DIMS, torch.float16, device)
    dmattn_func(q, k, v, softmax_scale=0.5)
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        dmattn_func(q, k, v, softmax_scale=math.nan)
    with pytest.raises(TypeError, match="softmax_scale must be a float or None"):
        dmattn_func(q, k, v, softmax_scale=torch.tensor(0.5))
    with pytest.raises(TypeError, match="value must be a torch.Tensor"):
        dmattn_func(q, k, v.tolist())
    with pytest.raises(TypeError, match="value dtype must match query dtype"):
        dmattn_func(q, k, v.float())
    with pytest.raises(ValueError, match="attn_bias dimension 3"):
        dmattn_func(q, k, v, attn_bias=torch.zeros(1, 1, 1, 2, dtype=q.dtype, device=device))


def test_no_grad_calls_match_recorded_ones(device):
    """Calls that record no graph skip autograd.Function; the kernels are the same."""
    q, k, v = random_qkv(DIMS, torch.bfloat16, device)
    mask = random_mask(DIMS.operand_shape("B", "Hk", "Lq", "Lk"), device)
    bias = random_bias(DIMS.operand_shape("1", "Hk", "1", "Lk"), torch.bfloat16, device)
    for attn_mask in (None, mask, prepare_mask(mask, q, k, True)):
        with torch.no_grad():
            plain = dmattn_func(q, k, v, attn_mask, bias, True, return_lse=True)
        recorded = dmattn_func(q.requires_grad_(), k, v, attn_mask, bias, True,
                               return_lse=True)
        q.requires_grad_(False)
        assert recorded[0].grad_fn is not None and plain[0].grad_fn is None
        assert all(torch.equal(a, b) for a, b in zip(plain, recorded))


def test_a_prepared_mask_keeps_its_plans_and_refuses_a_later_write(device):
    q, k, v = random_qkv(DIMS, torch.float16, device)
    mask = random_mask(DIMS.operand_shape("1", "Hk", "Lq", "Lk"), device)
    prepared = prepare_mask(mask, q, k, True)

    def with_prepared(q, k, v, _mask, *args, **kwargs):  # the reference still sees ``mask``
        return dmattn_func(q, k, v, prepared, *args, **kwargs)

    for _ in range(2):
        run_forward(q, k, v, mask, None, True, func=with_prepared)
    run_backward(q, k, v, mask, None, True, func=with_prepared)
    assert len(prepared.plans) == 1
    mask[0, 0, 0, :] = False
    with pytest.raises(ValueError, match="attn_mask: the mask was written in place"):
        dmattn_func(q, k, v, prepared, is_causal=True)


def _activity(mask, device):
    from kernels.planning.activity import tile_activity
    from kernels.planning.inputs import check_inputs

    dims = Dims(1, mask.shape[2], mask.shape[3], heads_q=1, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    checked = check_inputs(q, k, v, mask, None, None)
    return tile_activity(checked.mask, checked.shape, 16, 16, False)


def _stage_problem(block_d: int, dtype, activity, masked: bool = True) -> Problem:
    shape = Dims(1, 128, 128, heads_q=2, heads_kv=1, head_dim=block_d)
    mask = OperandLayout((1, 1, 128, 128), 2) if masked else None
    return Problem(shape, dtype, torch.device("cpu"), interpreted=False, multiprocessors=132,
                   is_causal=False, softmax_scale=0.125, mask=mask, activity=activity)


def test_dkdv_pipeline_depth_follows_its_partial_tile_share(device):
    """Two stages where dkdv's tiles are mostly partial (or were not counted: a mask read in
    the call), the tile's own where they are mostly full, and outside 64 < D <= 128 in
    16-bit, which is all that was measured."""
    tile = Tile(32, 64, 4, 3)
    element = _activity(random_mask((1, 1, 128, 128), device, keep=0.3), device)
    blocks = torch.zeros((1, 1, 128, 128), dtype=torch.bool, device=device)
    blocks[..., :64, 64:] = True  # whole (32 query, 64 key) tiles
    blocks[..., 96:, :64] = True
    block_sparse = _activity(blocks, device)
    uncounted = _activity(blocks, device)
    assert element.count_partial_share(64, 32, True) > 0.5
    assert block_sparse.count_partial_share(64, 32, True) == 0.0
    bf16, fp16 = torch.bfloat16, torch.float16
    assert dkdv_stages(_stage_problem(128, bf16, element), tile) == 2
    assert dkdv_stages(_stage_problem(128, fp16, block_sparse), tile) == 3
    assert dkdv_stages(_stage_problem(128, bf16, uncounted), tile) == 2
    assert dkdv_stages(_stage_problem(128, bf16, None, masked=False), tile) == 3
    assert dkdv_stages(_stage_problem(128, torch.float32, element), tile) == 3
    assert dkdv_stages(_stage_problem(64, bf16, element), tile) == 3
    assert dkdv_stages(_stage_problem(256, bf16, element), tile) == 3
    assert dkdv_stages(_stage_problem(128, bf16, element), Tile(16, 32, 4, 1)) == 1


def test_prepare_mask_counts_dkdv_partial_tiles(device):
    q, k, v = random_qkv(DIMS, torch.bfloat16, device)
    mask = random_mask(DIMS.full_operand_shape("Hk"), device)
    prepared = prepare_mask(mask, q, k)
    dkdv = schedule_for(q, k, v, prepared).backward.general.dkdv
    share = prepared.activity.partial_share(dkdv.block_n, dkdv.block_m, True)
    assert share is not None and 0.0 <= share <= 1.0


def test_prepare_mask_in_a_graph_capture_leaves_the_share_uncounted(device, monkeypatch):
    """Counting syncs, which a CUDA graph capture forbids: a mask prepared while one is being
    captured is not counted (dkdv then takes the depth of a mostly partial mask)."""
    from kernels.planning import backward

    q, k, v = random_qkv(DIMS, torch.bfloat16, device)
    mask = random_mask(DIMS.full_operand_shape("Hk"), device)
    cfg_kv = schedule_for(q, k, v, mask).backward.general.dkdv
    if device.type == "cuda":
        prepare_mask(mask, q, k)  # compile the list kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            prepared = prepare_mask(mask, q, k)
    else:  # no graphs off CUDA: the check itself is what is tested
        monkeypatch.setattr(backward, "graph_capturing", lambda device: True)
        prepared = prepare_mask(mask, q, k)
    assert prepared.activity.partial_share(cfg_kv.block_n, cfg_kv.block_m, True) is None


def test_masked_forward_tiles_at_padded_head_dims():
    """A mask (bool or KeyIntervals: the schedule does not tell them apart) takes the masked
    forward tile of its padded head dim, padded (80, 96, 192) or not; without a mask, D80/D96
    take the unmasked tile."""
    from kernels.planning import tuning
    from kernels.planning.forward_schedule import forward_tile

    def tile(head_dim, masked=True):
        shape = Dims(1, 4096, 4096, heads_q=16, heads_kv=4, head_dim=head_dim)
        mask = OperandLayout((1, 4, 4096, 4096), 4) if masked else None
        return forward_tile(Problem(shape, torch.bfloat16, torch.device("cuda"),
                                    interpreted=False, multiprocessors=132, is_causal=True,
                                    softmax_scale=0.1, mask=mask))

    for head_dim in (80, 96):
        assert tile(head_dim) == tuning.FORWARD_D128_MASKED
        assert tile(head_dim, masked=False) == tuning.FORWARD_D128
    assert tile(128) == tuning.FORWARD_D128_MASKED
    assert tile(192) == tuning.FORWARD_D256
    assert tile(256) == tuning.FORWARD_D256
    assert tile(64) == tuning.FORWARD_D64


@pytest.mark.parametrize("split_captured", [False, True])
def test_a_captured_backward_keeps_a_plan_of_its_own(split_captured, monkeypatch, device):
    """With ``tuning.HOPPER_BACKWARD_SPLIT_CAPTURED`` a backward run during a CUDA graph
    capture is scheduled as captured (``Problem.captured``, chosen by GPU time) and keeps a
    backward plan beside the eager one; without it one plan serves both. Every run matches the
    reference."""
    from kernels.planning import backward, tuning

    monkeypatch.setattr(tuning, "HOPPER_BACKWARD_SPLIT_CAPTURED", split_captured)
    capturing = [False]
    monkeypatch.setattr(backward, "graph_capturing", lambda device: capturing[0])
    scheduled = backward_schedules(monkeypatch)
    q, k, v = random_qkv(DIMS, torch.float16, device)
    grad_out = torch.randn_like(q)
    for capturing[0] in (False, True, False, True):
        assert_grads_close_to_reference(q, k, v, None, None, True, grad_out, torch.float16)
    plan = _kept_plan(q, k, v, None, True)
    kept = sorted(signature[-1] for signature in plan.backward_plans)
    assert kept == ([False, True] if split_captured else [False])
    assert scheduled == ([True] if split_captured else [])
