"""The one accuracy rule, used by the tests and by ``dmbench equiv``.

For each tensor (out, lse, dq, dk, dv, dbias)::

    err(candidate vs fp64 reference) <= 2 * err(eager low-precision run vs fp64 reference)
                                        + ATOL_FLOOR[dtype]

where err is the max absolute error. Both numbers are returned, not just a verdict, so callers
can record them. NaN anywhere fails; equal infinities (the LSE of an empty row is -inf) match.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Absolute floors: what remains of rounding when the eager run happens to be nearly exact.
# fp32: a flash backward rebuilds P as exp(s - lse) from the saved LSE, so the rounding of each
# score (|s| * 2**-24, |s| ~ 50 at softmax_scale=3) reaches every probability. The eager
# softmax normalizes its own rounded scores, which cancels that error on peaked rows: its dv
# can be nearly exact (2.6e-6 on |dv| <= 5.7) while a correct kernel's is 1.8e-5 (3e-6 of the
# magnitude). 5e-5 covers that; a real defect is orders of magnitude larger.
ATOL_FLOOR = {
    torch.float32: 5e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def max_abs_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Max |actual - reference| in float64; inf for NaN, a shape mismatch or one-sided infinity."""
    if tuple(actual.shape) != tuple(reference.shape):
        return math.inf
    a = actual.detach().to(torch.float64)
    r = reference.detach().to(torch.float64).to(a.device)
    if torch.isnan(a).any() or a.numel() == 0:
        return math.inf if a.numel() else 0.0
    same = a == r  # covers matching infinities, which would otherwise give inf - inf = NaN
    diff = torch.where(same, torch.zeros_like(a), (a - r).abs())
    diff = torch.nan_to_num(diff, nan=math.inf)
    return float(diff.max())


@dataclass(frozen=True)
class ErrorCheck:
    name: str
    error: float
    baseline_error: float
    allowed: float

    @property
    def passed(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.allowed

    def describe(self) -> str:
        verdict = "ok" if self.passed else "FAIL"
        return (f"{self.name}: err {self.error:.3e} allowed {self.allowed:.3e} "
                f"(eager {self.baseline_error:.3e}) {verdict}")


def allowed_error(baseline_error: float, dtype: torch.dtype) -> float:
    # A broken eager baseline (NaN) must not widen the bound to infinity: fall back to the floor.
    slack = 2.0 * baseline_error if math.isfinite(baseline_error) else 0.0
    return slack + ATOL_FLOOR[dtype]


def check_tensor(name, actual, reference, baseline, dtype) -> ErrorCheck:
    """Compare ``actual`` and the eager ``baseline`` run against the fp64 ``reference``."""
    baseline_error = max_abs_error(baseline, reference)
    return ErrorCheck(name, max_abs_error(actual, reference), baseline_error,
                      allowed_error(baseline_error, dtype))
