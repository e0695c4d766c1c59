"""Plans for KeyIntervals used once (``call_plan._interval_plans``): a new intervals object of
a form already seen takes the kept plan, and only reads its own values (the interleaved pairs,
an activity map and the tile lists) per call.

The oracle is the same call planned afresh (no plan kept, ``MAX_INTERVAL_PLANS`` 0: checks,
schedule and plan on every call, as before plans were kept): every output and gradient must be
equal bit for bit, with intervals that change from call to call, and change which tiles are
active, on the general and the packed (decode) backward, with GQA and a bias gradient."""

from __future__ import annotations

import pytest
import torch

from attn_helpers import (AllocationWatch, Dims, SyncWatch, forward_plans_made, grads_of,
                          random_bias, random_intervals, random_qkv)
from kernels import KeyIntervals, call_plan, dmattn_func, prepare_mask, schedule_for
from kernels.planning.backward_schedule import BackwardRoute

pytestmark = pytest.mark.usefixtures("no_kept_plans")

# dims, interval heads and batch (see random_intervals), bias shape, backward route
FORMS = [
    pytest.param(Dims(2, 37, 53, heads_q=4, heads_kv=2, head_dim=16), "Hk", "B", "BxHkx1xLk",
                 BackwardRoute.FUSED, id="gqa-kv_row-bias"),
    pytest.param(Dims(1, 33, 40, heads_q=2, heads_kv=2, head_dim=16), "1", "1", "1xHqxLqxLk",
                 BackwardRoute.SEPARATE, id="mha-full-bias-dq+dkdv"),
    pytest.param(Dims(1, 1, 97, heads_q=4, heads_kv=2, head_dim=16), "Hk", "1", "1xHkx1xLk",
                 BackwardRoute.PACKED, id="decode-packed"),
]


