"""What every backend provides, and the pieces they share.

A backend turns a case's canonical inputs into a zero-argument call in two steps, so that all
setup stays outside the timed region:

1. ``adapt(problem)``: differentiable tensor plumbing (layout changes, GQA head repeats, building
   a float mask). The keys ``q``, ``k``, ``v`` and ``bias`` of the returned dict are what the
   backward differentiates. Timing detaches them into fresh leaves; ``equiv`` keeps the graph so
   that gradients land back on the canonical tensors in their own shapes.
2. ``bind(adapted, case, want_lse)``: builds the closure (and, for flex, the block mask, whose
   build time is reported on its own).

The call returns ``(out, lse)`` with ``out`` in (B, Lq, Hq, D) layout (a view is fine) and
``lse`` (B, Hq, Lq) or None when the backend does not expose it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..problem import Problem
from ..sweep import Case

DIFF_KEYS = ("q", "k", "v", "bias")


@dataclass
class Bound:
    call: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    build_ms: float | None = None


class Backend:
    """Base class; subclasses override what differs. No registration happens at import."""

    name = ""
    description = ""
    has_grad = True
    has_lse = False
    exact = True  # computes the case's full math (mask and bias), so it can be checked
    interpreted = False  # a Triton kernel: on the CPU it runs under Triton's interpreter

    def unavailable_reason(self, device: torch.device) -> str | None:
        """None when usable on ``device``; otherwise a one-line reason."""
        return None

    def skip_reason(self, case: Case) -> str | None:
        """None when this backend can run ``case``; otherwise a one-line reason."""
        return None

    def adapt(self, problem: Problem) -> dict[str, Any]:
        p = problem
        return {"q": p.q, "k": p.k, "v": p.v, "mask": p.mask, "bias": p.bias}

    def bind(self, adapted: dict[str, Any], case: Case, want_lse: bool) -> Bound:
        raise NotImplementedError


def per_query_head(t: torch.Tensor, heads_q: int) -> torch.Tensor:
    """A (b, h, lq, lk) mask or bias with h in {1, Hk, Hq} as a view or gather over Hq heads.

    Query head ``i`` reads head ``i // (Hq // h)``: the GQA head map. Size-1 heads stay size 1
    so they keep broadcasting for free.
    """
    heads = t.shape[1]
    if heads in (1, heads_q):
        return t
    index = torch.arange(heads_q, device=t.device) // (heads_q // heads)
    return t.index_select(1, index)


def causal_keep(case: Case, device) -> torch.Tensor:
    from kernels.reference import causal_keep as keep

    return keep(case.seqlen_q, case.seqlen_k, device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_build(build: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """Run ``build`` once to compile and warm up, then again on the clock (synchronized):
    the second result and its wall time in ms, which the CSV reports as ``build_ms``."""
    build()
    synchronize(device)
    start = time.perf_counter()
    result = build()
    synchronize(device)
    return result, (time.perf_counter() - start) * 1e3
