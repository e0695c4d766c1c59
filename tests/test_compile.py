"""torch.compile of dmattn_func: the custom ops of ``kernels.ops`` inside a captured graph.

A compiled module must capture whole (fullgraph, one graph, no breaks), give bit for bit the
eager module's outputs and gradients (both reach the same host layer), meet the accuracy rule,
and under ``dynamic=True`` keep one graph while the sequence lengths change. The CPU runs use
``backend="aot_eager"`` (Dynamo capture and AOTAutograd, no code generation; the kernels run
under Triton's interpreter), and one case runs Inductor, to which the ops are opaque.
"""

from __future__ import annotations

import re
from collections import OrderedDict

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only

from kernels import KeyIntervals, attention_reference, dmattn_func, ops, prepare_mask
from kernels import call_plan, topk_intervals
from kernels.planning import backward_schedule

from attn_helpers import (Dims, SyncWatch, assert_close_to_reference, grads_of, random_bias,
                          random_mask, random_qkv)

DIMS = Dims(batch=2, seqlen_q=17, seqlen_k=33, heads_q=4, heads_kv=2, head_dim=16)  # GQA
# Bias shapes as axis tokens (batch 1/B, heads 1/Hk/Hq, query 1/Lq, key 1/Lk): every size of
# every axis at least once (the eager tests cover all combinations; what a traced call adds is
# the fake bias gradient in the bias's own shape).
BIAS_SHAPES = ("BxHkx1xLk", "1x1xLqxLk", "BxHqxLqxLk", "1xHkxLqx1", "Bx1x1xLk", "1x1x1x1")
# (is_causal, return_lse, deterministic) of the calls, each setting flipped at least once.
OPTIONS = (
    pytest.param(dict(is_causal=True, return_lse=True, deterministic=True), id="causal-lse-det"),
    pytest.param(dict(is_causal=False, return_lse=False, deterministic=False), id="plain"),
    pytest.param(dict(is_causal=True, return_lse=False, deterministic=False, softmax_scale=0.5),
                 id="causal-scale"),
)
# (seqlen_q, seqlen_k) of successive calls to one dynamic-shape compiled module.
LENGTHS = ((17, 33), (25, 41), (9, 50))
BACKENDS = ("aot_eager", pytest.param("inductor", marks=pytest.mark.slow))
NAMES = ("out", "lse", "dq", "dk", "dv", "dbias")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no cached graph of another test, no recompile limit
    reached across tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def whole(bias, q, k):
    return bias


def expanded(bias, q, k):
    """A stride-0 expand() of the parameter to the call's full size (eager hands the kernel
    the parameter itself; the traced call must too)."""
    heads = q.shape[2] if bias.shape[1] == 1 else bias.shape[1]
    return bias.expand(q.shape[0], heads, q.shape[1], k.shape[1])


def key_prefix(bias, q, k):
    """The first seqlen_k keys of a per-key parameter longer than any call's keys."""
    return bias[..., :k.shape[1]]


class Attention(torch.nn.Module):
    """dmattn_func with a trainable bias parameter, passed as ``bias_view(bias, q, k)``."""

    def __init__(self, bias: torch.Tensor, bias_view=whole, **options):
        super().__init__()
        self.bias = torch.nn.Parameter(bias.clone())
        self.bias_view = bias_view
        self.options = options

    def forward(self, q, k, v, mask):
        result = dmattn_func(q, k, v, attn_mask=mask, attn_bias=self.bias_view(self.bias, q, k),
                             **self.options)
        return result if isinstance(result, tuple) else (result,)


def compile_counted(module, backend: str = "aot_eager", dynamic: bool = False):
    """``module`` compiled whole (fullgraph), and the counter of the graphs it compiled."""
    counter = CompileCounterWithBackend(backend)
    return torch.compile(module, backend=counter, fullgraph=True, dynamic=dynamic), counter


