"""Checking one backend on one case against the fp64 reference, with the project's one rule.

The rule and the error metric live in ``kernels.tolerance``; this module only feeds it: the fp64
reference, the eager low-precision run (both from ``kernels.attention_reference``) and the
backend's own tensors, forward and backward, with one shared upstream gradient.

Long cases are checked on a seeded subset of query rows, so the reference never needs
O(Lq·Lk) memory: when B·Hq·Lq·Lk exceeds ``FULL_REFERENCE_SCORES``, ``ROW_SAMPLE`` rows (the
first, the last and others drawn from the case's seed) are checked. The reference computes
only those rows (their mask rows and causality, all keys). Forward: out and lse on those rows.
Backward: the upstream gradient is zero on every other row, so the exact gradients of the
whole problem are those of the sampled rows alone: dk, dv and dbias are checked whole, dq on
every row (zero off the sample, which the backend must reproduce).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .backends import Backend
from .problem import Problem

TENSORS = ("out", "lse", "dq", "dk", "dv", "dbias")
# Above this many (batch, query head, query, key) scores the reference reads sampled rows.
FULL_REFERENCE_SCORES = 1 << 27
ROW_SAMPLE = 64
FORWARD_TENSORS = ("out", "lse")
GRAD_NAMES = {"q": "dq", "k": "dk", "v": "dv", "bias": "dbias"}


@dataclass
class Outputs:
    """Named tensors of one run: out, lse, dq, dk, dv, dbias (those that exist)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class GroundTruth:
    reference: Outputs  # fp64
    eager: Outputs      # the input dtype, the accuracy rule's baseline
    dout: torch.Tensor  # the whole problem's upstream gradient, zero off ``rows``
    rows: torch.Tensor | None = None  # the query rows checked; None: all of them


@dataclass
class CheckResult:
    checks: dict  # name -> kernels.tolerance.ErrorCheck
    error: str | None = None  # a backward that raised, after forward checks were made

    @property
    def passed(self) -> bool:
        return self.error is None and all(c.passed for c in self.checks.values())

    def failures(self) -> list[str]:
        return [c.describe() for c in self.checks.values() if not c.passed]


def _leaf_problem(problem: Problem) -> tuple[Problem, dict[str, torch.Tensor]]:
    leaves = {}
    for name in ("q", "k", "v", "bias"):
        t = getattr(problem, name)
        if t is not None:
            leaves[name] = t.detach().clone().requires_grad_(True)
    leafy = replace(problem, **leaves)
    return leafy, leaves


def _grads(out: torch.Tensor, leaves: dict[str, torch.Tensor], dout: torch.Tensor) -> dict:
    names = list(leaves)
    grads = torch.autograd.grad(out, [leaves[n] for n in names], dout, allow_unused=True)
    # An input the output does not depend on (a bias on fully masked rows only) has zero grad.
    return {GRAD_NAMES[n]: torch.zeros_like(leaves[n]) if g is None else g
            for n, g in zip(names, grads)}


def checked_rows(case) -> torch.Tensor | None:
    """The query rows a check reads: None (all of them) up to ``FULL_REFERENCE_SCORES``,
    else ``ROW_SAMPLE`` sorted rows, the first and the last among them, from the case's seed."""
    scores = case.batch * case.heads_q * case.seqlen_q * case.seqlen_k
    if scores <= FULL_REFERENCE_SCORES or case.seqlen_q <= ROW_SAMPLE:
        return None
    gen = torch.Generator().manual_seed(case.seed)
    inner = torch.randperm(case.seqlen_q - 2, generator=gen)[:ROW_SAMPLE - 2] + 1
    ends = torch.tensor([0, case.seqlen_q - 1])
    return torch.cat([ends, inner]).sort().values


