"""How an eager call reads ordered intervals' keys (``kernels.masks.key_order``'s reads,
``kernels.masks.key_copies``): K and V copied in order by rows equal the gathers a traced call
makes; with gradients the reads and their way back are one autograd node, without gradients
they run with no node; a bias of one row per (batch, head of the copies) rides in the row
copies; the reads are kept per call form. Outputs and gradients against the fp64 reference."""

from __future__ import annotations

import contextlib

import pytest
import torch

from attn_helpers import Dims, assert_close_to_reference, random_qkv
from kernels import attention_reference, dmattn_func, interface, topk_intervals
from kernels.masks import key_order
from key_order_helpers import axes_bias, selection


# (batch, selection batch, selection heads, Hq, Hk, K's head dim, V's, K and V transposed views)
COPIES = [
    pytest.param(2, 2, "Hq", 4, 2, 16, 16, False, id="order-per-query-head"),
    pytest.param(2, 1, "Hk", 6, 3, 40, 40, True, id="one-batch-order-transposed-d40"),
    pytest.param(3, 3, "1", 8, 1, 8, 24, False, id="mqa-one-order-v-wider"),
    pytest.param(1, 1, "Hq", 6, 1, 80, 80, True, id="mqa-order-per-query-head-d80"),
]


@pytest.mark.parametrize("batch,order_batch,heads,heads_q,heads_kv,k_dim,v_dim,transposed",
                         COPIES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_keys_copied_in_order_equal_the_gathers(batch, order_batch, heads, heads_q, heads_kv,
                                                k_dim, v_dim, transposed, dtype, device,
                                                monkeypatch):
    """K and V read in key order by row copies (eager calls) equal the ``torch.gather``s a
    traced call makes, bit for bit. Their gradients sum over the heads that widened a K/V
    head in fp32, in head order, rounded once: bit for bit the gathers' gradients in fp64
    rounded once where at most two fp32 heads or any bf16 heads add (a GPU's rounding; the
    interpreter truncates), else within fp32 rounding."""
    from kernels.masks.key_order import reorder_keys
    monkeypatch.setattr(key_order, "INTERPRETED_COPIES", True)  # on CPU tensors too
    seqlen_k = 97
    generator = torch.Generator().manual_seed(3)
    count = {"1": 1, "Hk": heads_kv, "Hq": heads_q}[heads]
    selection = torch.randn(order_batch, count, 1, seqlen_k, generator=generator).to(device)
    ordered = topk_intervals(selection, 9, seqlen_q=seqlen_k, order_keys=True)

    def operand(dim):
        shape = (batch, heads_kv, seqlen_k, dim) if transposed else (batch, seqlen_k, heads_kv,
                                                                     dim)
        t = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
        t = t.transpose(1, 2) if transposed else t
        return t.requires_grad_()

    q = torch.randn(batch, seqlen_k, heads_q, k_dim).to(device=device, dtype=dtype)
    k, v = operand(k_dim), operand(v_dim)
    results = []
    for traced in (False, True):  # the gathers in fp64, rounded once to the dtype
        if traced:
            monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
            k, v = (t.detach().double().requires_grad_() for t in (k, v))
        key, value, _, _ = reorder_keys(q, k, v, ordered, None, True)
        grad_k = torch.randn(key.shape, generator=torch.Generator().manual_seed(5))
        grad_v = torch.randn(value.shape, generator=torch.Generator().manual_seed(6))
        grads = (grad_k.to(key.dtype).to(key), grad_v.to(key.dtype).to(key))
        if traced:
            grads = tuple(g.to(dtype).double() for g in grads)
        dk, dv = torch.autograd.grad((key, value), (k, v), grads)
        results.append(tuple(t.to(dtype) for t in (key, value, dk, dv)))
    # eager kept the inverse order for the gradient; the traced calls kept nothing
    assert [form[0] for form in ordered._gather_indices] == ["inverse"]
    widened_by = results[0][0].shape[2] // heads_kv
    for name, copied, gathered in zip(("key", "value", "dk", "dv"), *results):
        assert copied.shape == gathered.shape, name
        assert torch.isfinite(copied).all(), name
        if name in ("key", "value") or widened_by == 1:
            assert torch.equal(copied, gathered), name
        elif dtype == torch.float32:  # a sum of two is exact in any order
            tolerance = 0 if widened_by == 2 else 1e-6
            torch.testing.assert_close(copied, gathered, rtol=tolerance, atol=tolerance,
                                       msg=name)
        elif device.type == "cuda":
            assert torch.equal(copied, gathered), name
        else:  # Triton's interpreter truncates fp32 to bf16 (a GPU rounds to nearest even)
            torch.testing.assert_close(copied, gathered, rtol=2**-7, atol=0, msg=name)


# (dims, order heads, bias axes or None, bias gradient, K and V gradients, one autograd node,
# the bias read by the row copies)
ONE_NODE = [
    pytest.param(Dims(2, 33, 50, heads_q=4, heads_kv=2, head_dim=16), "Hq",
                 ("B", "Hq", "1", "Lk"), True, True, True, True, id="order-per-query-head"),
    pytest.param(Dims(2, 40, 64, heads_q=4, heads_kv=2, head_dim=16), "Hk",
                 ("B", "Hk", "1", "Lk"), True, True, True, True, id="kv-row-bias"),
    pytest.param(Dims(2, 40, 64, heads_q=4, heads_kv=2, head_dim=16), "Hk",
                 ("B", "Hk", "1", "Lk"), False, True, True, True, id="kv-row-bias-without-grad"),
    pytest.param(Dims(2, 40, 64, heads_q=4, heads_kv=2, head_dim=16), "Hk",
                 ("B", "Hk", "1", "Lk"), True, False, True, False, id="bias-grad-only"),
    pytest.param(Dims(2, 45, 45, heads_q=4, heads_kv=2, head_dim=16), "Hk",
                 ("1", "Hk", "1", "Lk"), True, True, True, False, id="batch-shared-bias"),
    pytest.param(Dims(1, 40, 70, heads_q=4, heads_kv=1, head_dim=40), "1",
                 ("1", "1", "Lq", "Lk"), False, True, True, False, id="mqa-bias-without-grad"),
    pytest.param(Dims(2, 33, 50, heads_q=4, heads_kv=2, head_dim=16), "Hk", None, False,
                 False, True, False, id="query-grad-only"),
    pytest.param(Dims(2, 33, 50, heads_q=4, heads_kv=2, head_dim=16), "Hq",
                 ("B", "Hk", "1", "Lk"), True, True, False, False,
                 id="bias-widened-to-the-order"),
]


@pytest.mark.parametrize("dims,heads,bias_axes,bias_grad,kv_grad,one_node,folded", ONE_NODE)
def test_an_ordered_call_with_gradients_is_one_autograd_node(dims, heads, bias_axes, bias_grad,
                                                             kv_grad, one_node, folded, device,
                                                             monkeypatch):
    """An eager ordered call whose K and V are copied by rows reads K, V and the bias in key
    order inside the attention's own node, and sends their gradients back through the inverse
    order there; a bias of one row per (batch, head of the copies) rides in the row copies
    both ways. Outputs, LSE and every gradient asked for match the fp64 reference. A bias
    that needs a gradient through a widening to the order's heads keeps the graph of
    ``reorder_keys``."""
    monkeypatch.setattr(key_order, "INTERPRETED_COPIES", True)  # on CPU tensors too
    dtype = torch.float16
    q, k, v = random_qkv(dims, dtype, device)
    bias = None if bias_axes is None else axes_bias(dims, bias_axes, dtype, device)
    q.requires_grad_()
    k.requires_grad_(kv_grad), v.requires_grad_(kv_grad)
    if bias is not None:
        bias.requires_grad_(bias_grad)
    intervals = topk_intervals(selection(dims, heads, device), 7, seqlen_q=dims.seqlen_q,
                               is_causal=True, order_keys=True)
    reads = key_order.key_order_reads(q, k, v, intervals, bias, True)
    assert (reads is not None) == one_node
    assert reads is None or reads.fold_bias == folded
    out, lse = dmattn_func(q, k, v, intervals, bias, True, return_lse=True)
    assert (type(out.grad_fn).__name__ == "_KeyOrderedFunctionBackward") == one_node
    leaves = [t for t in (q, k, v, bias) if t is not None and t.requires_grad]
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(device)
    got = torch.autograd.grad(out, leaves, grad_out.to(dtype))
    runs = []
    for upcast in (True, False):
        inputs = [None if t is None else t.detach().float() if upcast else t.detach()
                  for t in (q, k, v, bias)]
        for t, leaf in zip(inputs, (q, k, v, bias)):
            if t is not None and leaf.requires_grad:
                t.requires_grad_()
        ref_out, ref_lse = attention_reference(*inputs[:3], intervals, inputs[3], True,
                                               return_lse=True, upcast=upcast)
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        upstream = grad_out.double() if upcast else grad_out.to(dtype)
        runs.append((ref_out, ref_lse, torch.autograd.grad(ref_out, wanted,
                                                            upstream.to(ref_out.dtype))))
    (truth_out, truth_lse, truth), (low_out, low_lse, low) = runs
    assert torch.isfinite(out).all()
    assert_close_to_reference("out", out, truth_out, low_out, dtype)
    assert_close_to_reference("lse", lse, truth_lse, low_lse, dtype)
    names = [name for name, wanted in (("dq", True), ("dk", kv_grad), ("dv", kv_grad),
                                       ("dbias", bias is not None and bias_grad)) if wanted]
    assert len(got) == len(names)
    for name, a, t, lo in zip(names, got, truth, low):
        assert a.shape == t.shape, name
        assert torch.isfinite(a).all(), f"{name} has NaN or Inf"
        assert_close_to_reference(name, a, t, lo, dtype)


# (dims, order heads, bias axes or None, the bias read by the row copies)
NO_GRAPH = [
    pytest.param(Dims(2, 40, 64, heads_q=4, heads_kv=2, head_dim=16), "Hk",
                 ("B", "Hk", "1", "Lk"), True, id="kv-row-bias"),
    pytest.param(Dims(2, 33, 50, heads_q=4, heads_kv=2, head_dim=16), "Hq",
                 ("B", "Hq", "1", "Lk"), True, id="order-per-query-head"),
    pytest.param(Dims(2, 45, 45, heads_q=4, heads_kv=2, head_dim=16), "Hk",
                 ("1", "Hk", "1", "Lk"), False, id="batch-shared-bias"),
    pytest.param(Dims(1, 40, 70, heads_q=4, heads_kv=1, head_dim=40), "1",
                 ("1", "1", "Lq", "Lk"), False, id="mqa-full-bias"),
    pytest.param(Dims(2, 33, 50, heads_q=4, heads_kv=2, head_dim=16), "Hk", None, False,
                 id="no-bias"),
    pytest.param(Dims(1, 17, 97, heads_q=3, heads_kv=1, head_dim=80), "Hk",
                 ("1", "1", "1", "Lk"), True, id="odd-lengths-mqa-d80"),
    pytest.param(Dims(2, 1, 97, heads_q=4, heads_kv=2, head_dim=40), "Hk",
                 ("B", "Hk", "1", "Lk"), True, id="one-query-row-d40"),
]


@pytest.mark.parametrize("dims,heads,bias_axes,folded", NO_GRAPH)
@pytest.mark.parametrize("grad_mode", ("no-grad", "no-requires-grad"))
def test_an_ordered_call_without_gradients_reads_its_keys_once(dims, heads, bias_axes, folded,
                                                               grad_mode, device, monkeypatch):
    """An eager ordered call that records no graph (under ``torch.no_grad`` or with no input
    requiring a gradient) reads K, V and the bias in key order through ``KeyOrderReads``: a
    bias of one row per (batch, head of the copies) in the row copies' launch (no gather of
    its own), another gathered. Its outputs are bit for bit those of ``reorder_keys``'s path
    and match the fp64 reference."""
    monkeypatch.setattr(key_order, "INTERPRETED_COPIES", True)  # on CPU tensors too
    dtype = torch.float16
    q, k, v = random_qkv(dims, dtype, device)
    bias = None if bias_axes is None else axes_bias(dims, bias_axes, dtype, device)
    if grad_mode == "no-requires-grad" and bias is not None:
        bias.requires_grad_(False)
    intervals = topk_intervals(selection(dims, heads, device), 7, seqlen_q=dims.seqlen_q,
                               is_causal=True, order_keys=True)

    def call():
        with torch.no_grad() if grad_mode == "no-grad" else contextlib.nullcontext():
            return dmattn_func(q, k, v, intervals, bias, True, return_lse=True)

    reads = key_order.key_order_reads(q, k, v, intervals, bias, True, grads=False)
    assert reads is not None and reads.fold_bias == folded and reads.inverse is None
    gathers = []
    gather_bias = key_order._gather_bias
    monkeypatch.setattr(key_order, "_gather_bias",
                        lambda *a, **kw: gathers.append(1) or gather_bias(*a, **kw))
    out, lse = call()
    assert out.grad_fn is None and lse.grad_fn is None
    assert len(gathers) == (0 if folded or bias is None else 1)
    monkeypatch.setattr(interface, "key_order_reads", lambda *a, **kw: None)
    graph_out, graph_lse = call()  # reorder_keys's path
    assert torch.equal(out, graph_out) and torch.equal(lse, graph_lse)
    inputs = [None if t is None else t.detach() for t in (q, k, v, bias)]
    truth_out, truth_lse = attention_reference(*inputs[:3], intervals, inputs[3], True,
                                               return_lse=True)
    low_out, low_lse = attention_reference(*inputs[:3], intervals, inputs[3], True,
                                           return_lse=True, upcast=False)
    assert torch.isfinite(out).all()
    assert_close_to_reference("out", out, truth_out, low_out, dtype)
    assert_close_to_reference("lse", lse, truth_lse, low_lse, dtype)


def test_an_ordered_calls_reads_are_kept_per_form(device, monkeypatch):
    """``key_order_reads`` makes a call form's reads once and hands later calls of the form
    the same object, without building its parts again; another form (gradients, a bias
    layout, a write into the intervals) gets its own, and a form whose bias keeps
    ``reorder_keys``'s graph keeps that answer too."""
    monkeypatch.setattr(key_order, "INTERPRETED_COPIES", True)  # on CPU tensors too
    dims = Dims(2, 33, 50, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    k.requires_grad_()
    bias = axes_bias(dims, ("B", "Hk", "1", "Lk"), torch.float16, device)
    intervals = topk_intervals(selection(dims, "Hk", device), 7, seqlen_q=dims.seqlen_q,
                               is_causal=True, order_keys=True)
    made = []
    make = key_order._make_reads
    monkeypatch.setattr(key_order, "_make_reads", lambda *a: made.append(1) or make(*a))
    first = key_order.key_order_reads(q, k, v, intervals, bias, True)
    assert key_order.key_order_reads(q, k, v, intervals, bias, True) is first
    assert len(made) == 1
    without = key_order.key_order_reads(q, k, v, intervals, bias, True, grads=False)
    assert without is not first and without.inverse is None and first.inverse is not None
    assert key_order.key_order_reads(q, k, v, intervals, None, True) is not first
    assert len(made) == 3
    # a bias broadcast over the batch, needing a gradient: reorder_keys's graph, kept as such
    shared = axes_bias(dims, ("1", "Hk", "1", "Lk"), torch.float16, device).expand(
        dims.batch, -1, -1, -1)
    assert key_order.key_order_reads(q, k, v, intervals, shared, True) is None
    assert key_order.key_order_reads(q, k, v, intervals, shared, True) is None
    assert len(made) == 4
    with torch.no_grad():
        intervals.end.add_(0)  # a write: a new version, new reads
    again = key_order.key_order_reads(q, k, v, intervals, bias, True)
    assert again is not first and len(made) == 5
    assert len(intervals._reads) <= key_order.MAX_READS