def interval_sets(dims: Dims, heads: str, batch: str, device) -> list[KeyIntervals]:
    """New intervals objects of one form, whose values change from one to the next, and with
    them which tiles are active and which full: only the first keys seen (by every row), then
    only the last ones, then none, then random runs."""
    drawn = [random_intervals(dims, heads, batch, device, seed=seed) for seed in (0, 1)]
    start, end = drawn[0].start, drawn[0].end
    lk, lq = dims.seqlen_k, dims.seqlen_q
    keys = torch.arange(lk, device=device)
    first = torch.where(keys < lk // 3, lq, 0).to(end.dtype).expand_as(end)
    last = torch.where(keys >= lk - lk // 3, lq, 0).to(end.dtype).expand_as(end)
    zeros = torch.zeros_like(start)
    return [KeyIntervals(zeros, first.contiguous()), KeyIntervals(zeros.clone(), last.contiguous()),
            KeyIntervals(zeros.clone(), torch.zeros_like(end))] + drawn


def used_once(intervals: KeyIntervals) -> KeyIntervals:
    """A new object of the same tensors: its call is its first, so it is read by the call (a
    second call with one object would prepare it, ``prepared.prepared_intervals``)."""
    return KeyIntervals(intervals.start, intervals.end)


def fwd_bwd(q, k, v, intervals, bias, grad_out, options):
    """(out, lse, dq, dk, dv, dbias) of one causal call with gradients."""
    q, k, v, bias = (t.detach().requires_grad_() for t in (q, k, v, bias))
    out, lse = dmattn_func(q, k, v, used_once(intervals), bias, True, return_lse=True,
                           kernel_options=options)
    return (out, lse, *torch.autograd.grad(out, (q, k, v, bias), grad_out))


def no_grad_forward(q, k, v, intervals, bias, options):
    with torch.no_grad():
        return dmattn_func(q, k, v, used_once(intervals), bias, True, return_lse=True,
                           kernel_options=options)


def assert_equal_bits(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {i} differs"


@pytest.mark.parametrize("dims,heads,batch,bias_shape,route", FORMS)
def test_new_intervals_take_the_kept_plan_with_the_bits_of_planning_afresh(
        dims, heads, batch, bias_shape, route, device, monkeypatch):
    dtype = torch.float16
    q, k, v = random_qkv(dims, dtype, device)
    bias = random_bias(dims.operand_shape(*bias_shape.split("x")), dtype, device)
    grad_out = torch.randn(q.shape, device=device).to(dtype)
    options = {"backward": route.value}
    sets = interval_sets(dims, heads, batch, device)
    assert schedule_for(q, k, v, used_once(sets[0]), bias, True, kernel_options=options,
                        bias_requires_grad=True).backward.route is route

    monkeypatch.setattr(call_plan, "MAX_INTERVAL_PLANS", 0)
    afresh = [(fwd_bwd(q, k, v, s, bias, grad_out, options),
               no_grad_forward(q, k, v, s, bias, options)) for s in sets]
    assert not call_plan._interval_plans
    monkeypatch.undo()

    made = forward_plans_made(monkeypatch)
    # Fresh allocations are poisoned: a list or map entry the call leaves unwritten shows.
    with AllocationWatch():
        for s, (want, want_no_grad) in zip(interval_sets(dims, heads, batch, device), afresh):
            assert_equal_bits(fwd_bwd(q, k, v, s, bias, grad_out, options), want)
            assert_equal_bits(no_grad_forward(q, k, v, s, bias, options), want_no_grad)
    # One plan with a backward, one without (its map is only as fine as the forward's tile).
    assert len(made) == 2 and len(call_plan._interval_plans) == 2
    with_grad = next(p for p in made if p.backward_plans)
    assert len(with_grad.backward_plans) == 1
    for plan in made:  # a kept plan holds no tensor of the call that made it
        assert plan.lists_per_call and plan.activity is None and plan.list_table is None
        assert plan.schedule.problem.activity is None
    (backward_plan,) = with_grad.backward_plans.values()
    assert getattr(backward_plan, "kv_table", None) is None
    assert getattr(backward_plan, "q_table", None) is None


def test_forwards_of_several_layers_then_their_backwards(device):
    """Layers of one form run their forwards, then the backwards in reverse (a model's
    step): each backward walks the lists of its own forward's intervals."""
    dims = Dims(2, 37, 53, heads_q=4, heads_kv=2, head_dim=16)
    dtype = torch.float16
    sets = interval_sets(dims, "Hk", "B", device)[:3]
    layers = [(*random_qkv(dims, dtype, device),
               random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), dtype, device))
              for _ in sets]
    grad_outs = [torch.randn(layer[0].shape, device=device).to(dtype) for layer in layers]
    alone = [grads_of(dmattn_func, q, k, v, used_once(s), bias, True, None, g)
             for (q, k, v, bias), s, g in zip(layers, sets, grad_outs)]
    leaves = [[t.detach().requires_grad_() for t in layer] for layer in layers]
    outs = [dmattn_func(*leaf[:3], used_once(s), leaf[3], True) for leaf, s in zip(leaves, sets)]
    assert len(call_plan._interval_plans) == 1
    loss = sum((out * g).sum() for out, g in zip(outs, grad_outs))
    grads = torch.autograd.grad(loss, [t for leaf in leaves for t in leaf])
    for i, want in enumerate(alone):
        assert_equal_bits(grads[4 * i:4 * i + 4], (want.dq, want.dk, want.dv, want.dbias))


def _form_changes(dims: Dims, device):
    """(name, intervals) pairs of one call, each differing from the first in one thing that
    makes it another form of intervals."""
    base = random_intervals(dims, "Hk", "B", device, seed=3)
    start, end = base.start, base.end
    row = random_intervals(dims, "Hk", "1", device, seed=4)
    return [
        ("base", base),
        ("int32 start", KeyIntervals(start.to(torch.int32), end)),
        ("int64 end", KeyIntervals(start, end.long())),
        ("batch broadcast", KeyIntervals(row.start.expand_as(start), row.end.expand_as(end))),
        ("one head", KeyIntervals(start[:, :1].contiguous(), end[:, :1].contiguous())),
        ("non-contiguous", KeyIntervals(start.transpose(0, 1).contiguous().transpose(0, 1),
                                        end)),
    ]


def test_each_form_of_intervals_gets_its_own_plan(device, monkeypatch):
    """A plan is never taken by intervals of another layout, dtype or shape, nor by a call
    differing in causality: each gets its own plan, with the bits of planning afresh."""
    dims = Dims(2, 21, 37, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    cases = [(name, intervals, True) for name, intervals in _form_changes(dims, device)]
    cases.append(("not causal", cases[0][1], False))

    def call(intervals, causal):
        with torch.no_grad():
            return dmattn_func(q, k, v, intervals, None, causal, return_lse=True)

    monkeypatch.setattr(call_plan, "MAX_INTERVAL_PLANS", 0)
    afresh = [call(used_once(s), causal) for _, s, causal in cases]
    monkeypatch.setattr(call_plan, "MAX_INTERVAL_PLANS", len(cases))
    for (name, s, causal), want in zip(cases, afresh):
        assert_equal_bits(call(used_once(s), causal), want)
    assert len(call_plan._interval_plans) == len(cases)
    for (name, s, causal), want in zip(cases, afresh):  # and again, from the kept plans
        assert_equal_bits(call(used_once(s), causal), want)
    assert len(call_plan._interval_plans) == len(cases)


def test_a_bound_on_the_keys_a_row_keeps_gets_its_own_plan(device, monkeypatch):
    """``KeyIntervals._row_kept`` steers the forward's route (``hopper_forward.long_kept_walks``):
    intervals of one layout with another bound, or none, never take the plan made for it."""
    dims = Dims(2, 21, 37, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    base = random_intervals(dims, "Hk", "B", device, seed=3)
    monkeypatch.setattr(call_plan, "MAX_INTERVAL_PLANS", 4)
    for bound in (None, 8, 9, None, 8, 9):
        with torch.no_grad():
            dmattn_func(q, k, v, KeyIntervals(base.start, base.end, _row_kept=bound), None,
                        True)
    assert len(call_plan._interval_plans) == 3


def test_values_beyond_int32_keep_their_meaning(device):
    """int64 intervals with values past int32 (a start far before row 0, an end far past the
    last row) mean what their values clamped to the rows mean, in the call that plans their
    form and in the calls that take the kept plan (which read start and end in one launch).
    Cut to their low 32 bits instead, these values would hide rows: -2**32 + 5 reads as 5."""
    dims = Dims(1, 21, 37, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    drawn = random_intervals(dims, "1", "1", device, seed=6)
    start, end, lq = drawn.start.long(), drawn.end.long(), dims.seqlen_q
    far = KeyIntervals(torch.where(start <= 0, start - 2**32 + 5, start),
                       torch.where(end >= lq, end - lq + 2**32 + 3, end))
    assert (far.start < -2**31).any() and (far.end > 2**31).any()

    def call(intervals):
        with torch.no_grad():
            return dmattn_func(q, k, v, used_once(intervals), None, True, return_lse=True)

    want = call(KeyIntervals(start.clamp(0, lq).int(), end.clamp(0, lq).int()))
    for _ in range(2):  # planned afresh, then from the kept plan
        assert_equal_bits(call(far), want)


def test_kept_interval_plans_are_bounded_least_recently_used_first(device, monkeypatch):
    monkeypatch.setattr(call_plan, "MAX_INTERVAL_PLANS", 2)
    dims = Dims(1, 8, 16, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    forms = [q[:, :lq] for lq in (8, 7, 6)]

    def call(query):
        intervals = random_intervals(dims, "1", "1", device)
        with torch.no_grad():
            dmattn_func(query, k, v, intervals, None, False)
        return next(reversed(call_plan._interval_plans.values()))

    first, second = call(forms[0]), call(forms[1])
    assert call(forms[0]) is first  # used again: now the most recent
    call(forms[2])  # a third form drops the least recently used: the second
    assert list(call_plan._interval_plans.values())[0] is first
    assert len(call_plan._interval_plans) == 2
    assert second not in call_plan._interval_plans.values()


def test_a_kept_interval_plan_reads_no_value_back(device):
    """A call taking a kept plan waits for nothing on the device (a CUDA graph can capture it):
    its per-call work is torch ops and launches only."""
    dims = Dims(1, 17, 33, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    bias = random_bias(dims.operand_shape("1", "Hk", "1", "Lk"), torch.float16, device)
    grad_out = torch.randn(q.shape, device=device).to(q.dtype)
    grads_of(dmattn_func, q, k, v, random_intervals(dims, "Hk", "1", device), bias, True,
             None, grad_out)
    assert len(call_plan._interval_plans) == 1
    with SyncWatch() as watch:
        grads_of(dmattn_func, q, k, v, random_intervals(dims, "Hk", "1", device, seed=1), bias,
                 True, None, grad_out)
    assert not watch.syncs, f"ops that wait for the device: {watch.syncs}"
    assert len(call_plan._interval_plans) == 1


def test_a_reused_object_still_prepares_and_a_prepared_mask_keeps_its_lists(device):
    """The second call with one intervals object prepares it (kept on the object) as before;
    prepared masks' plans keep their own lists."""
    dims = Dims(1, 17, 33, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    intervals = random_intervals(dims, "Hk", "1", device)
    with torch.no_grad():
        first = dmattn_func(q, k, v, intervals, None, True)
        second = dmattn_func(q, k, v, intervals, None, True)
        (prepared,) = intervals._preparations.values()
        assert prepared is not None
        ((plan, _),) = prepared.plans.values()
        assert not plan.lists_per_call and plan.list_table is not None
        explicit = dmattn_func(q, k, v, prepare_mask(intervals, q, k, True), None, True)
    assert torch.equal(first, second) and torch.equal(first, explicit)


def test_a_graph_captured_with_new_intervals_follows_their_values(device):
    """Captured forward and backward with a new intervals object of a kept form: replays read
    whatever the captured start and end tensors hold (their pairs, map and lists are made
    inside the graph). Off the GPU, where there are no graphs, the kept plan is called again on
    the tensors written in place, which must follow their values the same way."""
    dims = Dims(1, 64, 96, heads_q=4, heads_kv=2, head_dim=64)
    dtype = torch.bfloat16
    q, k, v = random_qkv(dims, dtype, device)
    bias = random_bias(dims.operand_shape("1", "Hk", "1", "Lk"), dtype, device)
    grad_out = torch.randn(q.shape, device=device).to(dtype)
    sets = interval_sets(dims, "Hk", "1", device)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, bias)]
    static = KeyIntervals(sets[0].start.clone(), sets[0].end.clone())

    def step(intervals):
        out = dmattn_func(*leaves[:3], intervals, leaves[3], True)
        return (out, *torch.autograd.grad(out, leaves, grad_out))

    step(used_once(static))  # plan and compile outside the capture
    if device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(used_once(static))
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step(used_once(static))

        def replay():
            graph.replay()
            return captured
    else:
        def replay():
            return step(used_once(static))
    for s in sets[1:]:
        static.start.copy_(s.start)
        static.end.copy_(s.end)
        assert_equal_bits(replay(), step(used_once(s)))