def _reference_run(problem: Problem, dout: torch.Tensor, upcast: bool, with_grad: bool,
                   rows: torch.Tensor | None) -> Outputs:
    """The reference on the whole problem, or on ``rows`` only: their queries (and bias rows,
    where the bias has a query axis) are selected inside the graph, so the gradients come back
    in the whole tensors' shapes, zero where no sampled row reaches."""
    from kernels import attention_reference

    from .mask_views import visible_rows

    case = problem.case
    leafy, leaves = _leaf_problem(problem)
    with torch.set_grad_enabled(with_grad):
        q, mask, bias, causal = leafy.q, problem.mask, leafy.bias, case.causal
        if rows is not None:
            rows = rows.to(q.device)
            q, dout = q.index_select(1, rows), dout.index_select(1, rows)
            mask, causal = visible_rows(case, problem.mask, rows), False
            if bias is not None and bias.shape[2] > 1:
                bias = bias.index_select(2, rows)
        out, lse = attention_reference(q, leafy.k, leafy.v, mask, bias, causal, None,
                                       return_lse=True, upcast=upcast)
    tensors = {"out": out.detach(), "lse": lse.detach()}
    if with_grad:
        tensors.update(_grads(out, leaves, dout.to(out.dtype)))
    return Outputs(tensors)


def ground_truth(problem: Problem, with_grad: bool) -> GroundTruth:
    gen = torch.Generator(device=problem.q.device)
    gen.manual_seed(problem.case.seed + 1)
    dout = torch.randn(problem.q.shape, generator=gen, device=problem.q.device, dtype=problem.q.dtype)
    rows = checked_rows(problem.case)
    if rows is not None:
        off_sample = torch.ones(dout.shape[1], dtype=torch.bool, device=dout.device)
        off_sample[rows.to(dout.device)] = False
        dout[:, off_sample] = 0
    return GroundTruth(_reference_run(problem, dout, True, with_grad, rows),
                       _reference_run(problem, dout, False, with_grad, rows), dout, rows)


def check_backend(backend: Backend, problem: Problem, truth: GroundTruth,
                  with_grad: bool) -> CheckResult:
    """Run ``backend`` forward (and backward) and compare every tensor it produces.

    With gradients the forward runs twice: once for the backward, and once without autograd,
    as inference runs it (ours may then take another route: decode's gather route serves only
    calls without gradients). Each forward tensor's check is the worse of the two, named
    ``out (inference)`` or ``lse (inference)`` where the inference pass is the worse.

    Forward errors propagate to the caller. A backward error is returned in ``error`` together
    with the forward checks, so a missing backward does not hide a correct forward.
    """
    from kernels.tolerance import check_tensor

    dtype = problem.q.dtype
    leafy, leaves = _leaf_problem(problem)
    grad = with_grad and backend.has_grad
    with torch.set_grad_enabled(grad):
        bound = backend.bind(backend.adapt(leafy), problem.case, want_lse=backend.has_lse)
        out, lse = bound.call()
    rows = None if truth.rows is None else truth.rows.to(out.device)
    mine = _forward_tensors(out, lse, rows)
    inference = None
    if grad:
        with torch.no_grad():
            inference = _forward_tensors(*bound.call(), rows)
    error = None
    if grad:
        try:
            mine.update(_grads(out, leaves, truth.dout))
        except Exception as exc:  # recorded in the row; the sweep goes on
            error = f"backward: {type(exc).__name__}: {exc}"
    checks = {}
    for name in TENSORS:
        if name in mine and name in truth.reference.tensors:
            reference, eager = truth.reference.tensors[name], truth.eager.tensors[name]
            checks[name] = check_tensor(name, mine[name], reference, eager, dtype)
            if inference is not None and name in inference:
                other = check_tensor(f"{name} (inference)", inference[name], reference, eager,
                                     dtype)
                checks[name] = _worse(checks[name], other)
    return CheckResult(checks, error)


def _forward_tensors(out, lse, rows) -> dict[str, torch.Tensor]:
    """out and lse (where the backend gives it) on the checked rows."""
    tensors = {"out": out.detach() if rows is None else out.detach().index_select(1, rows)}
    if lse is not None:
        tensors["lse"] = lse.detach() if rows is None else lse.detach().index_select(2, rows)
    return tensors


def _worse(first, second):
    """The check that fails, or else the one with less room left (a NaN error fails)."""
    if first.passed != second.passed:
        return second if first.passed else first
    return second if second.error - second.allowed > first.error - first.allowed else first
