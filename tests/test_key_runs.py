"""Bool masks whose every key is kept by one run of rows, read as KeyIntervals
(``kernels.masks.key_runs``; ``prepare_mask`` with ``tuning.BOOL_MASK_RUNS``): the runs found
exactly, the key order where it pays, and calls with the prepared mask against the fp64
reference of the bool mask. Interpreted on the CPU; on a GPU the same calls run compiled."""

from __future__ import annotations

import pytest
import torch

from attn_helpers import (Dims, assert_close_to_reference, random_bias, random_qkv,
                          run_backward)
from kernels import KeyIntervals, attention_reference, dmattn_func, prepare_mask
from kernels.masks.key_runs import block_spans, key_runs, order_that_pays
from kernels.prepared import prepared_intervals
from kernels.planning import tuning


def _effective(mask, seqlen_q, seqlen_k, is_causal):
    """The pairs a call keeps: the mask, with causality where asked, at full size."""
    mask = mask.expand(mask.shape[0], mask.shape[1], seqlen_q, seqlen_k)
    if not is_causal:
        return mask
    row = torch.arange(seqlen_q)[:, None]
    return mask & (torch.arange(seqlen_k) <= row + seqlen_k - seqlen_q)


def _from_runs(start, end, seqlen_q):
    row = torch.arange(seqlen_q)[:, None]
    return (start[:, :, None, :] <= row) & (row < end[:, :, None, :])


def _top_window(bias, window, seqlen_q, is_causal):
    """flash-dmattn's top-``window`` bool mask of a per-key bias (B, H, 1, Lk)."""
    seqlen_k = bias.shape[-1]
    visible = _effective(torch.ones(1, 1, 1, seqlen_k, dtype=torch.bool), seqlen_q, seqlen_k,
                         is_causal)
    scores = bias.float().expand(-1, -1, seqlen_q, -1).masked_fill(~visible, float("-inf"))
    kept = torch.zeros(scores.shape, dtype=torch.bool)
    kept.scatter_(-1, scores.topk(min(window, seqlen_k), dim=-1).indices, True)
    return kept & visible


def _sliding(seqlen_q, seqlen_k, window):
    row = torch.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q
    key = torch.arange(seqlen_k)
    return ((key <= row) & (key > row - window))[None, None]


MASKS = {
    "sliding": lambda: _sliding(300, 300, 37),
    "top-W": lambda: _top_window(torch.randn(2, 3, 1, 300), 24, 300, True),
    "top-W cross": lambda: _top_window(torch.randn(1, 2, 1, 333), 40, 257, True),
    "one row": lambda: torch.rand(2, 1, 1, 300) < 0.3,
    "all": lambda: torch.ones(1, 1, 300, 300, dtype=torch.bool),
}


