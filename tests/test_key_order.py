"""Key intervals read in a key order (``kernels.masks.key_order``): the same attention and gradients
as the keys' own order, against the float64 reference; the order is a permutation that groups
keys seen by similar rows, and it cuts the active tiles of a top-W mask."""

from __future__ import annotations

import importlib
import pytest
import torch

from attn_helpers import (Dims, assert_close_to_reference, assert_grads_close_to_reference,
                          grads_of, random_qkv)
from kernels import (KeyIntervals, attention_reference, dmattn_func, interface, prepared,
                     schedule_for)
from kernels.masks import key_order
from kernels import topk_intervals
from kernels.masks.grouping import end_buckets, grouping_order
from kernels.masks.key_order import reordered_intervals
from kernels.masks.topk import orders_keys
from key_order_helpers import axes_bias, selection

# (dims, selection heads: "1", "Hk" or "Hq", bias shape as axis names)
SHAPES = [
    pytest.param(Dims(2, 33, 50, heads_q=4, heads_kv=2, head_dim=16), "Hq",
                 ("B", "Hk", "1", "Lk"), id="order-per-query-head"),
    pytest.param(Dims(1, 50, 33, heads_q=4, heads_kv=2, head_dim=16), "Hk",
                 ("1", "Hq", "1", "Lk"), id="order-per-kv-head"),
    pytest.param(Dims(2, 40, 70, heads_q=4, heads_kv=1, head_dim=40), "1",
                 ("B", "1", "Lq", "Lk"), id="one-order-mqa-full-bias"),
    pytest.param(Dims(2, 45, 45, heads_q=4, heads_kv=2, head_dim=16), "Hk",
                 ("1", "Hk", "1", "Lk"), id="order-per-kv-head-batch-shared-bias"),
]


@pytest.mark.parametrize("dims,heads,bias_axes", SHAPES)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_ordered_intervals_match_the_reference(dims, heads, bias_axes, causal, device):
    dtype = torch.float16
    q, k, v = random_qkv(dims, dtype, device)
    bias = axes_bias(dims, bias_axes, dtype, device)
    intervals = topk_intervals(selection(dims, heads, device), 7, seqlen_q=dims.seqlen_q,
                               is_causal=causal, order_keys=True)
    assert intervals.key_order is not None
    out, lse = dmattn_func(q, k, v, intervals, bias, causal, return_lse=True)
    ref_out, ref_lse = attention_reference(q, k, v, intervals, bias, causal, return_lse=True)
    low_out, low_lse = attention_reference(q, k, v, intervals, bias, causal, return_lse=True,
                                           upcast=False)
    assert torch.isfinite(out).all()
    assert_close_to_reference("out", out, ref_out, low_out, dtype)
    assert_close_to_reference("lse", lse, ref_lse, low_lse, dtype)

    grad_out = torch.randn(q.shape, device=device).to(dtype)
    assert_grads_close_to_reference(q, k, v, intervals, bias, causal, grad_out, dtype)


def test_order_changes_no_bit_of_a_deterministic_call(device):
    """Ordered and unordered: the same softmax over the same keys, summed in another order,
    so equal within rounding; and each is bitwise reproducible run to run."""
    dims = Dims(2, 64, 64, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    bias = axes_bias(dims, ("B", "Hk", "1", "Lk"), torch.float32, device)
    ordered = topk_intervals(selection(dims, "Hk", device), 9, order_keys=True)
    plain = KeyIntervals(ordered.start, ordered.end)
    grad_out = torch.randn(q.shape, device=device)
    runs = [grads_of(dmattn_func, q, k, v, mask, bias, True, None, grad_out,
                     deterministic=True) for mask in (ordered, ordered, plain)]
    for (name, a), (_, b), (_, c) in zip(*(r.named() for r in runs)):
        assert torch.equal(a, b), name
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5, msg=name)


