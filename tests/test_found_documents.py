"""KeyIntervals recognized as packed documents (``masks.found_documents``) when prepared with
``tuning.FIND_DOCUMENTS``: the recognition on the CPU; the calls, walking the documents on
the Hopper kernels, on a Hopper GPU."""

from __future__ import annotations

import random

import pytest
import torch

from attn_helpers import assert_close_to_reference
from hopper_helpers import tma_keys
from kernels import KeyIntervals, prepare_mask
from kernels.masks.found_documents import find_documents
from kernels.planning import tuning
from kernels.planning.forward import call_problem
from kernels.planning.inputs import check_inputs
from kernels.planning.schedule import schedule
from kernels.varlen import packed_intervals


def _documents(lengths, causal_form, device="cpu"):
    """(offsets of the non-empty documents, KeyIntervals (1, 1, L) of ``lengths``: key j seen
    by rows [s, e) or, in the causal form, [j, e))."""
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32).to(device)
    total = int(cu[-1])
    built = packed_intervals(cu, cu, total, causal_form)
    kept = torch.tensor([0] + [n for n in lengths if n]).cumsum(0).to(torch.int32).to(device)
    return kept, KeyIntervals(built.start, built.end)


@pytest.mark.parametrize("seed", range(20))
def test_the_documents_of_either_form_are_found_with_their_causality(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, 2, 7, 64, 100, 333]) for _ in range(rng.randint(1, 9))]
    lengths.append(rng.choice([2, 5]))  # one document of two keys at least: a form shows
    causal_form = bool(seed % 2)
    offsets, intervals = _documents(lengths, causal_form)
    total = int(offsets[-1])
    for is_causal in (False, True):
        found = find_documents(intervals, total, is_causal)
        assert found is not None
        assert torch.equal(found[0], offsets) and torch.equal(found[1], offsets)
        assert found[2] == (causal_form or is_causal)


def test_documents_of_one_key_each_take_the_calls_causality():
    offsets, intervals = _documents([1, 1, 1], causal_form=False)
    for is_causal in (False, True):
        assert find_documents(intervals, 3, is_causal)[2] == is_causal


def _changed(intervals, start=None, end=None):
    return KeyIntervals(intervals.start if start is None else start,
                        intervals.end if end is None else end)


@pytest.mark.parametrize("case", ["key-unseen", "end-past", "mixed-forms", "window",
                                  "two-batches", "two-heads", "rows-differ"])
def test_intervals_that_are_not_documents_are_not_found(case):
    offsets, intervals = _documents([5, 7, 4], causal_form=True)
    start, end = intervals.start.clone(), intervals.end.clone()
    seqlen_q = 16
    if case == "key-unseen":
        start[..., 9] = end[..., 9]
    elif case == "end-past":
        end[..., 12:] += 1
    elif case == "mixed-forms":  # the first document whole, the others causal
        start[..., :5] = 0
        start[..., 1] = 1  # and one key of it in the causal form
    elif case == "window":  # a sliding window of 3 over one sequence
        start = torch.arange(16, dtype=torch.int32).view(1, 1, 16)
        end = (start + 3).clamp(max=16)
    elif case == "two-batches":
        start, end = start.expand(2, 1, 16), end.expand(2, 1, 16)
    elif case == "two-heads":  # two rows of heads, not one broadcast
        start, end = start.repeat(1, 2, 1), end.repeat(1, 2, 1)
    elif case == "rows-differ":
        seqlen_q = 17
    assert find_documents(_changed(intervals, start, end), seqlen_q, True) is None


def test_a_broadcast_head_row_is_found():
    offsets, intervals = _documents([5, 11], causal_form=True)
    wide = _changed(intervals, intervals.start.expand(1, 4, 16), intervals.end.expand(1, 4, 16))
    assert torch.equal(find_documents(wide, 16, False)[0], offsets)