@pytest.mark.parametrize("name", MASKS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_runs_are_found_exactly(name, is_causal, monkeypatch):
    monkeypatch.setattr("kernels.masks.key_runs.ROWS", 64)  # several chunks
    mask = MASKS[name]()
    seqlen_q, seqlen_k = (257, 333) if name == "top-W cross" else (300, 300)
    runs = key_runs(mask, seqlen_q, seqlen_k, is_causal)
    assert runs is not None
    start, end = runs
    assert start.dtype == end.dtype == torch.int32
    assert start.shape == (*mask.shape[:2], seqlen_k)
    want = _effective(mask, seqlen_q, seqlen_k, is_causal)
    assert torch.equal(_from_runs(start, end, seqlen_q) & want, want)
    assert torch.equal(_effective(_from_runs(start, end, seqlen_q), seqlen_q, seqlen_k,
                                  is_causal), want)
    assert ((start == 0) & (end == 0) | (start < end)).all()  # empty keys as (0, 0)


def test_a_key_kept_by_two_runs_is_not_intervals():
    mask = torch.zeros(1, 1, 50, 60, dtype=torch.bool)
    mask[0, 0, 3:9, 7] = True
    mask[0, 0, 12:20, 7] = True
    assert key_runs(mask, 50, 60, False) is None
    # causality hides rows 10..19 from key 30 (row r sees keys up to r): one run remains
    within = torch.zeros(1, 1, 50, 50, dtype=torch.bool)
    within[0, 0, 10:20, 30] = True
    within[0, 0, 35:40, 30] = True
    assert key_runs(within, 50, 50, False) is None
    start, end = key_runs(within, 50, 50, True)
    assert (start[0, 0, 30], end[0, 0, 30]) == (35, 40)


def test_a_key_order_is_given_where_it_gathers_scattered_keys():
    top = key_runs(_top_window(torch.randn(1, 2, 1, 2048), 64, 2048, True), 2048, 2048, True)
    order = order_that_pays(*top, 1.5)
    assert order is not None and order.shape == top[0].shape
    ordered = [torch.gather(t, -1, order) for t in top]
    assert block_spans(*ordered) * 1.5 <= block_spans(*top)
    sliding = key_runs(_sliding(2048, 2048, 256), 2048, 2048, True)
    assert order_that_pays(*sliding, 1.5) is None


def test_a_key_order_must_save_enough_rows(monkeypatch, device):
    """``order_that_pays`` refuses an order that saves fewer rows than asked, and
    ``prepare_mask`` asks for ``tuning.BOOL_MASK_RUNS_ORDER_LEAST_SAVED_PAIRS`` pairs: the
    rows saved times 128 keys times the (batch, query head) pairs a mask head serves."""
    top = key_runs(_top_window(torch.randn(1, 2, 1, 512), 32, 512, True), 512, 512, True)
    ordered = [torch.gather(t, -1, order_that_pays(*top, 1.5)) for t in top]
    saved = int(block_spans(*top) - block_spans(*ordered))
    assert saved > 0
    assert order_that_pays(*top, 1.5, saved) is not None
    assert order_that_pays(*top, 1.5, saved + 1) is None

    monkeypatch.setattr(tuning, "BOOL_MASK_RUNS", True)
    dims = Dims(batch=3, seqlen_q=512, seqlen_k=512, heads_q=8, heads_kv=2, head_dim=16)
    q, k, _ = random_qkv(dims, torch.float16, device)
    mask = _top_window(torch.randn(1, 2, 1, 512), 32, 512, True).to(device)
    runs = key_runs(mask, 512, 512, True)
    saved = int(block_spans(*runs) - block_spans(
        *[torch.gather(t, -1, order_that_pays(*runs, 1.5)) for t in runs]))
    served = 3 * 8 // 2  # the batch broadcast, and four query heads per mask head
    for least, kept in ((saved * 128 * served, True), (saved * 128 * served + 1, False)):
        monkeypatch.setattr(tuning, "BOOL_MASK_RUNS_ORDER_LEAST_SAVED_PAIRS", least)
        prepared = prepare_mask(mask, q, k, is_causal=True)
        assert prepared.intervals is not None
        assert (prepared.intervals.key_order is not None) == kept, least


def _call(q, k, v, mask, bias, is_causal, grad_out):
    leaves = [t.detach().requires_grad_() for t in (q, k, v, bias)]
    out = dmattn_func(*leaves[:3], attn_mask=mask, attn_bias=leaves[3], is_causal=is_causal)
    return (out, *torch.autograd.grad(out, leaves, grad_out))


@pytest.mark.parametrize("name", ["sliding", "top-W", "top-W cross"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_prepared_calls_read_the_runs_and_match_the_reference(name, is_causal, monkeypatch,
                                                              device):
    """With the option on, ``prepare_mask`` of a bool mask of runs gives calls the intervals
    of the same pairs: out, dq, dk, dv and a kv_row bias's gradient against the fp64
    reference of the bool mask, with the accuracy rule."""
    monkeypatch.setattr(tuning, "BOOL_MASK_RUNS", True)
    monkeypatch.setattr(tuning, "BOOL_MASK_RUNS_ORDER_LEAST_SAVED_PAIRS", 0)  # small shapes
    mask = MASKS[name]().to(device)
    seqlen_q, seqlen_k = (257, 333) if name == "top-W cross" else (300, 300)
    heads = max(mask.shape[1], 2)  # the mask's heads are the key heads (or one for all)
    dims = Dims(batch=2, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=2 * heads,
                heads_kv=heads, head_dim=16)
    dtype = torch.float16
    q, k, v = random_qkv(dims, dtype, device)
    bias = random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), dtype, device)
    prepared = prepare_mask(mask, q, k, is_causal=is_causal)
    assert prepared.intervals is not None and prepared.activity is None
    assert (prepared.intervals.key_order is not None) == name.startswith("top-W")
    grad_out = torch.randn_like(q)
    got = _call(q, k, v, prepared, bias, is_causal, grad_out)
    # the truth: float64 from float32 copies of the inputs (exact for every dtype)
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v, bias)]
    ref = attention_reference(*ref_leaves[:3], mask, ref_leaves[3], is_causal)
    want = (ref, *torch.autograd.grad(ref, ref_leaves, grad_out.to(ref.dtype)))
    low_leaves = [t.detach().requires_grad_() for t in (q, k, v, bias)]
    low = attention_reference(*low_leaves[:3], mask, low_leaves[3], is_causal, upcast=False)
    baseline = (low, *torch.autograd.grad(low, low_leaves, grad_out))
    for what, a, r, e in zip(("out", "dq", "dk", "dv", "dbias"), got, want, baseline):
        assert a.isfinite().all(), what
        assert_close_to_reference(what, a, r, e, dtype)