def test_grouping_order_is_a_permutation_sorted_by_end_bucket_then_start():
    generator = torch.Generator().manual_seed(3)
    start = torch.randint(0, 5000, (2, 3, 300), generator=generator)
    end = start + torch.randint(-50, 3000, (2, 3, 300), generator=generator)
    order = grouping_order(start, end)
    assert order.dtype == torch.int64 and order.shape == start.shape
    assert torch.equal(order.sort(-1).values, torch.arange(300).expand(2, 3, 300))
    s, e = start.gather(-1, order), end.gather(-1, order)
    empty = s >= e
    kept = (~empty).sum(-1, keepdim=True)
    assert torch.equal(empty, torch.arange(300) >= kept)  # empty intervals come last
    bucket = end_buckets(start, end).gather(-1, order)
    sort_key = bucket * (1 << 32) + s
    assert bool((sort_key.diff(dim=-1)[~empty[..., 1:]] >= 0).all())


def test_end_buckets_widen_with_the_end():
    """floor(sqrt(Lk W / end) / 8), negated: W = 1024 kept per row of 4096 keys, rows 4096."""
    lk, rows = 4096, 4096
    start = torch.zeros(1, 1, lk, dtype=torch.int64)
    end = torch.full((1, 1, lk), rows // 4, dtype=torch.int64)
    end[..., -1] = rows  # the latest end fixes the row count
    window = float(end.sum()) / rows
    bucket = end_buckets(start, end)
    expected = -int((lk * window / (rows // 4)) ** 0.5 / 8)
    assert int(bucket[0, 0, 0]) == expected
    # monotone in the end: a later end never gets an earlier bucket
    ends = torch.arange(1, lk + 1).view(1, 1, lk)
    b = end_buckets(torch.zeros_like(ends), ends)
    assert bool((b.diff(dim=-1) >= 0).all())
    widths = torch.unique_consecutive(b[0, 0], return_counts=True)[1]
    assert int(widths[-1]) > int(widths[1])  # buckets widen


def test_the_order_cuts_a_top_w_masks_active_tiles():
    """Counted on the host (``IntervalBlockBounds.tiles``): causal top-256 of 8192 keys, 128x64
    tiles: 3927 active in key order, 450 ordered, against 252 tiles' worth of kept pairs."""
    bias = torch.randn(1, 1, 1, 8192, generator=torch.Generator().manual_seed(0))
    ordered = topk_intervals(bias, 256, order_keys=True)
    kept = int((ordered.end - ordered.start).clamp(min=0).sum())
    counts = []
    for start, end in ((ordered.start, ordered.end),
                       (ordered.start.gather(-1, ordered.key_order),
                        ordered.end.gather(-1, ordered.key_order))):
        active, _ = KeyIntervals(start, end).block_bounds(64).tiles(128, 8192)
        counts.append(int(active.sum()))
    assert counts[0] > 6 * counts[1], counts
    assert counts[1] * 128 * 64 < 2 * kept, (counts, kept)


def shape_rules_alone(monkeypatch):
    """``orders_keys`` with its shape rules only (its tile threshold at 0, as under the
    interpreter), on any device."""
    topk_module = importlib.import_module("kernels.masks.topk")
    monkeypatch.setattr(topk_module, "ORDER_MIN_SAVED_TILES", 0)
    monkeypatch.setattr(topk_module, "ORDER_MIN_SAVED_TILES_INTERPRETED", 0)


def test_topk_intervals_orders_keys_by_shape(monkeypatch):
    shape_rules_alone(monkeypatch)
    bias = torch.randn(1, 2, 1, 1024)
    assert topk_intervals(bias, 256).key_order is not None  # 4 W visible, causal
    assert topk_intervals(bias, 512).key_order is None
    assert topk_intervals(bias, 512, is_causal=False).key_order is not None
    assert topk_intervals(bias, 32, seqlen_q=1).key_order is None  # decode
    assert topk_intervals(bias, 512, order_keys=True).key_order is not None
    assert topk_intervals(bias, 32, order_keys=False).key_order is None
    assert orders_keys(256, 8192, 2048, True) and not orders_keys(255, 8192, 2048, True)


def test_orders_keys_needs_enough_saved_tiles(monkeypatch):
    """Past the shape rules, the order is given where the selection's rows together save at
    least ORDER_MIN_SAVED_TILES tiles (the GPU's rule; the interpreter's threshold is 0)."""
    topk_module = importlib.import_module("kernels.masks.topk")
    monkeypatch.setattr(topk_module, "is_interpreted", lambda kernel: False)
    per_row = topk_module.saved_tiles(4096, 4096, 1024, True)
    assert 0 < per_row < topk_module.ORDER_MIN_SAVED_TILES
    enough = -(-topk_module.ORDER_MIN_SAVED_TILES // per_row)  # rows that save enough together
    assert orders_keys(4096, 4096, 1024, True, rows=int(enough))
    assert not orders_keys(4096, 4096, 1024, True, rows=int(enough) - 1)
    assert orders_keys(16384, 16384, 2048, True, rows=1)  # longctx: one row saves enough


def test_the_gpu_orders_only_where_the_saving_beats_the_host_cost(monkeypatch):
    """The GPU's rule (``saved_tiles`` against ORDER_MIN_SAVED_TILES) on the H100 shapes it was
    set from: ordered where the order measured faster, plain where it measured slower."""
    topk_module = importlib.import_module("kernels.masks.topk")
    monkeypatch.setattr(topk_module, "is_interpreted", lambda kernel: False)
    faster = [(16384, 4096, 1), (16384, 256, 1), (8192, 1024, 8), (16384, 2048, 4)]
    slower = [(2048, 256, 2), (16384, 32, 1), (4096, 1024, 4), (32768, 32, 1)]
    for length, window, rows in faster:
        assert orders_keys(length, length, window, True, rows), (length, window, rows)
    for length, window, rows in slower:
        assert not orders_keys(length, length, window, True, rows), (length, window, rows)
    assert topk_module.saved_tiles(8192, 8192, 1024, True) < topk_module.saved_tiles(
        16384, 16384, 1024, True)  # the saving grows with the length


def test_order_keys_is_checked():
    bias = torch.randn(1, 1, 1, 64)
    with pytest.raises(TypeError, match="order_keys must be a bool or None"):
        topk_intervals(bias, 8, order_keys="yes")
    cu = torch.tensor([0, 30, 64], dtype=torch.int32)
    with pytest.raises(ValueError, match="order_keys must be None or False with cu_seqlens"):
        topk_intervals(torch.randn(1, 64), 8, cu_seqlens_k=cu, order_keys=True)


def test_an_ordered_call_checks_its_inputs_first():
    dims = Dims(1, 16, 16, heads_q=2, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, "cpu")
    intervals = topk_intervals(torch.randn(1, 2, 1, 17), 4, seqlen_q=16, order_keys=True)
    with pytest.raises(ValueError, match="attn_mask.start dimension 2"):
        dmattn_func(q, k, v, intervals, is_causal=True)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        dmattn_func(q, k, v, topk_intervals(torch.randn(1, 2, 1, 16), 4, order_keys=True),
                    is_causal="yes")


def test_an_ordered_form_is_checked_once(monkeypatch, no_kept_plans, device):
    """The checks of an ordered call read only layouts: a repeat form skips them (and the
    kernel operand they build); a call of another form is checked, and a bad one refused."""
    dims = Dims(1, 16, 16, heads_q=2, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    intervals = topk_intervals(torch.randn(1, 2, 1, 16, device=device), 4, order_keys=True)
    checks = []
    checked = interface.check_inputs
    monkeypatch.setattr(interface, "check_inputs",
                        lambda *args: checks.append(args[3]) or checked(*args))
    first = dmattn_func(q, k, v, intervals, is_causal=True)
    ordered_checks = sum(mask is intervals for mask in checks)
    assert ordered_checks == 1
    assert torch.equal(dmattn_func(q, k, v, intervals, is_causal=True), first)
    assert sum(mask is intervals for mask in checks) == ordered_checks
    dmattn_func(q, k, v, intervals, is_causal=False)  # another form: checked again
    assert sum(mask is intervals for mask in checks) == ordered_checks + 1
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        dmattn_func(q, k, v, intervals, is_causal=1)
    longer = random_qkv(Dims(1, 16, 17, heads_q=2, heads_kv=2, head_dim=16), torch.float32,
                        device)
    with pytest.raises(ValueError, match="attn_mask.start dimension 2"):
        dmattn_func(q, longer[1], longer[2], intervals, is_causal=True)


def test_schedule_for_shows_the_ordered_call(device):
    """What runs: no causal tiles (causality is in the intervals), K and V per mask head."""
    dims = Dims(1, 64, 64, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    intervals = topk_intervals(selection(dims, "Hq", device), 8, order_keys=True)
    schedule = schedule_for(q, k, v, intervals, is_causal=True)
    assert not schedule.problem.is_causal
    assert schedule.problem.shape.heads_kv == dims.heads_q


def test_doge_padding_keeps_the_key_order(device, monkeypatch):
    """Doge's masking intersects the top-W intervals with the padding: the result keeps their
    key order (padding only empties or shortens runs) and gives the unordered call's output."""
    from kernels.integrations.masking import doge_masking
    shape_rules_alone(monkeypatch)  # 256 keys: too few saved tiles for the GPU's rule
    dims = Dims(2, 256, 256, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    bias = torch.randn(2, 1, 1, 256, generator=torch.Generator().manual_seed(5)).to(device)
    padding = torch.ones(2, 256, dtype=torch.long, device=device)
    padding[1, 200:] = 0  # right-padded second row
    masking = doge_masking(padding, bias, 256, True, None, 16)
    assert masking.attn_mask.key_order is not None
    plain = KeyIntervals(masking.attn_mask.start, masking.attn_mask.end)
    outs = [dmattn_func(q, k, v, mask, masking.attn_bias, masking.is_causal)
            for mask in (masking.attn_mask, plain)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_a_broadcast_bias_is_gathered_as_one_row():
    """A per-key bias handed in expand()ed over the query rows (stride 0) is gathered as its
    one row, not as an (Lq, Lk) copy."""
    from kernels.masks.key_order import reorder_keys
    dims = Dims(2, 300, 300, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, "cpu")
    per_key = torch.randn(2, 2, 1, 300)
    intervals = topk_intervals(per_key, 16, order_keys=True)
    _, _, _, bias = reorder_keys(q, k, v, intervals, per_key.expand(2, 2, 300, 300), True)
    assert bias.shape == (2, 2, 1, 300)
    order = intervals.key_order[:, :, None, :]
    assert torch.equal(bias, per_key.gather(-1, order))



@pytest.mark.parametrize("bias_shape, order_heads, gathered_back", [
    ((2, 2, 1, 60), 2, True), ((1, 2, 1, 60), 2, True), ((2, 4, 5, 60), 2, True),
    ((2, 2, 1, 60), 4, False)], ids=["per-head", "batch-shared", "rows", "widened"])
def test_a_bias_read_in_key_order_has_the_gradient_of_the_gather(bias_shape, order_heads,
                                                                  gathered_back):
    """The bias's gradient through the key order: a gather back through the inverse order
    where the bias is not widened to the order's heads, else ``torch.gather``'s own; equal
    either way to the gradient of the gather in torch."""
    from kernels.masks.key_order import reorder_keys
    dims = Dims(2, 5, 60, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, "cpu")
    intervals = topk_intervals(torch.randn(2, order_heads, 1, 60), 8, seqlen_q=5,
                               order_keys=True)
    bias = torch.randn(bias_shape, requires_grad=True)
    _, _, _, ordered = reorder_keys(q, k, v, intervals, bias, True)
    assert (type(ordered.grad_fn).__name__ == "_BiasInOrderBackward") == gathered_back
    grad_out = torch.randn(ordered.shape)
    (grad,) = torch.autograd.grad(ordered, bias, grad_out)
    plain = bias.detach().requires_grad_()
    heads = max(bias_shape[1], order_heads)
    order = intervals.key_order.repeat_interleave(heads // order_heads, 1)[:, :, None, :]
    widened = plain.expand(2, -1, -1, -1).repeat_interleave(heads // bias_shape[1], 1)
    expected = widened.gather(3, order.expand(2, heads, bias_shape[2], 60))
    torch.testing.assert_close(ordered, expected, rtol=0, atol=0)
    (want,) = torch.autograd.grad(expected, plain, grad_out)
    torch.testing.assert_close(grad, want)

# -- the reordered intervals an ordered object keeps (``key_order.reordered_intervals``)

def test_reordered_intervals_are_kept_per_form_and_bounded(monkeypatch):
    """One object per form (causality, the query length where causal, the versions of start,
    end and the order), the oldest dropped past MAX_REORDERED; none kept while tracing."""
    ordered = topk_intervals(torch.randn(2, 3, 1, 40), 5, seqlen_q=30, order_keys=True)

    def fresh(seqlen_q, is_causal):
        return key_order._reorder(ordered, seqlen_q, is_causal)

    causal = reordered_intervals(ordered, 30, True)
    assert reordered_intervals(ordered, 30, True) is causal
    assert causal.key_order is None
    full = reordered_intervals(ordered, 30, False)
    assert full is not causal and reordered_intervals(ordered, 12, False) is full
    longer = reordered_intervals(ordered, 45, True)  # key j first seen at row j + 5
    assert longer is not causal and not torch.equal(longer.start, causal.start)
    for got, want in ((causal, fresh(30, True)), (full, fresh(30, False)),
                      (longer, fresh(45, True))):
        assert torch.equal(got.start, want.start) and torch.equal(got.end, want.end)
    assert len(ordered._reordered) == 3

    ordered.end[0, 0, :20] = 0  # in place: a new form, read from the new values
    written = reordered_intervals(ordered, 30, True)
    assert written is not causal and torch.equal(written.end, fresh(30, True).end)
    assert not torch.equal(written.end, causal.end)

    monkeypatch.setattr(key_order, "MAX_REORDERED", 2)
    assert reordered_intervals(ordered, 30, False) is not full  # a new form: the oldest go
    assert list(ordered._reordered.values())[0] is written
    assert len(ordered._reordered) == 2

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = reordered_intervals(ordered, 30, True)
    assert traced is not written and torch.equal(traced.start, written.start)
    assert reordered_intervals(ordered, 30, True) is not traced
    assert len(ordered._reordered) == 2


@pytest.mark.parametrize("selection_heads", ["Hk", "Hq"])
def test_gather_indices_are_kept_per_form(monkeypatch, selection_heads):
    """An ordered object's calls read the bias through an index made once per form (the
    order's heads, the batch, the operand's heads and rows, the order's version): a repeat
    call gathers the same keys without making it again; a write into the order makes a new
    one; none is kept while tracing. K and V (row copies of CUDA tensors) and the bias equal
    indexing each head by its order."""
    from kernels.masks.key_order import reorder_keys
    dims = Dims(2, 30, 40, heads_q=4, heads_kv=2, head_dim=8)
    q, k, v = random_qkv(dims, torch.float32, "cpu")
    bias = torch.randn(2, 2, 30, 40)
    ordered = topk_intervals(selection(dims, selection_heads, "cpu"), 5, seqlen_q=30,
                             order_keys=True)
    made = []
    real = key_order._bias_index
    monkeypatch.setattr(key_order, "_bias_index", lambda *a: made.append(1) or real(*a))

    first = reorder_keys(q, k, v, ordered, bias, True)
    again = reorder_keys(q, k, v, ordered, bias, True)
    # the bias's index (K and V's too where Triton cannot run on CPU tensors: no interpreter)
    assert len(made) == 1 and [f[0] for f in ordered._gather_indices].count("bias") == 1
    order = ordered.key_order
    heads = order.shape[1]
    for got, source in ((first[0], k), (first[1], v)):
        widened = source.repeat_interleave(heads // dims.heads_kv, dim=2)
        want = torch.stack([widened[b, order[b, h], h] for b in range(2) for h in range(heads)])
        assert torch.equal(got, want.view(2, heads, 40, 8).transpose(1, 2))
    widened = bias.repeat_interleave(heads // 2, dim=1)
    want = torch.stack([widened[b, h][:, order[b, h]] for b in range(2) for h in range(heads)])
    assert torch.equal(first[3], want.view(2, heads, 30, 40))
    for a, b in zip(first, again):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)

    ordered.key_order.copy_(ordered.key_order.flip(-1))  # in place: a new form
    written = reorder_keys(q, k, v, ordered, bias, True)
    assert len(made) == 2 and torch.equal(written[0][:, 0], first[0][:, -1])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    kept = dict(ordered._gather_indices)
    reorder_keys(q, k, v, ordered, bias, True)
    assert len(made) == 3 and ordered._gather_indices == kept


def test_a_reused_ordered_object_runs_on_its_kept_preparation(device, monkeypatch):
    """A model's layers share one ordered mask: the second call with it gets the reordered
    intervals of the first, and so prepares them (``prepared.prepared_intervals``); the third
    reorders and prepares nothing. Every call gives the first one's bits."""
    dims = Dims(1, 40, 48, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    bias = axes_bias(dims, ("1", "Hk", "1", "Lk"), torch.float32, device)
    ordered = topk_intervals(selection(dims, "Hq", device), 7, seqlen_q=dims.seqlen_q,
                             order_keys=True)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(device)

    def call():
        return grads_of(dmattn_func, q, k, v, ordered, bias, True, None, grad_out,
                        deterministic=True)

    runs = [call(), call()]
    (reordered,) = ordered._reordered.values()
    (preparation,) = reordered._preparations.values()
    assert preparation is not None

    def refused(*args, **kwargs):
        raise AssertionError("the third call reordered or prepared the intervals again")

    monkeypatch.setattr(key_order, "_reorder", refused)
    monkeypatch.setattr(prepared, "_prepare", refused)
    runs.append(call())
    assert list(ordered._reordered.values()) == [reordered]
    for named in zip(*(r.named() for r in runs)):
        (name, first), *others = named
        assert all(torch.equal(first, other) for _, other in others), name


def test_an_ordered_object_written_in_place_is_reordered_again(device):
    dims = Dims(1, 40, 48, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    ordered = topk_intervals(selection(dims, "Hk", device), 7, seqlen_q=dims.seqlen_q,
                             order_keys=True)
    with torch.no_grad():
        before = [dmattn_func(q, k, v, ordered, None, True) for _ in range(2)]
        ordered.start[..., : dims.seqlen_k // 2] += 5  # later rows for the first half
        after = dmattn_func(q, k, v, ordered, None, True)
        plain = dmattn_func(q, k, v, KeyIntervals(ordered.start, ordered.end), None, True)
    assert len(ordered._reordered) == 2
    assert torch.equal(before[0], before[1]) and not torch.equal(after, before[0])
    torch.testing.assert_close(after, plain, rtol=1e-5, atol=1e-5)


def test_topk_intervals_order_is_the_grouping_order_of_its_intervals(device):
    """The order made beside the selection (per (batch x head) row, inside its CUDA graph on
    a GPU) is the grouping order of the intervals it returns."""
    bias = torch.randn(2, 3, 1, 640, generator=torch.Generator().manual_seed(11)).to(device)
    ordered = topk_intervals(bias, 64, order_keys=True)
    plain = topk_intervals(bias, 64, order_keys=False)
    assert torch.equal(ordered.start, plain.start) and torch.equal(ordered.end, plain.end)
    assert torch.equal(ordered.key_order, grouping_order(plain.start, plain.end))
    again = topk_intervals(bias, 64, order_keys=True)  # a replay on a GPU
    assert torch.equal(again.key_order, ordered.key_order)
