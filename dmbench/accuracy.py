"""Checking one backend on one case against the fp64 reference, with the project's one rule.

The rule and the error metric live in ``kernels.tolerance``; this module only feeds it: the fp64
reference, the eager low-precision run (both from ``kernels.attention_reference``) and the
backend's own tensors, forward and backward, with one shared upstream gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .backends import Backend
from .problem import Problem

TENSORS = ("out", "lse", "dq", "dk", "dv", "dbias")
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
    dout: torch.Tensor


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


def _reference_run(problem: Problem, dout: torch.Tensor, upcast: bool, with_grad: bool) -> Outputs:
    from kernels import attention_reference

    leafy, leaves = _leaf_problem(problem)
    with torch.set_grad_enabled(with_grad):
        out, lse = attention_reference(leafy.q, leafy.k, leafy.v, leafy.mask, leafy.bias,
                                       problem.case.causal, None, return_lse=True, upcast=upcast)
    tensors = {"out": out.detach(), "lse": lse.detach()}
    if with_grad:
        tensors.update(_grads(out, leaves, dout.to(out.dtype)))
    return Outputs(tensors)


def ground_truth(problem: Problem, with_grad: bool) -> GroundTruth:
    gen = torch.Generator(device=problem.q.device)
    gen.manual_seed(problem.case.seed + 1)
    dout = torch.randn(problem.q.shape, generator=gen, device=problem.q.device, dtype=problem.q.dtype)
    return GroundTruth(_reference_run(problem, dout, True, with_grad),
                       _reference_run(problem, dout, False, with_grad), dout)


def check_backend(backend: Backend, problem: Problem, truth: GroundTruth,
                  with_grad: bool) -> CheckResult:
    """Run ``backend`` forward (and backward) and compare every tensor it produces.

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
    mine = {"out": out.detach()}
    if lse is not None:
        mine["lse"] = lse.detach()
    error = None
    if grad:
        try:
            mine.update(_grads(out, leaves, truth.dout))
        except Exception as exc:  # recorded in the row; the sweep goes on
            error = f"backward: {type(exc).__name__}: {exc}"
    checks = {}
    for name in TENSORS:
        if name in mine and name in truth.reference.tensors:
            checks[name] = check_tensor(name, mine[name], truth.reference.tensors[name],
                                        truth.eager.tensors[name], dtype)
    return CheckResult(checks, error)