def test_prepared_runs_refuse_another_call_form_and_a_written_mask(monkeypatch, device):
    monkeypatch.setattr(tuning, "BOOL_MASK_RUNS", True)
    dims = Dims(batch=1, seqlen_q=64, seqlen_k=64, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    mask = _sliding(64, 64, 9).to(device)
    prepared = prepare_mask(mask, q, k, is_causal=True)
    assert prepared.intervals is not None
    with pytest.raises(ValueError, match="prepared for is_causal True"):
        dmattn_func(q, k, v, attn_mask=prepared, is_causal=False)
    longer = random_qkv(Dims(1, 80, 80, 2, 1, 16), torch.float16, device)
    with pytest.raises(ValueError, match="prepared for shapes"):
        dmattn_func(*longer, attn_mask=prepared, is_causal=True)
    mask[0, 0, 5, 5] = False
    with pytest.raises(ValueError, match="written in place"):
        dmattn_func(q, k, v, attn_mask=prepared, is_causal=True)


def test_masks_that_stay_bool(monkeypatch, device):
    """With the option off every mask stays bool; with it on: a mask whose keys are not runs,
    one broadcast along the keys, and decode-sized calls (the gather route's prepared bool
    mask) stay bool masks; masks of runs at an odd key length do not."""
    dims = Dims(batch=1, seqlen_q=64, seqlen_k=64, heads_q=2, heads_kv=1, head_dim=16)
    q, k, _ = random_qkv(dims, torch.float16, device)
    sliding = _sliding(64, 64, 9).to(device)
    monkeypatch.setattr(tuning, "BOOL_MASK_RUNS", False)
    assert prepare_mask(sliding, q, k, is_causal=True).intervals is None
    monkeypatch.setattr(tuning, "BOOL_MASK_RUNS", True)
    assert prepare_mask(sliding, q, k, is_causal=True).intervals is not None
    scattered = torch.rand(1, 1, 64, 64, device=device) < 0.5
    assert prepare_mask(scattered, q, k).intervals is None
    keys = torch.ones(1, 1, 64, 1, dtype=torch.bool, device=device)
    assert prepare_mask(keys, q, k).intervals is None
    decode = random_qkv(Dims(1, 1, 64, 2, 1, 16), torch.float16, device)[0]
    assert prepare_mask(sliding[:, :, -1:], decode, k, is_causal=True).intervals is None
    # An odd Lk over two key heads: the intervals' words sit in rows of an even number of
    # keys, so TMA reads them as it reads the bool mask's padded rows; both become intervals.
    odd = Dims(batch=1, seqlen_q=64, seqlen_k=63, heads_q=4, heads_kv=2, head_dim=16)
    q, k, _ = random_qkv(odd, torch.float16, device)
    window = _sliding(64, 63, 9).expand(1, 2, 64, 63).to(device)
    padded = torch.zeros(1, 2, 64, 64, dtype=torch.bool, device=device)[..., :63]
    padded.copy_(window)
    assert prepare_mask(padded, q, k, is_causal=True).intervals is not None
    assert prepare_mask(window.contiguous(), q, k, is_causal=True).intervals is not None


def test_the_runs_keep_a_counted_preparation(monkeypatch, device):
    """``prepare_mask`` of a mask of runs prepares its intervals for the call too, with their
    partial tiles counted, so the first call walks prepared lists and the Hopper forward's
    default weighs those tiles as it does the bool mask's."""
    monkeypatch.setattr(tuning, "BOOL_MASK_RUNS", True)
    dims = Dims(batch=1, seqlen_q=64, seqlen_k=64, heads_q=2, heads_kv=1, head_dim=16)
    q, k, _ = random_qkv(dims, torch.float16, device)
    prepared = prepare_mask(_sliding(64, 64, 9).to(device), q, k, is_causal=True)
    kept = [p for p in prepared.intervals._preparations.values() if p is not None]
    assert len(kept) == 1 and kept[0].activity is not None
    assert kept[0].mask is prepared.intervals
    assert prepared_intervals(prepared.intervals, q, k, True) is kept[0]


def test_a_captured_call_walks_the_preparation_made_before_the_capture(monkeypatch, device):
    """During a CUDA graph capture the prepared runs' preparation (counted, made by
    ``prepare_mask`` before it) serves the call, whose backward then sees the counted tiles
    (``hopper_backward.captured_split``); a caller's own intervals are read by the captured
    call itself. The captured call matches the reference."""
    import kernels.prepared as prepared_module
    from kernels.planning import backward

    monkeypatch.setattr(tuning, "BOOL_MASK_RUNS", True)
    dims = Dims(batch=1, seqlen_q=64, seqlen_k=64, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    mask = _sliding(64, 64, 9).to(device)
    prepared = prepare_mask(mask, q, k, is_causal=True)
    (kept,) = [p for p in prepared.intervals._preparations.values() if p is not None]
    monkeypatch.setattr(prepared_module, "graph_capturing", lambda device: True)
    monkeypatch.setattr(backward, "graph_capturing", lambda device: True)
    assert prepared_intervals(prepared.intervals, q, k, True) is kept
    # A caller's intervals, prepared by their second eager call, are read by a captured call
    # itself (its replays follow writes into start and end); none are noted inside a capture.
    own = KeyIntervals(prepared.intervals.start.clone(), prepared.intervals.end.clone())
    monkeypatch.setattr(prepared_module, "graph_capturing", lambda device: False)
    for _ in range(2):
        prepared_intervals(own, q, k, True)
    assert list(own._preparations.values())[0] is not None
    fresh = KeyIntervals(own.start, own.end)
    monkeypatch.setattr(prepared_module, "graph_capturing", lambda device: True)
    assert prepared_intervals(own, q, k, True) is None
    assert prepared_intervals(fresh, q, k, True) is None
    assert not fresh._preparations
    run_backward(q, k, v, prepared, causal=True)  # out and gradients against the reference


def test_a_compiled_call_reads_the_runs_as_the_eager_call(monkeypatch, device):
    """torch.compile(fullgraph=True) of a call with a prepared top-W mask read as key-ordered
    intervals: one graph, the eager call's outputs and gradients bit for bit."""
    monkeypatch.setattr(tuning, "BOOL_MASK_RUNS", True)
    monkeypatch.setattr(tuning, "BOOL_MASK_RUNS_ORDER_LEAST_SAVED_PAIRS", 0)  # small shapes
    dims = Dims(batch=1, seqlen_q=300, seqlen_k=300, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    bias = random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), torch.float16, device)
    scores = torch.randn(1, 2, 1, 300)  # float32: no ties, whose top-W picks may differ
    prepared = prepare_mask(_top_window(scores, 24, 300, True).to(device), q, k,
                            is_causal=True)
    assert prepared.intervals.key_order is not None
    grad_out = torch.randn_like(q)

    def attend(q, k, v, bias):
        return dmattn_func(q, k, v, attn_mask=prepared, attn_bias=bias, is_causal=True)

    torch._dynamo.reset()
    try:
        compiled = _call_with(torch.compile(attend, backend="aot_eager", fullgraph=True),
                              q, k, v, bias, grad_out)
    finally:
        torch._dynamo.reset()
    for what, a, b in zip(("out", "dq", "dk", "dv", "dbias"), compiled,
                          _call_with(attend, q, k, v, bias, grad_out)):
        assert torch.equal(a, b), f"{what} differs between compiled and eager calls"


def _call_with(fn, q, k, v, bias, grad_out):
    leaves = [t.detach().requires_grad_() for t in (q, k, v, bias)]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, grad_out))


