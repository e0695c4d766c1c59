"""What a call at a new sequence length compiles (kernels.runtime.launch.compile_form): after
``kernels.warmup`` at one length, calls of the same form at other lengths of its range compile
no kernel. The interpreter compiles nothing, but every launch records the form it would be
compiled for, the count ``dmbench compile-cost`` reports on a GPU as well."""

from __future__ import annotations

import importlib
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from attn_helpers import assert_close_to_reference, backward_schedules, grads_of
from kernels import (KeyIntervals, attention_reference, compiled_forms, dmattn_func,
                     schedule_for, warmup)
from kernels.runtime import forms as _forms
from kernels.runtime import launch as _launch
from kernels import topk_intervals
from kernels.planning.inputs import AttnShape
from kernels.planning import tuning
from kernels.planning.backward_schedule import (BackwardRoute, dkdv_takes_wide_tile,
                                                 schedule_backward)
from kernels.planning.forward_schedule import forward_tile, interval_tile_rows
from kernels.planning.problem import OperandLayout, Problem
from kernels.masks.topk import orders_keys
from kernels.warmup import ordering_threshold, window_lengths
from kernels.warmup_forms import form_call, form_calls, form_inputs

HEADS_Q, HEADS_KV, HEAD_DIM = 4, 2, 16