def run(module, q, k, v, mask, grad_out) -> dict:
    """Outputs and gradients (query, key, value, bias parameter) of one call and backward."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    bias = module.bias  # a compiled module's attributes are its original's
    bias.grad = None
    outputs = module(q, k, v, mask)
    outputs[0].backward(grad_out)
    return dict(zip(NAMES, (outputs[0], outputs[1] if len(outputs) > 1 else None,
                            q.grad, k.grad, v.grad, bias.grad)))


def assert_bitwise_equal(compiled: dict, eager: dict) -> None:
    for name in NAMES:
        a, b = compiled[name], eager[name]
        assert (a is None) == (b is None), f"{name}: only one run returned it"
        if a is not None:
            assert a.shape == b.shape and a.stride() == b.stride(), f"{name} layout differs"
            assert torch.equal(a, b), f"{name} differs between compiled and eager runs"


def assert_within_rule(results: dict, q, k, v, mask, bias, grad_out, is_causal=False,
                       softmax_scale=None, **_) -> None:
    """The accuracy rule against the float64 reference, for every output and gradient."""
    upcast = [t.detach().float() for t in (q, k, v, bias)]
    truth = attention_reference(*upcast[:3], mask, upcast[3], is_causal, softmax_scale,
                                return_lse=True)
    low = attention_reference(q, k, v, mask, bias, is_causal, softmax_scale, return_lse=True,
                              upcast=False)
    ref_grads = grads_of(attention_reference, *upcast[:3], mask, upcast[3], is_causal,
                         softmax_scale, grad_out.double())
    low_grads = grads_of(attention_reference, q, k, v, mask, bias, is_causal, softmax_scale,
                         grad_out, upcast=False)
    references = dict(zip(NAMES[:2], truth)) | dict(ref_grads.named())
    baselines = dict(zip(NAMES[:2], low)) | dict(low_grads.named())
    for name, reference in references.items():
        if results[name] is not None:
            assert_close_to_reference(name, results[name], reference, baselines[name], q.dtype)


def problem(dims: Dims, bias_shape: str, device, dtype=torch.float16):
    q, k, v = random_qkv(dims, dtype, device)
    mask = random_mask(dims.operand_shape("B", "1", "Lq", "Lk"), device)
    bias = random_bias(dims.operand_shape(*bias_shape.split("x")), dtype, device)
    grad_out = torch.randn(q.shape, device=device).to(dtype)
    return q, k, v, mask, bias, grad_out


def op_calls(gm: torch.fx.GraphModule, op) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (op, op.default)]


@pytest.mark.parametrize("bias_shape", BIAS_SHAPES)
def test_compiled_module_matches_eager_bit_for_bit(bias_shape, device):
    q, k, v, mask, bias, grad_out = problem(DIMS, bias_shape, device)
    options = dict(is_causal=True, return_lse=True, deterministic=True)
    module = Attention(bias, **options)
    compiled, counter = compile_counted(module)
    got = run(compiled, q, k, v, mask, grad_out)
    assert counter.frame_count == 1
    assert len(op_calls(counter.graphs[0], torch.ops.dmattn.fwd)) == 1
    assert_bitwise_equal(got, run(module, q, k, v, mask, grad_out))
    assert_within_rule(got, q, k, v, mask, bias, grad_out, **options)


@pytest.mark.parametrize("options", OPTIONS)
def test_compiled_options_match_eager(options, device):
    q, k, v, mask, bias, grad_out = problem(DIMS, "BxHkx1xLk", device)
    module = Attention(bias, **options)
    compiled, counter = compile_counted(module)
    got = run(compiled, q, k, v, mask, grad_out)
    assert counter.frame_count == 1
    assert_bitwise_equal(got, run(module, q, k, v, mask, grad_out))


def test_explain_finds_one_graph_and_no_break(device):
    q, k, v, mask, bias, _ = problem(DIMS, "1x1xLqxLk", device)
    q.requires_grad_()
    module = Attention(bias, expanded, is_causal=True, return_lse=True)
    explained = torch._dynamo.explain(module)(q, k, v, mask)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("bias_shape, backend", (
    ("BxHkx1xLk", "aot_eager"), ("1x1xLqxLk", "aot_eager"),
    pytest.param("BxHkx1xLk", "inductor", marks=pytest.mark.slow)))
def test_expanded_bias_reaches_the_op_compact(bias_shape, backend, device):
    """An expand()ed bias parameter: the op gets the parameter as the view's base, so the
    gradient is made in the parameter's shape (no full-size gradient summed down by autograd),
    as in eager calls."""
    q, k, v, mask, bias, grad_out = problem(DIMS, bias_shape, device)
    module = Attention(bias, expanded, is_causal=True, deterministic=True)
    compiled, counter = compile_counted(module, backend)
    got = run(compiled, q, k, v, mask, grad_out)
    (call,) = op_calls(counter.graphs[0], torch.ops.dmattn.fwd)
    base = call.args[len(call.args) - len(ops.OPERANDS) + ops.OPERANDS.index("bias_base")]
    assert tuple(base.meta["example_value"].shape) == tuple(bias.shape)
    assert_bitwise_equal(got, run(module, q, k, v, mask, grad_out))


def test_expanded_bias_made_outside_the_compiled_function(device):
    """A view that is an input of the compiled function, whose base the compiler cannot
    follow: the ops take the view, and the gradient still reaches its base, within the rule
    (autograd sums it down, in another order than the kernel's own reduction). The outputs
    are eager's bit for bit; the gradients only within the rule, since a full-size bias may
    take another backward schedule than its base (on an H100: no dkdv head shares, so dk is
    summed in another order)."""
    q, k, v, mask, bias, grad_out = problem(DIMS, "BxHkx1xLk", device)

    def attend(q, k, v, mask, bias):
        return dmattn_func(q, k, v, mask, bias, is_causal=True, return_lse=True)

    results = []
    for func in (torch.compile(attend, backend="aot_eager", fullgraph=True), attend):
        leaves = [t.detach().requires_grad_() for t in (q, k, v, bias)]
        out, lse = func(*leaves[:3], mask, expanded(leaves[3], q, k))
        results.append(dict(zip(NAMES, (out, lse, *torch.autograd.grad(out, leaves, grad_out)))))
    got, eager = results
    for name in ("out", "lse"):
        assert torch.equal(got[name], eager[name]), name
    assert_within_rule(got, q, k, v, mask, bias, grad_out, is_causal=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dynamic_lengths_compile_once(backend, device):
    """Three calls with new query and key lengths: one graph, each call equal to eager."""
    dims = DIMS
    # Longer than every call's keys: a slice that spans the whole parameter is contiguous and
    # the others are not, a distinction torch guards on by itself.
    longest = max(lk for _, lk in LENGTHS) + 7
    bias = random_bias((dims.batch, dims.heads_kv, 1, longest), torch.float16, device)
    module = Attention(bias, key_prefix, is_causal=True, return_lse=True, deterministic=True)
    compiled, counter = compile_counted(module, backend, dynamic=True)
    for seqlen_q, seqlen_k in LENGTHS:
        dims = Dims(DIMS.batch, seqlen_q, seqlen_k, DIMS.heads_q, DIMS.heads_kv, DIMS.head_dim)
        q, k, v, mask, _, grad_out = problem(dims, "1x1x1x1", device)
        got = run(compiled, q, k, v, mask, grad_out)
        assert_bitwise_equal(got, run(module, q, k, v, mask, grad_out))
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for {len(LENGTHS)} lengths"


def test_prepared_mask_travels_as_its_tensor(device):
    """A PreparedMask under compile: equal to eager with it and with its plain mask, and a
    second prepared mask of the same shapes reuses the graph."""
    q, k, v, mask, bias, grad_out = problem(DIMS, "BxHkx1xLk", device)
    module = Attention(bias, is_causal=True, return_lse=True, deterministic=True)
    compiled, counter = compile_counted(module)
    for mask in (mask, random_mask(mask.shape, device, keep=0.4)):
        prepared = prepare_mask(mask, q, k, is_causal=True)
        got = run(compiled, q, k, v, prepared, grad_out)
        assert_bitwise_equal(got, run(module, q, k, v, prepared, grad_out))
        assert_bitwise_equal(got, run(module, q, k, v, mask, grad_out))
    assert counter.frame_count == 1


def test_without_mask_or_bias(device):
    q, k, v = random_qkv(DIMS, torch.float16, device)
    grad_out = torch.randn(q.shape, device=device).to(q.dtype)

    def attend(q, k, v):
        return dmattn_func(q, k, v, is_causal=True)

    results = []
    for func in (torch.compile(attend, backend="aot_eager", fullgraph=True), attend):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = func(*leaves)
        results.append((out, *torch.autograd.grad(out, leaves, grad_out)))
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_compiled_inference_matches_eager(device):
    """No gradient recorded: the ops' forward alone, against eager's no-grad path."""
    q, k, v, mask, bias, _ = problem(DIMS, "1x1xLqxLk", device)

    def attend(q, k, v, mask, bias):
        return dmattn_func(q, k, v, mask, bias, is_causal=True, return_lse=True)

    compiled, counter = compile_counted(attend)
    with torch.no_grad():
        got, want = compiled(q, k, v, mask, bias), attend(q, k, v, mask, bias)
    assert counter.frame_count == 1
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("strict", (False, True), ids=("non_strict", "strict"))
def test_export_captures_the_op(strict, device):
    q, k, v, mask, bias, _ = problem(DIMS, "BxHkx1xLk", device)
    module = Attention(bias, is_causal=True, return_lse=True)
    exported = torch.export.export(module, (q, k, v, mask), strict=strict)
    assert len(op_calls(exported.graph_module, torch.ops.dmattn.fwd)) == 1
    with torch.no_grad():
        for got, want in zip(exported.module()(q, k, v, mask), module(q, k, v, mask)):
            assert torch.equal(got, want)


def test_eager_calls_do_not_use_the_ops(monkeypatch, device):
    """Eager calls keep their own autograd.Function: with every way into the ops broken, they
    still run forward and backward; a compiled call does reach them."""
    def broken(*args, **kwargs):
        raise AssertionError("the custom ops were called")

    for name in ("dmattn_traced", "_forward_impl", "_backward_impl"):
        monkeypatch.setattr(ops, name, broken)
    q, k, v, mask, bias, grad_out = problem(DIMS, "BxHkx1xLk", device)
    module = Attention(bias, is_causal=True)
    run(module, q, k, v, mask, grad_out)
    with pytest.raises(Exception, match="the custom ops were called"):
        compile_counted(module)[0](q, k, v, mask)


@pytest.mark.parametrize("dynamic", (False, True), ids=("static", "dynamic"))
def test_bad_bias_shape_fails_while_tracing_with_the_eager_message(dynamic, device):
    q, k, v, mask, _, _ = problem(DIMS, "BxHkx1xLk", device)
    bad = random_bias((DIMS.batch, DIMS.heads_kv, 2, DIMS.seqlen_k), torch.float16, device)
    module = Attention(bad)
    with pytest.raises(ValueError) as eager:
        module(q, k, v, mask)
    compiled, _ = compile_counted(module, dynamic=dynamic)
    with pytest.raises(Exception, match=re.escape(str(eager.value))):
        compiled(q, k, v, mask)


def assert_fake_matches_real(op, args) -> None:
    """Each output of ``op`` on fake copies of ``args`` has the real output's shape, strides
    and dtype."""
    real = op(*args)
    with FakeTensorMode() as mode:
        fake = op(*tree_map_only(torch.Tensor, mode.from_tensor, args))
    for i, (f, r) in enumerate(zip(fake, real)):
        assert (f.shape, f.dtype) == (r.shape, r.dtype), f"output {i}"
        # The stride of an axis of size 1 never moves an address (torch's own checks skip it).
        assert all(a == b for a, b, n in zip(f.stride(), r.stride(), r.shape) if n > 1), (
            f"output {i}: fake strides {f.stride()}, real {r.stride()}")


def test_non_bool_flag_fails_while_tracing_with_the_eager_message(device):
    q, k, v = random_qkv(DIMS, torch.float16, device)

    def attend(q, k, v):
        return dmattn_func(q, k, v, is_causal="yes")

    with pytest.raises(TypeError) as eager:
        attend(q, k, v)
    with pytest.raises(Exception, match=re.escape(str(eager.value))):
        torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v)


def test_kernel_options_are_refused_while_tracing(device):
    """Forcing a schedule is for eager tests and tuning; a traced call says so by name."""
    q, k, v = random_qkv(DIMS, torch.float16, device)

    def attend(q, k, v):
        return dmattn_func(q, k, v, kernel_options={"backward": "fused"})

    with pytest.raises(Exception, match="kernel_options: not taken under torch.compile"):
        torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v)


def test_fake_implementations_agree_with_the_kernels(device):
    """torch.library's own checks (schema, fake outputs against real ones, the autograd
    registration, AOT tracing with dynamic shapes) and the fake outputs' strides, with the bias
    alone and with an expand() of it beside it as its base."""
    dims = Dims(batch=2, seqlen_q=9, seqlen_k=17, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device, layout="bhld")
    # A key whose head dim is not innermost in memory: the kernels read a contiguous copy.
    k = k.permute(0, 1, 3, 2).contiguous().permute(0, 1, 3, 2)
    mask = random_mask(dims.operand_shape("1", "Hk", "Lq", "Lk"), device)
    bias = random_bias(dims.operand_shape("B", "1", "1", "Lk"), torch.float32, device)
    q, k, v, bias = (t.requires_grad_() for t in (q, k, v, bias))
    for biases in ((bias, None), (expanded(bias, q, k), bias)):
        torch.library.opcheck(torch.ops.dmattn.fwd.default,
                              (q, k, v, True, None, False, True, True, None, None, False,
                               *operands(mask, *biases)))
    # The backward op has no backward of its own (no double backward): plain tensors.
    q, k, v, bias = (t.detach() for t in (q, k, v, bias))
    out, lse = torch.ops.dmattn.fwd(q, k, v, True, None, False, True, True, None, None, False,
                                    *operands(mask, bias, None))
    assert_fake_matches_real(torch.ops.dmattn.fwd.default,
                             (q, k, v, True, None, False, True, True, None, None, False,
                              *operands(mask, bias, None)))
    for biases in ((bias, None), (expanded(bias, q, k), bias)):
        for bias_needs_grad in (True, False):
            args = (torch.randn_like(out), q, k, v, out, lse, True, None, False,
                    bias_needs_grad, None, False, *operands(mask, *biases))
            torch.library.opcheck(torch.ops.dmattn.bwd.default, args)
            assert_fake_matches_real(torch.ops.dmattn.bwd.default, args)


def operands(mask, bias, bias_base) -> tuple:
    """The ops' optional tensor arguments, in schema order, for a bool mask and a bias."""
    slots = dict.fromkeys(ops.OPERANDS)
    slots.update(attn_mask=mask, attn_bias=bias, bias_base=bias_base)
    return tuple(slots.values())