@pytest.mark.parametrize("name", ["sliding", "top-W", "top-W cross", "all"])
def test_the_runs_know_the_most_keys_a_row_keeps(name, monkeypatch, device):
    """The runs' row bound (``KeyIntervals._row_kept``, which the Hopper forward's route
    reads) is the most keys any row of the mask keeps, causality included, and the reordered
    intervals of a call keep it."""
    from kernels.masks.key_order import reordered_intervals

    monkeypatch.setattr(tuning, "BOOL_MASK_RUNS", True)
    mask = MASKS[name]()
    seqlen_q, seqlen_k = mask.shape[2], mask.shape[3]
    dims = Dims(batch=mask.shape[0], seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                heads_q=mask.shape[1], heads_kv=mask.shape[1], head_dim=16)
    q, k, _ = random_qkv(dims, torch.float32, device)
    runs = prepare_mask(mask.to(device), q, k, is_causal=True).intervals
    assert runs is not None
    assert runs._row_kept == int(_effective(mask, seqlen_q, seqlen_k, True).sum(-1).max())
    if runs.key_order is not None:
        assert reordered_intervals(runs, seqlen_q, True)._row_kept == runs._row_kept


@pytest.mark.parametrize("seed", range(4))
def test_runs_and_gaps_at_chunk_edges(seed, monkeypatch):
    """Random runs (some crossing an edge of the scan's chunks, some one row long, some keys
    empty) are found exactly; a key given a second run anywhere, in its first run's chunk or a
    later one, refuses the mask."""
    monkeypatch.setattr("kernels.masks.key_runs.ROWS", 16)
    gen = torch.Generator().manual_seed(seed)
    seqlen_q, seqlen_k = 70, 40
    start = torch.randint(0, seqlen_q, (2, 3, seqlen_k), generator=gen)
    end = torch.minimum(start + torch.randint(0, 20, start.shape, generator=gen),
                        torch.tensor(seqlen_q))
    start[0, 0, 5], end[0, 0, 5] = 10, 22    # crosses the edge at row 16
    start[0, 0, 6], end[0, 0, 6] = 31, 33    # ends at the edge at row 32
    start[0, 0, 7], end[0, 0, 7] = 64, 65    # one row
    mask = _from_runs(start, end, seqlen_q)
    found = key_runs(mask, seqlen_q, seqlen_k, False)
    assert found is not None
    assert torch.equal(_from_runs(*found, seqlen_q), mask)
    for gap in (2, 27, 30):  # a second run in its chunk, at a chunk's first row, later
        torn = mask.clone()
        key = int(torch.randint(0, seqlen_k, (), generator=gen))
        torn[1, 2, :, key] = False
        torn[1, 2, 3:5, key] = True
        torn[1, 2, 5 + gap:7 + gap, key] = True
        assert key_runs(torn, seqlen_q, seqlen_k, False) is None
