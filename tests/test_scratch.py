"""Scratch buffers (kernels.runtime.scratch): a plan keeps them per CUDA stream and hands them to its
next call there; off CUDA, above the size cap and during a graph capture each call gets its
own. Calls that reuse them, enqueued back to back with no synchronization between, must each
still match the float64 reference."""

from __future__ import annotations

import pytest
import torch

from attn_helpers import Dims, assert_close_to_reference, grads_of, random_bias, random_qkv
from kernels import attention_reference, call_plan, dmattn_func
from kernels.runtime import scratch as _scratch
from kernels.runtime.scratch import Scratch

SPECS = (((3, 5), torch.float32), ((7,), torch.int32))
# Decode rows over enough keys that the forward and dq split the keys (split-K partials are
# scratch) on an H100 and under the interpreter, which reports 16 multiprocessors.
DECODE = Dims(batch=1, seqlen_q=1, seqlen_k=1100, heads_q=4, heads_kv=2, head_dim=16)
FEW_ROWS = Dims(batch=1, seqlen_q=9, seqlen_k=1100, heads_q=4, heads_kv=2, head_dim=16)


def _distinct(first, second) -> bool:
    return all(a.data_ptr() != b.data_ptr() for a, b in zip(first, second))


def test_scratch_has_the_planned_shapes_and_is_kept_per_cuda_stream(device):
    scratch = Scratch(device, *SPECS)
    first = scratch.buffers()
    assert [(tuple(t.shape), t.dtype, t.device.type) for t in first] == [
        ((3, 5), torch.float32, device.type), ((7,), torch.int32, device.type)]
    second = scratch.buffers()
    if device.type != "cuda":  # the interpreter: nothing is kept
        assert _distinct(first, second)
        assert not any(scratch.keeps(t) for t in (*first, *second))
        return
    assert all(a is b for a, b in zip(first, second))
    assert all(scratch.keeps(t) for t in first) and not scratch.keeps(first[0].clone())
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        on_side = scratch.buffers()
        assert _distinct(first, on_side)
        assert all(a is b for a, b in zip(on_side, scratch.buffers()))


def test_scratch_over_the_cap_is_allocated_per_call(device, monkeypatch):
    monkeypatch.setattr(_scratch, "MAX_KEPT_BYTES", 15 * 4 + 7 * 4 - 1)
    scratch = Scratch(device, *SPECS)
    first = scratch.buffers()
    assert _distinct(first, scratch.buffers())
    assert not any(scratch.keeps(t) for t in first)


def test_scratch_taken_during_a_graph_capture_is_not_kept(device):
    if device.type != "cuda":
        assert not Scratch(device, *SPECS).keep  # no streams, no graphs: never kept
        return
    scratch = Scratch(device, *SPECS)
    kept = scratch.buffers()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = scratch.buffers()
        captured[0].fill_(1.0)  # something to capture
    assert _distinct(kept, captured)
    assert len(scratch._by_stream) == 1
    assert scratch.keeps(kept[0]) and not scratch.keeps(captured[0])


@pytest.mark.usefixtures("no_kept_plans")
def test_back_to_back_split_calls_each_match_the_reference(device):
    problems = [random_qkv(DECODE, torch.bfloat16, device) for _ in range(3)]
    plan_args = (*problems[0], None, None, True, None)
    plan = call_plan.plan_call(*plan_args, for_backward=False).plan
    assert plan.splits > 1, "the shape must take the split-K path"
    with torch.no_grad():
        outs = [dmattn_func(q, k, v, is_causal=True) for q, k, v in problems]
        with_lse = [dmattn_func(q, k, v, is_causal=True, return_lse=True) for q, k, v in problems]
    for (q, k, v), out, (out_lse, lse) in zip(problems, outs, with_lse):
        ref_out, ref_lse = attention_reference(q, k, v, None, None, True, return_lse=True)
        low_out, low_lse = attention_reference(q, k, v, None, None, True, return_lse=True,
                                               upcast=False)
        assert_close_to_reference("out", out, ref_out, low_out, q.dtype)
        assert torch.equal(out, out_lse)  # the LSE went to scratch, or to the caller
        assert_close_to_reference("lse", lse, ref_lse, low_lse, q.dtype)


@pytest.mark.usefixtures("no_kept_plans")
@pytest.mark.parametrize("dims,bias,packed", [
    pytest.param(DECODE, False, True, id="packed"),
    pytest.param(DECODE, True, True, id="packed-bias"),
    pytest.param(FEW_ROWS, True, False, id="general"),
])
def test_back_to_back_split_backwards_each_match_the_reference(dims, bias, packed, device):
    """Decode's backward is the packed launch (its key shares' dq partials are scratch); a few
    rows more than it packs take the general one, whose dq splits the keys."""
    problems = [random_qkv(dims, torch.bfloat16, device) for _ in range(3)]
    biases = [random_bias(dims.operand_shape("1", "Hk", "1", "Lk"), torch.bfloat16, device)
              if bias else None for _ in problems]
    grad_outs = [torch.randn_like(q) for q, _, _ in problems]
    # All three backwards are enqueued before any reference work.
    grads = [grads_of(dmattn_func, q, k, v, None, b, True, None, g)
             for (q, k, v), b, g in zip(problems, biases, grad_outs)]
    fwd_plan = next(iter(call_plan._plans.values())).plan
    plan = next(iter(fwd_plan.backward_plans.values()))
    assert (plan.schedule.route.value == "packed") == packed
    assert plan.splits > 1, "the backward must split the keys"
    for (q, k, v), b, g, got in zip(problems, biases, grad_outs, grads):
        upcast = None if b is None else b.float()
        truth = grads_of(attention_reference, q.float(), k.float(), v.float(), None, upcast, True,
                         None, g.double())
        low = grads_of(attention_reference, q, k, v, None, b, True, None, g, upcast=False)
        for (name, a), (_, t), (_, lo) in zip(got.named(), truth.named(), low.named()):
            assert_close_to_reference(name, a, t, lo, torch.bfloat16)