def test_ops_never_wait_for_the_device(device):
    """Neither op reads device memory back to the host, with a mask read within the call (the
    most host-side work), so a CUDA graph can capture both. On a GPU, capture and replay them."""
    q, k, v, mask, bias, grad_out = problem(DIMS, "BxHkx1xLk", device)
    flags, optional = (True, None, True), operands(mask, bias, None)
    with SyncWatch() as watch:
        out, lse = torch.ops.dmattn.fwd(q, k, v, *flags, True, True, None, None, False, *optional)
        grads = torch.ops.dmattn.bwd(grad_out, q, k, v, out, lse, *flags, True, None, False,
                                     *optional)
    assert not watch.syncs, f"ops that wait for the device: {watch.syncs}"
    if device.type != "cuda":
        return
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.dmattn.fwd(q, k, v, *flags, True, True, None, None, False, *optional)
        captured += torch.ops.dmattn.bwd(grad_out, q, k, v, *captured, *flags, True, None,
                                             False, *optional)
    graph.replay()
    for got, want in zip(captured, (out, lse, *grads)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("made_inside", (False, True), ids=("given", "made-in-graph"))
def test_key_interval_masks_compile_whole(made_inside, device):
    """A KeyIntervals mask travels as its two tensors: one graph, eager's bits, whether the
    intervals come in or are made inside the compiled function."""
    q, k, v, _, bias, grad_out = problem(DIMS, "BxHkx1xLk", device)
    lq, lk = DIMS.seqlen_q, DIMS.seqlen_k
    start = torch.randint(0, lq, (1, DIMS.heads_kv, lk), device=device)
    end = start + torch.randint(0, lq, (1, DIMS.heads_kv, lk), device=device)

    class IntervalAttention(Attention):
        def forward(self, q, k, v, mask):
            if made_inside:
                mask = KeyIntervals(*mask)
            return super().forward(q, k, v, mask)

    module = IntervalAttention(bias, is_causal=True, return_lse=True, deterministic=True)
    mask = (start, end) if made_inside else KeyIntervals(start, end)
    compiled, counter = compile_counted(module)
    got = run(compiled, q, k, v, mask, grad_out)
    assert counter.frame_count == 1
    assert_bitwise_equal(got, run(module, q, k, v, mask, grad_out))


def test_given_ordered_intervals_are_reordered_inside_the_graph(device):
    """Ordered KeyIntervals handed to a compiled function: the graph gathers start and end
    itself (``key_order.reordered_intervals`` keeps nothing while tracing), so a run after a
    write into them follows the new values, with eager's bits."""
    q, k, v, _, bias, grad_out = problem(DIMS, "BxHkx1xLk", device)
    selection = torch.randn(1, DIMS.heads_q, 1, DIMS.seqlen_k,
                            generator=torch.Generator().manual_seed(4)).to(device)
    ordered = topk_intervals(selection, 5, seqlen_q=DIMS.seqlen_q, order_keys=True)
    module = Attention(bias, is_causal=True, return_lse=True, deterministic=True)
    compiled, counter = compile_counted(module)
    first = run(compiled, q, k, v, ordered, grad_out)
    ordered.end[..., : DIMS.seqlen_k // 2] = 0  # the first half of the keys hidden
    second = run(compiled, q, k, v, ordered, grad_out)
    assert counter.frame_count == 1 and not ordered._reordered
    assert not torch.equal(first["out"], second["out"])
    assert_bitwise_equal(second, run(module, q, k, v, ordered, grad_out))


def test_ordered_intervals_take_a_bias_expanded_inside_the_graph(device):
    """Ordered KeyIntervals with a bias parameter expand()ed inside the compiled function (the
    trace sees the view's base, the graph it makes does not): one graph, eager's bits."""
    q, k, v, _, bias, grad_out = problem(DIMS, "BxHkx1xLk", device)
    selection = torch.randn(1, DIMS.heads_kv, 1, DIMS.seqlen_k,
                            generator=torch.Generator().manual_seed(6)).to(device)
    ordered = topk_intervals(selection, 5, seqlen_q=DIMS.seqlen_q, order_keys=True)
    module = Attention(bias, bias_view=expanded, is_causal=True, return_lse=True,
                       deterministic=True)
    compiled, counter = compile_counted(module)
    got = run(compiled, q, k, v, ordered, grad_out)
    assert counter.frame_count == 1
    assert_bitwise_equal(got, run(module, q, k, v, ordered, grad_out))


def test_the_backward_op_plans_with_the_intervals_row_bound(device, monkeypatch):
    """The bwd op rebuilds the intervals with their row bound (``_row_kept``) as the fwd op
    does, so both plan the eager call's schedule: the backward's reads it
    (``backward_schedule.split_heads``: key-ordered top-W walks split a GQA group's heads)."""
    bounds = []
    split_heads = backward_schedule.split_heads

    def recording(problem, options, documents):
        bounds.append(problem.row_kept)
        return split_heads(problem, options, documents)

    monkeypatch.setattr(backward_schedule, "split_heads", recording)
    monkeypatch.setattr(call_plan, "_interval_plans", OrderedDict())  # no plan of another test
    q, k, v, _, bias, grad_out = problem(DIMS, "BxHkx1xLk", device)
    selection = torch.randn(1, DIMS.heads_kv, 1, DIMS.seqlen_k,
                            generator=torch.Generator().manual_seed(5)).to(device)
    ordered = topk_intervals(selection, 5, seqlen_q=DIMS.seqlen_q, order_keys=True)
    compiled, _ = compile_counted(Attention(bias, is_causal=True))
    run(compiled, q, k, v, ordered, grad_out)
    assert bounds and set(bounds) == {5}


@pytest.mark.parametrize("mask_kind", ("none", "bool", "intervals", "top_window"))
def test_reduce_overhead_replays_give_eager_bits(mask_kind, device):
    """``torch.compile(mode="reduce-overhead")``: Inductor records the step into CUDA graphs
    and replays them (no host time per kernel). Over steps with new inputs and new mask values
    each step's outputs and gradients are eager's bits, and no graph was skipped. top_window
    is Doge's pattern: ``topk_intervals`` of the trainable bias inside the step. Inductor's
    first (warm-up) runs route every allocation to the graphs' memory pool and then require
    each live tensor there to be an output, so nothing a call keeps may be made in them. CUDA
    only."""
    if device.type != "cuda":
        return
    from torch._dynamo.utils import counters

    counters.clear()
    _, _, _, _, bias, _ = problem(DIMS, "BxHkx1xLk", device)

    class StepAttention(Attention):
        def forward(self, q, k, v, mask):
            if mask_kind == "intervals":
                mask = KeyIntervals(*mask)
            elif mask_kind == "top_window":
                mask = topk_intervals(self.bias, 5, seqlen_q=q.shape[1], is_causal=True)
            return super().forward(q, k, v, mask)

    module = StepAttention(bias, is_causal=True, return_lse=True)
    compiled = torch.compile(module, mode="reduce-overhead", fullgraph=True)
    lq, lk = DIMS.seqlen_q, DIMS.seqlen_k
    for step in range(4):  # the first steps warm up and record, the later ones replay
        torch.compiler.cudagraph_mark_step_begin()
        q, k, v, mask, _, grad_out = problem(DIMS, "BxHkx1xLk", device)
        if mask_kind == "intervals":
            start = torch.randint(0, lq, (1, DIMS.heads_kv, lk), device=device)
            mask = (start, start + torch.randint(0, lq, (1, DIMS.heads_kv, lk), device=device))
        elif mask_kind != "bool":
            mask = None
        got = run(compiled, q, k, v, mask, grad_out)
        got = {name: None if t is None else t.clone() for name, t in got.items()}
        assert_bitwise_equal(got, run(module, q, k, v, mask, grad_out))
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


@pytest.mark.parametrize("order_keys", (False, True), ids=("key-order-off", "key-order-on"))
@pytest.mark.parametrize("backend", BACKENDS)
def test_top_window_made_from_the_bias_compiles_whole(backend, order_keys, device):
    """Doge's pattern: the top-W intervals made from the trainable per-key bias inside the
    compiled function. The selection is one opaque op in the graph (no gradient through it),
    and the outputs and gradients are eager's bits. Inductor runs too: it once failed to
    lower the selection's slice writes when it traced into them. With a key order
    (``kernels.masks.key_order``) the sort and the gathers of K, V and the bias are traced torch
    ops around the same custom ops."""
    q, k, v, _, bias, grad_out = problem(DIMS, "BxHkx1xLk", device)

    class TopWindowAttention(Attention):
        def forward(self, q, k, v, mask):
            chosen = topk_intervals(self.bias, 5, seqlen_q=q.shape[1], is_causal=True,
                                    order_keys=order_keys)
            return super().forward(q, k, v, chosen)

    module = TopWindowAttention(bias, is_causal=True, return_lse=True)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    counter = CompileCounterWithBackend(backend if backend == "inductor" else capture)
    compiled = torch.compile(module, backend=counter, fullgraph=True)
    got = run(compiled, q, k, v, None, grad_out)
    assert counter.frame_count == 1
    assert_bitwise_equal(got, run(module, q, k, v, None, grad_out))
    if graphs:
        assert len(op_calls(graphs[0], torch.ops.dmattn.topk_intervals)) == 1


def test_top_window_ops_fakes_agree_with_their_kernels(device):
    """opcheck of both selection ops: schema, fake shapes and dtypes against real runs."""
    bias = torch.randn(2, 3, 1, 40, device=device)
    torch.library.opcheck(torch.ops.dmattn.topk_intervals.default, (bias, 7, 29, True))
    torch.library.opcheck(torch.ops.dmattn.topk_intervals.default, (bias, 7, 40, False))
    cu = torch.tensor([0, 9, 9, 30], dtype=torch.int32, device=device)
    packed = torch.randn(3, 30, device=device)
    torch.library.opcheck(torch.ops.dmattn.topk_intervals_packed.default,
                          (packed, 4, True, None, cu))