def _call(seqlen: int, mask: str, bias: str, generator: torch.Generator, device) -> None:
    def tensor(*shape):
        return torch.randn(*shape, generator=generator).to(device).requires_grad_()

    q = tensor(1, seqlen, HEADS_Q, HEAD_DIM)
    k, v = tensor(1, seqlen, HEADS_KV, HEAD_DIM), tensor(1, seqlen, HEADS_KV, HEAD_DIM)
    attn_bias = tensor(1, HEADS_KV, 1, seqlen) if bias == "kv_row" else None
    attn_mask = None
    if mask == "bool":
        attn_mask = (torch.rand(1, HEADS_KV, seqlen, seqlen, generator=generator) < 0.5).to(device)
    elif mask == "intervals":
        start = torch.randint(0, seqlen, (1, HEADS_KV, seqlen), generator=generator,
                              dtype=torch.int32)
        attn_mask = KeyIntervals(start.to(device), start.to(device) + seqlen // 2)
    out = dmattn_func(q, k, v, attn_mask=attn_mask, attn_bias=attn_bias, is_causal=True)
    out.backward(torch.ones_like(out))


@pytest.mark.parametrize("mask,bias", [("bool", "kv_row"), ("intervals", "kv_row"),
                                       ("none", "kv_row"), ("bool", "none")])
def test_no_compile_at_new_lengths_after_warmup(device, mask, bias):
    # The shortest and longest length: every schedule decision that follows the length (key
    # splits of a short grid, dkdv's stages) changes at one threshold, so the lengths between
    # take forms the two ends compiled.
    report = warmup(seqlens=[97, 150], heads_q=HEADS_Q, heads_kv=HEADS_KV, head_dim=HEAD_DIM,
                    dtype=torch.float32, device=device, mask=mask, bias=bias, is_causal=True)
    assert report.seqlens == (96, 97, 144, 150)
    generator = torch.Generator().manual_seed(0)
    before = compiled_forms()
    for seqlen in (113, 128, 131, 140):
        _call(seqlen, mask, bias, generator, device)
        assert compiled_forms() == before, f"a call at length {seqlen} compiled a new kernel"


def test_no_compile_at_new_lengths_after_a_documents_warmup(device):
    """Packed documents (``dmattn_varlen_func``, two calls per new offsets, as a model's
    layers make them, then a backward): after the warm-up at the shortest and longest packed
    length, new lengths between compile nothing. (The kv_row bias: compile-cost's test.)"""
    bias = "none"
    warmup(seqlens=[97, 150], heads_q=HEADS_Q, heads_kv=HEADS_KV, head_dim=HEAD_DIM,
           dtype=torch.float32, device=device, mask="documents", bias=bias, is_causal=True)
    before = compiled_forms()
    for seqlen in (113, 128, 131, 140):
        q, k, v, mask, attn_bias = form_inputs(1, seqlen, HEADS_Q, HEADS_KV, HEAD_DIM,
                                               torch.float32, device, "documents", bias,
                                               backward=True, scattered=False, is_causal=True)
        for _ in range(form_calls("documents")):
            out = form_call(q, k, v, mask, attn_bias, True)
            out.backward(torch.ones_like(out))
        assert compiled_forms() == before, f"a packed call of {seqlen} tokens compiled"


def test_warmup_refuses_documents_with_a_full_bias_or_decode_rows():
    with pytest.raises(ValueError, match="documents"):
        warmup(seqlens=[64], heads_q=2, head_dim=32, mask="documents", bias="full")
    with pytest.raises(ValueError, match="documents"):
        warmup(seqlens=[64], heads_q=2, head_dim=32, mask="documents", query_rows=1)


@pytest.mark.parametrize("mask,bias", [("bool", "kv_row"), ("intervals", "full"),
                                       ("none", "none")])
def test_compile_only_calls_reach_every_form_a_real_call_compiles(device, mask, bias,
                                                                  monkeypatch):
    """The parallel warm-up's first pass launches nothing and only starts compiles: it must
    reach every form the real call then compiles. Each pass records into an empty set."""
    started, compiled = set(), set()
    monkeypatch.setattr(_forms, "_compiled_forms", started)
    with ThreadPoolExecutor(2) as pool, _launch.compile_only(pool):
        _call(203, mask, bias, torch.Generator().manual_seed(1), device)
    monkeypatch.setattr(_forms, "_compiled_forms", compiled)
    _call(203, mask, bias, torch.Generator().manual_seed(2), device)
    assert started, "the compile-only call started no compile"
    if device.type == "cuda":  # a form compiled before (another test) is not recorded again
        assert compiled <= started
    else:  # the interpreter records every launch's form
        assert compiled == started


def test_compile_only_runs_no_launch_from_any_thread(device, monkeypatch):
    """Compile-only holds for every thread: autograd makes a GPU backward's launches on its own
    thread, and a launch that ran there would read the skipped forward's unwritten outputs.
    Here a call and its backward come from another thread; no kernel may run."""
    ran = []
    if device.type == "cuda":
        monkeypatch.setattr(_launch, "_run_compiled", lambda *args: ran.append(args))
    else:  # the interpreter's launches: kernel[grid](...)
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.__getitem__
        monkeypatch.setattr(InterpretedFunction, "__getitem__",
                            lambda self, grid: ran.append(grid) or original(self, grid))
    monkeypatch.setattr(_forms, "_compiled_forms", set())
    errors = []

    def call():
        try:
            _call(77, "bool", "kv_row", torch.Generator().manual_seed(3), device)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    with ThreadPoolExecutor(2) as pool, _launch.compile_only(pool):
        worker = threading.Thread(target=call)
        worker.start()
        worker.join()
    assert not errors, errors
    assert _forms.compiled_forms() > 0, "the call started no compile"
    assert not ran, f"{len(ran)} launches ran under compile_only"


def test_warmup_reports_its_passes(device):
    report = warmup(seqlens=[57], heads_q=2, head_dim=16, dtype=torch.float32, device=device,
                    mask="bool", bias="kv_row", is_causal=True)
    if device.type == "cuda":  # every form compiled by the parallel pass
        assert report.workers > 1 and report.compiled_serially == 0
    else:  # the interpreter compiles nothing ahead: one pass, every form in it
        assert report.workers == 1 and report.compiled_serially == report.compiled


def test_warmup_counts_what_it_compiles(device):
    first = warmup(seqlens=[40], heads_q=2, head_dim=32, dtype=torch.float32, device=device,
                   bias="full")
    again = warmup(seqlens=[40], heads_q=2, head_dim=32, dtype=torch.float32, device=device,
                   bias="full")
    assert first.seqlens == (32, 40) and again.compiled == 0


def _forms_of(monkeypatch, run) -> set:
    """The forms ``run``'s launches record, into a set of their own (the interpreter records
    every launch's form)."""
    forms = set()
    monkeypatch.setattr(_forms, "_compiled_forms", forms)
    run()
    return forms


def test_warmup_with_a_window_compiles_the_ordered_form(device, monkeypatch):
    """A top-window model with an order per query head (Hm = Hq > Hk) calls with K and V
    widened to Hq heads and is_causal False: forms a plain interval warm-up does not run.
    The windowed warm-up runs them, so a call at another length of the range compiles
    nothing; the same intervals without their order need other forms."""
    # The shape rules alone decide the order here, as under the interpreter: on a GPU the
    # estimated saving of these small calls is below ORDER_MIN_SAVED_TILES.
    monkeypatch.setattr(importlib.import_module("kernels.masks.topk"),
                        "ORDER_MIN_SAVED_TILES", 0)
    heads_q, heads_kv, window, seqlen = 2, 1, 64, 280  # ordered from 256 rows on
    generator = torch.Generator().manual_seed(5)

    def call(ordered: bool):
        def tensor(*shape):
            return torch.randn(*shape, generator=generator).to(device).requires_grad_()

        q = tensor(1, seqlen, heads_q, HEAD_DIM)
        k, v = tensor(1, seqlen, heads_kv, HEAD_DIM), tensor(1, seqlen, heads_kv, HEAD_DIM)
        selection = torch.randn(1, heads_q, 1, seqlen, generator=generator).to(device)
        mask = topk_intervals(selection, window, seqlen_q=seqlen, is_causal=True)
        assert mask.key_order is not None
        if not ordered:
            mask = KeyIntervals(mask.start, mask.end)
        out = dmattn_func(q, k, v, attn_mask=mask, attn_bias=tensor(1, heads_kv, 1, seqlen),
                          is_causal=True)
        out.backward(torch.ones_like(out))

    warmed = _forms_of(monkeypatch, lambda: warmup(
        seqlens=[260], heads_q=heads_q, heads_kv=heads_kv, head_dim=HEAD_DIM,
        dtype=torch.float32, device=device, mask="intervals", bias="kv_row", is_causal=True,
        window=window, selection_heads=heads_q))
    ordered = _forms_of(monkeypatch, lambda: call(ordered=True))
    assert ordered <= warmed, f"{len(ordered - warmed)} forms of the ordered call not warmed"
    plain = _forms_of(monkeypatch, lambda: call(ordered=False))
    assert ordered - plain, "the ordered call needs no form of its own"


@pytest.mark.parametrize("window,causal", [(64, True), (1000, True), (2047, True), (3, False),
                                           (2047, False)])
def test_window_lengths_reach_both_ends_of_each_form(window, causal):
    threshold = ordering_threshold(window, causal)
    assert orders_keys(threshold, threshold, window, causal)
    assert not orders_keys(threshold - 1, threshold - 1, window, causal)
    assert window_lengths((100, 101), window, causal) == (100, 101)  # one side: as given
    for given in ((threshold - 300, threshold + 5000), (threshold - 3, threshold + 3)):
        lengths = window_lengths(given, window, causal)
        assert set(given) <= set(lengths)
        for ordered in (False, True):
            side = [n for n in lengths if orders_keys(n, n, window, causal) == ordered]
            nearest = max(side) if not ordered else min(side)
            assert abs(nearest - threshold) < 17
            near = [n for n in side if abs(n - threshold) < 17]
            assert {n % 16 == 0 for n in near} == {True, False}, (ordered, lengths)


def test_a_graphs_warmup_runs_each_backward_as_a_capture_schedules_it(device, monkeypatch,
                                                                     no_kept_plans):
    """``warmup(graphs=True)`` also runs each call's backward scheduled as captured
    (``Problem.captured``), whose plan a later capture finds made; without it, none is."""
    scheduled = backward_schedules(monkeypatch)
    common = dict(seqlens=[48], heads_q=2, head_dim=16, dtype=torch.float16, device=device,
                  mask="bool", bias="kv_row", is_causal=True, workers=1)
    warmup(**common)
    assert True not in scheduled
    warmup(**common, graphs=True)
    assert True in scheduled


def test_a_backward_on_another_thread_is_scheduled_as_captured(device, monkeypatch,
                                                               no_kept_plans):
    """Autograd runs a CUDA backward on a thread of its own: a backward that runs on another
    thread while ``scheduled_as_captured`` is open is scheduled as captured, and one after it
    closes is not."""
    from kernels.planning.backward import scheduled_as_captured

    scheduled = backward_schedules(monkeypatch)
    q, k, v = (torch.randn(1, 48, heads, 16, device=device).requires_grad_() for heads in (2, 1, 1))

    def backward_on_a_thread():
        out = dmattn_func(q, k, v, is_causal=True)
        worker = threading.Thread(target=out.sum().backward)
        worker.start()
        worker.join()

    with scheduled_as_captured():
        backward_on_a_thread()
    assert scheduled == [True]
    backward_on_a_thread()
    assert scheduled == [True]  # the eager plan is the forward's own: nothing scheduled


def test_a_capture_after_a_graphs_warmup_compiles_nothing(device, no_kept_plans):
    """On a GPU: after ``warmup(graphs=True)``, a training step of the warmed form captured into
    a CUDA graph (bias.yaml's dense causal B1 H8/2 L2048 D128 on a Hopper GPU: its captured
    backward splits, unlike the eager one) compiles no kernel, and its replay matches the
    eager step."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    warmup(seqlens=[2048], heads_q=8, heads_kv=2, head_dim=128, device=device, is_causal=True,
           graphs=True)
    q, k, v = (torch.randn(1, 2048, heads, 128, device=device, dtype=torch.bfloat16)
               for heads in (8, 2, 2))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    grad_out = torch.randn_like(q)

    def step():
        # The output is returned detached: a step's autograd graph kept alive keeps its leaves'
        # AccumulateGrad nodes on the stream it ran on (the default stream for the eager
        # step), and the capture's backward then waits on that stream, which a capture
        # refuses (cudaErrorStreamCaptureImplicit on the H200).
        out = dmattn_func(*leaves, is_causal=True)
        return (out.detach(), *torch.autograd.grad(out, leaves, grad_out))

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    before = compiled_forms()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    assert compiled_forms() == before, "the capture compiled a kernel"
    graph.replay()
    torch.cuda.synchronize()
    truth = grads_of(attention_reference, *(t.float() for t in (q, k, v)), None, None, True,
                     None, grad_out.double())
    low = grads_of(attention_reference, q, k, v, None, None, True, None, grad_out,
                   upcast=False)
    for (name, want), (_, baseline), got in zip(truth.named(), low.named(), captured[1:]):
        assert torch.isfinite(got).all(), name
        assert_close_to_reference(name, got, want, baseline, torch.bfloat16)
    assert torch.equal(captured[0], eager[0])  # the forward is the same launch


def test_warmup_names_bad_arguments():
    with pytest.raises(ValueError, match="mask must be one of"):
        warmup(seqlens=[64], heads_q=2, head_dim=32, mask="dense")
    with pytest.raises(ValueError, match="bias must be one of"):
        warmup(seqlens=[64], heads_q=2, head_dim=32, bias="row")
    with pytest.raises(ValueError, match="seqlens is empty"):
        warmup(seqlens=[], heads_q=2, head_dim=32)
    with pytest.raises(ValueError, match="seqlens must be positive"):
        warmup(seqlens=[0], heads_q=2, head_dim=32)
    with pytest.raises(ValueError, match="workers must be a positive int"):
        warmup(seqlens=[64], heads_q=2, head_dim=32, workers=0)
    with pytest.raises(ValueError, match="graphs must be a bool"):
        warmup(seqlens=[64], heads_q=2, head_dim=32, graphs="yes")
    with pytest.raises(ValueError, match="graphs warms the backward"):
        warmup(seqlens=[64], heads_q=2, head_dim=32, graphs=True, backward=False)
    for window in (0, -3, 2.0, True, "64"):
        with pytest.raises(ValueError, match="window must be a positive int"):
            warmup(seqlens=[64], heads_q=2, head_dim=32, mask="intervals", window=window)
    with pytest.raises(ValueError, match="window needs mask='intervals'"):
        warmup(seqlens=[64], heads_q=2, head_dim=32, mask="bool", window=16)
    with pytest.raises(ValueError, match="selection_heads needs a window"):
        warmup(seqlens=[64], heads_q=2, head_dim=32, mask="intervals", selection_heads=2)
    with pytest.raises(ValueError, match="selection_heads must be one of"):
        warmup(seqlens=[64], heads_q=4, heads_kv=2, head_dim=32, mask="intervals", window=16,
               selection_heads=3)


@pytest.mark.parametrize("window,rows", [(2048, 4), (32, 1), (1024, 64)])
def test_ordering_threshold_follows_the_gpus_rule(monkeypatch, window, rows):
    """With the GPU's saving rule the threshold is the first ordered length for the rows."""
    selection = importlib.import_module("kernels.masks.topk")
    monkeypatch.setattr(selection, "is_interpreted", lambda kernel: False)
    threshold = ordering_threshold(window, True, rows)
    assert orders_keys(threshold, threshold, window, True, rows)
    assert not orders_keys(threshold - 1, threshold - 1, window, True, rows)


@pytest.mark.parametrize("batch,heads_kv", [(1, 4), (2, 8), (1, 1)])
def test_wide_tile_threshold_is_where_dkdv_changes_tiles(monkeypatch, batch, heads_kv):
    """On an H100-sized GPU (132 multiprocessors) the threshold is the first length whose
    backward takes dkdv's wide tile; warm-up lengths on both sides of it gain its two ends, as
    calls there compile forms of their own (the wide tile with head shares, at 2048 and 2049
    on B1 H16/4 between warm-ups at 1000 and 8000, before those lengths were added)."""
    warmup_module = importlib.import_module("kernels.warmup")
    monkeypatch.setattr(warmup_module, "interpreted", lambda: False)
    monkeypatch.setattr(warmup_module, "multiprocessors", lambda device, interpreted: 132)

    def wide(seqlen):
        shape = AttnShape(batch=batch, heads_q=4 * heads_kv, heads_kv=heads_kv,
                          seqlen_q=seqlen, seqlen_k=seqlen, head_dim=128)
        return dkdv_takes_wide_tile(Problem(
            shape, torch.bfloat16, torch.device("cuda"), False, 132, is_causal=False,
            softmax_scale=1.0))

    threshold = warmup_module.wide_tile_threshold(batch, 4 * heads_kv, heads_kv, 128,
                                                  torch.bfloat16, "cuda", 1 << 20)
    assert wide(threshold) and not wide(threshold - 1)
    lengths = warmup_module.threshold_lengths((16, 1 << 20), threshold)
    near = sorted(n for n in lengths if abs(n - threshold) < 17)
    assert {wide(n) for n in near} == {True, False}
    assert {n % 16 == 0 for n in near if wide(n)} == {True, False}
    assert {n % 16 == 0 for n in near if not wide(n)} == {True, False}
    assert warmup_module.wide_tile_threshold(batch, 4 * heads_kv, heads_kv, 128, torch.float32,
                                             "cuda", 1 << 20) is None


@pytest.mark.parametrize("head_dim, is_causal", [(128, False), (128, True), (64, False)])
def test_warmup_lengths_straddle_the_hopper_backwards_thresholds(monkeypatch, head_dim,
                                                                 is_causal):
    """On a Hopper GPU the default backward turns to the Hopper route at one length
    (``hopper_backward.takes_hopper_backward``), its programs a query head each first where the
    grid is short (``backward_schedule.split_heads``) and whole GQA groups from another length;
    a warm-up across them calls on both sides of each."""
    warmup_module = importlib.import_module("kernels.warmup")
    monkeypatch.setattr(warmup_module, "interpreted", lambda: False)
    monkeypatch.setattr(warmup_module, "multiprocessors", lambda device, interpreted: 132)
    monkeypatch.setattr(warmup_module, "capability", lambda device, interpreted: (9, 0))

    def route(seqlen):
        backward = schedule_backward(warmup_module.square_problem(
            seqlen, 2, 16, 4, head_dim, torch.bfloat16, "cuda", is_causal, (9, 0)), {})
        hopper = backward.route is BackwardRoute.HOPPER
        return hopper, hopper and not backward.split_heads

    lengths = warmup_module.call_lengths((256, 1 << 16), batch=2, heads_q=16, heads_kv=4,
                                         head_dim=head_dim, dtype=torch.bfloat16,
                                         device="cuda", mask="none", backward=True,
                                         window=None, selection_heads=None,
                                         is_causal=is_causal)
    for whole_groups in (False, True):
        threshold = warmup_module.hopper_backward_threshold(
            2, 16, 4, head_dim, torch.bfloat16, "cuda", is_causal, 1 << 16, whole_groups)
        assert threshold is not None
        assert route(threshold)[whole_groups] and not route(threshold - 1)[whole_groups]
        near = sorted(n for n in lengths if abs(n - threshold) < 17)
        assert {route(n)[whole_groups] for n in near} == {True, False}
    monkeypatch.setattr(warmup_module, "capability", lambda device, interpreted: (8, 0))
    assert warmup_module.hopper_backward_threshold(2, 16, 4, head_dim, torch.bfloat16, "cuda",
                                                   is_causal, 1 << 16) is None


def test_warmup_lengths_straddle_the_ordered_hopper_backward_threshold(monkeypatch):
    """Under key-ordered top-W intervals the default backward turns to the Hopper route at the
    length whose kept pairs reach ``tuning.HOPPER_BACKWARD_MIN_ORDERED_PAIRS``; a warm-up with
    that ``window`` from below it to above it calls on both sides."""
    warmup_module = importlib.import_module("kernels.warmup")
    monkeypatch.setattr(warmup_module, "interpreted", lambda: False)
    monkeypatch.setattr(warmup_module, "multiprocessors", lambda device, interpreted: 132)
    monkeypatch.setattr(warmup_module, "capability", lambda device, interpreted: (9, 0))
    batch, heads_q, heads_kv, window = 1, 8, 2, 256
    threshold = warmup_module.ordered_backward_threshold(batch, heads_q, heads_kv, 128,
                                                         torch.bfloat16, "cuda", window, 1 << 16)
    # B x Hq x L x W kept pairs reach the bound at this L (the other rules hold from far below)
    assert threshold == -(-tuning.HOPPER_BACKWARD_MIN_ORDERED_PAIRS // (batch * heads_q * window))
    lengths = warmup_module.call_lengths((1024, 1 << 16), batch=batch, heads_q=heads_q,
                                         heads_kv=heads_kv, head_dim=128, dtype=torch.bfloat16,
                                         device="cuda", mask="intervals", backward=True,
                                         window=window, selection_heads=None, is_causal=True)
    near = sorted(n for n in lengths if abs(n - threshold) < 17)
    assert min(near) < threshold <= max(near) and len(near) >= 4, near
    monkeypatch.setattr(warmup_module, "capability", lambda device, interpreted: (8, 0))
    assert warmup_module.ordered_backward_threshold(batch, heads_q, heads_kv, 128,
                                                    torch.bfloat16, "cuda", window,
                                                    1 << 16) is None


@pytest.mark.parametrize("bias", [False, True])
def test_warmup_lengths_straddle_the_interval_tile(monkeypatch, bias):
    """On the GPU the forward of KeyIntervals at head dim 128 changes tiles at
    ``interval_tile_rows`` query rows (without a bias); a warm-up from below it to above it
    calls at an aligned and an unaligned length on each side, so that calls between compile
    nothing new."""
    warmup_module = importlib.import_module("kernels.warmup")
    monkeypatch.setattr(warmup_module, "interpreted", lambda: False)
    monkeypatch.setattr(warmup_module, "multiprocessors", lambda device, interpreted: 132)
    rows = interval_tile_rows(torch.bfloat16, 128, interpreted=False)

    def interval_tile(seqlen):
        shape = AttnShape(batch=1, heads_q=4, heads_kv=4, seqlen_q=seqlen, seqlen_k=seqlen,
                          head_dim=128)
        layout = OperandLayout((1, 4, seqlen, seqlen), 1)
        problem = Problem(shape, torch.bfloat16, torch.device("cuda"), False, 132,
                          is_causal=True, softmax_scale=1.0, mask=layout,
                          bias=layout if bias else None, intervals=True)
        return forward_tile(problem) == tuning.FORWARD_D128_INTERVALS

    assert interval_tile(rows) != bias and not interval_tile(rows - 1)
    lengths = warmup_module.call_lengths(
        (20, 1000), batch=1, heads_q=4, heads_kv=4, head_dim=128, dtype=torch.bfloat16,
        device="cuda", mask="intervals", backward=False, window=None, selection_heads=None,
        is_causal=True)
    for side in (lambda n: n < rows, lambda n: n >= rows):
        near = [n for n in lengths if side(n) and abs(n - rows) < 17]
        assert {n % 16 == 0 for n in near} == {True, False}, lengths
    for mask, dtype, head_dim in (("bool", torch.bfloat16, 128), ("intervals", torch.float32, 128),
                                  ("intervals", torch.bfloat16, 64)):
        assert warmup_module.call_lengths(
            (20, 1000), batch=1, heads_q=4, heads_kv=4, head_dim=head_dim, dtype=dtype,
            device="cuda", mask=mask, backward=False, window=None, selection_heads=None,
            is_causal=True) == (16, 20, 992, 1000)


def test_the_decode_selection_compiles_nothing_at_new_cache_lengths(device, monkeypatch):
    """The one-window selection (a decode step's top W) cuts each row into as many slices as
    its length needs, a number the grid carries: after caches of an aligned and an unaligned
    length, longer and shorter caches of the same alignments compile nothing, across slice
    counts (steps of 16 keys here, so 2 to 13 slices)."""
    monkeypatch.setattr(importlib.import_module("kernels.masks.topk"), "TOP_WINDOW_BLOCK", 16)
    generator = torch.Generator().manual_seed(3)

    def select(seqlen: int) -> None:
        bias = torch.randn(2, HEADS_KV, 1, seqlen, generator=generator).to(device)
        topk_intervals(bias, 9, seqlen_q=1, is_causal=True)

    for seqlen in (48, 49):
        select(seqlen)
    before = compiled_forms()
    for seqlen in (32, 33, 112, 113, 208, 209):
        select(seqlen)
        assert compiled_forms() == before, f"a cache of {seqlen} keys compiled a new kernel"


@pytest.mark.parametrize("query_rows", [1, 4])
def test_a_decode_warmup_leaves_nothing_to_compile_as_the_cache_grows(device, monkeypatch,
                                                                    query_rows):
    """``warmup(query_rows=...)`` runs decode steps (the top-W selection of a kv_row bias,
    then the call, no backward) at the shortest and longest cache, and at the cache length
    where the steps start to take the gather route: steps at caches between, on both sides
    of that length, compile nothing."""
    from kernels.warmup import gather_threshold

    window = 16
    threshold = gather_threshold(window, query_rows, True)
    assert threshold == 8 * (window + query_rows - 1)
    monkeypatch.setattr(importlib.import_module("kernels.masks.topk"), "TOP_WINDOW_BLOCK", 16)
    report = warmup(seqlens=[64, 400], heads_q=HEADS_Q, heads_kv=HEADS_KV, head_dim=HEAD_DIM,
                    dtype=torch.float32, device=device, mask="intervals", bias="kv_row",
                    is_causal=True, window=window, query_rows=query_rows)
    assert {threshold - 1, threshold} <= set(report.seqlens)
    generator = torch.Generator().manual_seed(7)
    before = compiled_forms()
    routes = set()
    for seqlen in (80, 81, threshold - 16, threshold + 16, threshold + 17, 333):
        q = torch.randn(1, query_rows, HEADS_Q, HEAD_DIM, generator=generator).to(device)
        k, v = (torch.randn(1, seqlen, HEADS_KV, HEAD_DIM, generator=generator).to(device)
                for _ in range(2))
        bias = torch.randn(1, HEADS_KV, 1, seqlen, generator=generator).to(device)
        chosen = topk_intervals(bias, window, seqlen_q=query_rows, is_causal=True)
        dmattn_func(q, k, v, chosen, bias, is_causal=True)
        assert compiled_forms() == before, f"a decode step at a cache of {seqlen} compiled"
        # (schedule_for reads the intervals with a pass of its own, a form a step never runs)
        routes.add(schedule_for(q, k, v, chosen, bias, is_causal=True,
                                for_backward=False).forward.route)
        before = compiled_forms()
    assert routes == {"triton", "gather"}


def test_a_decode_warmup_covers_the_selection_of_short_caches_across_a_block(device,
                                                                            monkeypatch):
    """Caches of at most W + Lq - 1 keys take the general causal selection (the wavelet
    matrix: the first row keeps every key it sees). Its block count is 1 below one block of
    keys and more above: a warm-up whose shortest cache has one block leaves nothing to
    compile for the caches past it (the count is not specialized)."""
    wavelet = importlib.import_module("kernels.masks.wavelet")
    monkeypatch.setattr(wavelet, "BLOCK", 32)  # the smallest block: caches of 32+ keys have two
    window, rows = 40, 4
    report = warmup(seqlens=[24, 200], heads_q=HEADS_Q, heads_kv=HEADS_KV, head_dim=HEAD_DIM,
                    dtype=torch.float32, device=device, mask="intervals", bias="kv_row",
                    is_causal=True, window=window, query_rows=rows)
    assert min(report.seqlens) < 32
    generator = torch.Generator().manual_seed(11)
    before = compiled_forms()
    for seqlen in (28, 33, 40, window + rows - 1):
        bias = torch.randn(1, HEADS_KV, 1, seqlen, generator=generator).to(device)
        topk_intervals(bias, window, seqlen_q=rows, is_causal=True)
        assert compiled_forms() == before, f"a selection over a cache of {seqlen} compiled"


def test_a_decode_warmup_names_bad_arguments():
    for rows in (0, 17, True, 1.0):
        with pytest.raises(ValueError, match="query_rows must be an int in"):
            warmup(seqlens=[64], heads_q=2, head_dim=32, query_rows=rows)
    with pytest.raises(ValueError, match="decode calls, which have no backward"):
        warmup(seqlens=[64], heads_q=2, head_dim=32, query_rows=1, backward=True)
    with pytest.raises(ValueError, match="backward must be a bool or None"):
        warmup(seqlens=[64], heads_q=2, head_dim=32, backward=1)
