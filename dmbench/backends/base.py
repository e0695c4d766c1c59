"""What every backend provides, and the pieces they share.

A backend turns a case's canonical inputs into a zero-argument call in two steps, so that all
setup stays outside the timed region:

1. ``adapt(problem)``: differentiable tensor plumbing (layout changes, building a float mask;
   K/V head repeats only for a peer whose API has no GQA, fdma). The keys ``q``, ``k``, ``v`` and ``bias`` of the returned dict are what the
   backward differentiates. Timing detaches them into fresh leaves; ``equiv`` keeps the graph so
   that gradients land back on the canonical tensors in their own shapes.
2. ``bind(adapted, case, want_lse)``: builds the closure (and, for flex, the block mask; for
   ours, the prepared mask).

``build_ms`` in the CSV is the mask's build, never part of the timed call: the case's mask
built in its format from its source (``Problem.mask_build``: the torch.topk + scatter of a
bool topk mask, ``kernels.topk_intervals``, a packed layout), for every backend that takes the
mask, plus what the backend makes of it, each step timed once after a warm-up run
(``timing.BuildStep``): a float mask or a dense expansion of intervals in ``adapt`` (the
``"build"`` key of its dict), a prepared mask or a block mask in ``bind`` (``Bound.build``).
An ok row's ``detail`` names the steps and their times, then ``Bound.kernel`` where the backend
sets it (sdpa: the kernel torch's dispatcher picked, e.g. ``sdpa kernel: cudnn``), then what
``route_record`` logged of the point's untimed forward and one untimed run of the timed call
(ours: the routes its forward and backward took, ``routes: forward hopper; backward fused``).

Backends that take only dense masks (sdpa, fdma, reference) get intervals expanded
(``mask_views.dense_mask``); ``dense_bytes`` is a lower bound on what their dense tensors need,
so a point that cannot fit in the device's memory is skipped with the sizes in its reason.

The call returns ``(out, lse)`` with ``out`` in (B, Lq, Hq, D) layout (a view is fine) and
``lse`` (B, Hq, Lq) or None when the backend does not expose it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..case import Case
from ..problem import Problem
from ..timing import BuildStep, timed_build

__all__ = ["DIFF_KEYS", "Backend", "BuildStep", "Bound", "causal_keep", "per_query_head",
           "timed_build"]

DIFF_KEYS = ("q", "k", "v", "bias")


@dataclass
class Bound:
    call: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    build: BuildStep | None = None
    kernel: str = ""  # which kernel the call runs, where the backend chooses among several


class Backend:
    """Base class; subclasses override what differs. No registration happens at import."""

    name = ""
    description = ""
    has_grad = True
    has_lse = False
    exact = True  # computes the case's full math (mask and bias), so it can be checked
    interpreted = False  # a Triton kernel: on the CPU it runs under Triton's interpreter
    takes_mask = True  # reads the case's mask (so its build counts in build_ms)

    def unavailable_reason(self, device: torch.device) -> str | None:
        """None when usable on ``device``; otherwise a one-line reason."""
        return None

    def skip_reason(self, case: Case) -> str | None:
        """None when this backend can run ``case``; otherwise a one-line reason."""
        return None

    def dense_bytes(self, case: Case, mode: str) -> int:
        """A lower bound on the bytes of the dense (Lq, Lk) tensors this backend makes for
        ``case`` in ``mode``; 0 when it makes none."""
        return 0

    def memory_reason(self, case: Case, mode: str, device: torch.device) -> str | None:
        """Why ``case`` cannot fit in ``device``'s memory in ``mode`` (dense tensors), or None."""
        need = self.dense_bytes(case, mode)
        if not need or device.type != "cuda":
            return None
        total = torch.cuda.get_device_properties(device).total_memory
        if need <= total:
            return None
        return (f"{self.name}'s dense (Lq, Lk) tensors need at least {need / 2**30:.1f} GiB in "
                f"{mode}; the device has {total / 2**30:.1f} GiB")

    def route_record(self):
        """None, or a context manager whose log (``describe()``) names the kernels the calls
        made inside it took: the runner makes a point's untimed calls inside it, for the row's
        detail."""
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


def pairs_bytes(case: Case, heads: int, itemsize: int, count: int = 1) -> int:
    """Bytes of ``count`` (B, heads, Lq, Lk) tensors of ``itemsize`` bytes."""
    return count * case.batch * heads * case.seqlen_q * case.seqlen_k * itemsize


def dtype_size(case: Case) -> int:
    return {"bf16": 2, "fp16": 2, "fp32": 4}[case.dtype]
