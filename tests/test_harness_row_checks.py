"""Accuracy at long lengths from a sample of query rows: the sampled reference is exact for
the sampled problem, it is what a whole-problem backward gives for the same upstream gradient,
and a backend wrong anywhere it is checked (a sampled row's output, dq off the sample, one
key's dk) fails."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import dmbench.accuracy as accuracy
from dmbench.accuracy import check_backend, checked_rows, ground_truth
from dmbench.backends import make_backends
from dmbench.backends.dmattn import ReferenceBackend
from dmbench.case import Case
from dmbench.problem import make_problem

CPU = torch.device("cpu")
SAMPLE = 8
CASES = (
    Case(2, 4, 2, 40, 56, 16, 12, True, "fp32", "topk", bias="kv_row", seed=7,
         mask_format="intervals"),
    Case(1, 4, 2, 48, 48, 16, 16, True, "fp32", "document", bias="kv_row", seed=8,
         mask_format="varlen"),
    Case(1, 4, 2, 40, 30, 16, None, False, "fp32", "random", "BxHkxLqxLk", "q_full", seed=9),
)


@pytest.fixture()
def sampled(monkeypatch):
    """Every case is checked on SAMPLE rows."""
    monkeypatch.setattr(accuracy, "FULL_REFERENCE_SCORES", 0)
    monkeypatch.setattr(accuracy, "ROW_SAMPLE", SAMPLE)


def test_rows_are_sampled_only_past_the_limit():
    case = Case(1, 16, 4, 16384, 16384, 128, 2048, True, "bf16", "topk", bias="kv_row")
    rows = checked_rows(case)
    assert rows.tolist() == sorted(set(rows.tolist()))
    assert len(rows) == accuracy.ROW_SAMPLE and rows[0] == 0 and rows[-1] == 16383
    assert torch.equal(rows, checked_rows(case))
    assert not torch.equal(rows, checked_rows(replace(case, seed=1)))
    assert checked_rows(replace(case, seqlen_q=2048, seqlen_k=2048)) is None  # 2**26 scores
    assert checked_rows(replace(case, seqlen_q=1)) is None  # decode: every row


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.case_id)
def test_the_sampled_reference_is_the_whole_problem_with_that_upstream_gradient(sampled, case,
                                                                                 monkeypatch):
    problem = make_problem(case, CPU)
    truth = ground_truth(problem, with_grad=True)
    rows = truth.rows
    assert len(rows) == SAMPLE
    off = torch.ones(case.seqlen_q, dtype=torch.bool)
    off[rows] = False
    assert not truth.dout[:, off].any() and truth.dout[:, rows].abs().sum() > 0
    assert truth.reference.tensors["out"].shape[1] == SAMPLE
    # The whole problem's fp64 reference, backpropagating the same (sampled) upstream gradient.
    monkeypatch.setattr(accuracy, "FULL_REFERENCE_SCORES", 1 << 40)
    whole = accuracy._reference_run(problem, truth.dout, True, True, None).tensors
    sampled_ref = truth.reference.tensors
    assert torch.allclose(sampled_ref["out"], whole["out"][:, rows], atol=1e-12)
    assert torch.allclose(sampled_ref["lse"], whole["lse"][:, :, rows], atol=1e-12)
    for name in ("dq", "dk", "dv", "dbias"):
        assert sampled_ref[name].shape == whole[name].shape, name
        assert torch.allclose(sampled_ref[name], whole[name], atol=1e-5), name
    assert not sampled_ref["dq"][:, off].any()


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c.case_id)
@pytest.mark.interpreter
def test_ours_passes_the_sampled_check(sampled, case):
    problem = make_problem(case, CPU)
    result = check_backend(make_backends()["triton"], problem, ground_truth(problem, True), True)
    assert result.passed, result.failures()
    assert set(result.checks) == {"out", "lse", "dq", "dk", "dv", "dbias"}


class Perturbed(ReferenceBackend):
    """The eager reference plus ``scale`` times (t - t.detach()) for t = one slice of an input:
    the same values, and ``scale`` times the upstream gradient's sum added to that slice's
    gradient; or, with ``values``, a constant added to the output at one query row."""

    def __init__(self, name: str, index: int, values: bool = False, scale: float = 1.0):
        self.input, self.index, self.values, self.scale = name, index, values, scale

    def bind(self, adapted, case, want_lse):
        bound = super().bind(adapted, case, want_lse)
        inner = bound.call

        def call():
            out, lse = inner()
            if self.values:
                bump = torch.zeros_like(out)
                bump[:, self.index] = self.scale
                return out + bump, lse
            t = adapted[self.input][:, self.index].sum()
            return out + self.scale * (t - t.detach()), lse

        return replace(bound, call=call)


@pytest.mark.parametrize("wrong, tensor", [
    (lambda rows, off: Perturbed("q", off, scale=1e-2), "dq"),   # dq off the sample
    (lambda rows, off: Perturbed("k", 5, scale=1e-2), "dk"),     # one key
    (lambda rows, off: Perturbed("q", rows[3], values=True, scale=1e-2), "out"),
])
def test_a_backend_wrong_where_it_is_checked_fails(sampled, wrong, tensor):
    case = CASES[0]
    problem = make_problem(case, CPU)
    truth = ground_truth(problem, True)
    rows = truth.rows.tolist()
    off = next(i for i in range(case.seqlen_q) if i not in rows)
    assert check_backend(ReferenceBackend(), problem, truth, True).passed
    result = check_backend(wrong(rows, off), problem, truth, True)
    assert [c.name for c in result.checks.values() if not c.passed] == [tensor]
