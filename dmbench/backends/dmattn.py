"""Our kernels (``triton``) and the eager reference in the input dtype (``reference``)."""

from __future__ import annotations

from typing import Any

import torch

from ..sweep import Case
from .base import Backend, Bound, timed_build


def import_error(module: str) -> str | None:
    """None when ``module`` imports; otherwise the reason in one line."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception as exc:  # any failure means "not available here"; the reason is reported
        return f"cannot import {module}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


class TritonBackend(Backend):
    name = "triton"
    description = ("ours: kernels.dmattn_func (Triton; the interpreter on CPU), the mask prepared "
                   "once by kernels.prepare_mask (build_ms, like flex's block mask)")
    has_lse = True
    interpreted = True

    def unavailable_reason(self, device: torch.device) -> str | None:
        return import_error("kernels")

    def bind(self, adapted: dict[str, Any], case: Case, want_lse: bool) -> Bound:
        from kernels import dmattn_func, prepare_mask

        q, k, v, mask, bias = (adapted[n] for n in ("q", "k", "v", "mask", "bias"))
        # Like flex's block mask: the mask's tile lists are built once, outside the timing,
        # and their build time is reported on its own.
        prepared, build_ms = None, None
        if mask is not None:
            prepared, build_ms = timed_build(lambda: prepare_mask(mask, q, k, case.causal),
                                             q.device)

        def call():
            result = dmattn_func(q, k, v, attn_mask=prepared, attn_bias=bias, is_causal=case.causal,
                                 return_lse=want_lse)
            return result if want_lse else (result, None)

        return Bound(call, build_ms)


class ReferenceBackend(Backend):
    name = "reference"
    description = "kernels.attention_reference in the input dtype (eager, materializes scores)"
    has_lse = True

    def unavailable_reason(self, device: torch.device) -> str | None:
        return import_error("kernels.reference")

    def bind(self, adapted: dict[str, Any], case: Case, want_lse: bool) -> Bound:
        from kernels import attention_reference

        q, k, v, mask, bias = (adapted[n] for n in ("q", "k", "v", "mask", "bias"))

        def call():
            result = attention_reference(q, k, v, mask, bias, case.causal, None,
                                         return_lse=want_lse, upcast=False)
            return result if want_lse else (result, None)

        return Bound(call)