@pytest.mark.parametrize("find", [False, True])
def test_prepared_intervals_name_their_documents_only_where_asked(monkeypatch, find):
    monkeypatch.setattr(tuning, "FIND_DOCUMENTS", find)
    offsets, intervals = _documents([50, 3, 75], causal_form=True)
    q = torch.randn(1, 128, 2, 16)
    prepared = prepare_mask(intervals, q, q, is_causal=True)
    named = prepared.mask._documents
    if not find:
        assert named is None and prepared.mask is intervals
        return
    assert torch.equal(named[0], offsets) and named[2] is True
    checked = check_inputs(q, q, q, prepared.mask, None, None)
    assert call_problem(checked, q, True).documents == 3


def test_calls_with_found_documents_match_the_reference_off_hopper(monkeypatch, device):
    """Where the Hopper kernels do not run (here: the interpreter), named documents change
    nothing: the call and its gradients match the fp64 reference as unnamed intervals do."""
    from kernels import attention_reference, dmattn_func

    monkeypatch.setattr(tuning, "FIND_DOCUMENTS", True)
    torch.manual_seed(2)
    _, intervals = _documents([9, 0, 17, 6], causal_form=False, device=device)
    q, k, v = (torch.randn(1, 32, heads, 16, device=device).requires_grad_()
               for heads in (4, 2, 2))
    prepared = prepare_mask(intervals, q, k, is_causal=True)
    assert prepared.mask._documents is not None
    out = dmattn_func(q, k, v, attn_mask=prepared, is_causal=True)
    want = attention_reference(q, k, v, attn_mask=intervals, is_causal=True, upcast=True)
    low = attention_reference(q, k, v, attn_mask=intervals, is_causal=True, upcast=False)
    assert_close_to_reference("out", out, want, low, q.dtype)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = torch.autograd.grad(want, (q, k, v), grad.double())
    eager = torch.autograd.grad(low, (q, k, v), grad)
    for name, a, r, e in zip(("dq", "dk", "dv"), got, ref, eager):
        assert_close_to_reference(name, a, r, e, q.dtype)


# -- device side: a Hopper GPU
@pytest.mark.hopper
@pytest.mark.parametrize("causal_form", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_found_documents_walk_on_the_hopper_kernels(device, monkeypatch, causal_form,
                                                    with_bias):
    """``dmattn_func`` with prepared KeyIntervals that are documents: the forward walks them
    (by default) and the backward too (``backward_documents``), both against the fp64
    reference."""
    from kernels import attention_reference, dmattn_func, record_routes

    monkeypatch.setattr(tuning, "FIND_DOCUMENTS", True)
    torch.manual_seed(5)
    offsets, intervals = _documents([700, 1, 0, 129, 2048, 333], causal_form, device)
    total = int(offsets[-1])
    q, k, v = (torch.randn(1, total, heads, 128, device=device, dtype=torch.bfloat16)
               for heads in (8, 2, 2))
    padded = tma_keys(total, 2)
    bias = (torch.randn(1, 2, 1, padded, device=device).to(torch.bfloat16)[..., :total]
            if with_bias else None)
    prepared = prepare_mask(intervals, q, k, is_causal=False)
    checked = check_inputs(q, k, v, prepared.mask, bias, None)
    problem = call_problem(checked, q, False, activity=prepared.activity, key=k, value=v)
    assert problem.prepared and schedule(problem).forward.documents
    leaves = [t.detach().requires_grad_() for t in (q, k, v) + ((bias,) if with_bias else ())]
    options = {"backward_documents": True}
    with record_routes() as routes:
        out = dmattn_func(*leaves[:3], attn_mask=prepared,
                          attn_bias=leaves[3] if with_bias else None, kernel_options=options)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, leaves, grad)
    assert set(routes.forward) == {"hopper"} and routes.backward == ["hopper"]
    runs = [attention_reference(*leaves[:3], attn_mask=intervals,
                                attn_bias=leaves[3] if with_bias else None, upcast=upcast)
            for upcast in (True, False)]
    assert_close_to_reference("out", out, runs[0], runs[1], q.dtype)
    want, low = (torch.autograd.grad(run, leaves, grad.to(run.dtype)) for run in runs)
    for name, a, r, e in zip(("dq", "dk", "dv", "dbias"), got, want, low):
        assert a.isfinite().all(), f"{name} not finite"
        assert_close_to_reference(name, a, r, e, q.dtype)
