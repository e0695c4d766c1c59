"""Our kernels (``triton``), the same kernels from another checkout (``triton-base``), and the
eager reference in the input dtype (``reference``)."""

from __future__ import annotations

import inspect
import json
import os
from importlib import import_module
from pathlib import Path
from typing import Any

import torch

from ..case import Case
from ..mask_views import dense_mask, is_intervals
from ..problem import Problem
from .base import Backend, Bound, dtype_size, pairs_bytes, timed_build


def import_error(module: str) -> str | None:
    """None when ``module`` imports; otherwise the reason in one line."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception as exc:  # any failure means "not available here"; the reason is reported
        return f"cannot import {module}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def packed_bias(bias: torch.Tensor | None, case: Case) -> torch.Tensor | None:
    """A bias without a query axis, (B or 1, Hb, 1, Lk or 1), as the packed layout's per-key
    bias (Hb, B * Lk): batch rows in order, as their tokens are packed. Differentiable."""
    if bias is None:
        return None
    heads = bias.shape[1]
    rows = bias.expand(case.batch, heads, 1, case.seqlen_k)
    return rows.permute(1, 0, 2, 3).reshape(heads, case.batch * case.seqlen_k)


class TritonBackend(Backend):
    name = "triton"
    description = ("ours: kernels.dmattn_func (Triton; the interpreter on CPU) with a bool mask "
                   "prepared once by kernels.prepare_mask (build_ms, like flex's block mask) or "
                   "KeyIntervals as they are; kernels.dmattn_varlen_func for the varlen format")
    has_lse = True
    interpreted = True
    # A bool mask is prepared once, outside the timing (``PerCallBackend`` passes it as is).
    prepares_mask = True

    def unavailable_reason(self, device: torch.device) -> str | None:
        return import_error("kernels")

    def adapt(self, problem: Problem) -> dict[str, Any]:
        case = problem.case
        if case.mask_format != "varlen":
            return super().adapt(problem)

        def packed(t: torch.Tensor) -> torch.Tensor:  # (B, L, H, D) -> (B * L, H, D), a view
            return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])

        return {"q": packed(problem.q), "k": packed(problem.k), "v": packed(problem.v),
                "bias": packed_bias(problem.bias, case), "layout": problem.packed}

    def bind(self, adapted: dict[str, Any], case: Case, want_lse: bool) -> Bound:
        if "layout" in adapted:
            return self._bind_varlen(adapted, case, want_lse)
        kernels = self.kernels()
        dmattn_func, prepare_mask = kernels.dmattn_func, kernels.prepare_mask
        q, k, v, mask, bias = (adapted[n] for n in ("q", "k", "v", "mask", "bias"))
        # Like flex's block mask: a bool mask's tile lists are built once, outside the timing,
        # and their build time is reported. Intervals are read by the call itself. The test is
        # against this package's own class: triton-base's intervals are the baseline's.
        build = None
        if (self.prepares_mask and mask is not None
                and not isinstance(mask, kernels.KeyIntervals)):
            mask, build = timed_build(lambda: prepare_mask(mask, q, k, case.causal), q.device,
                                      "prepare_mask")

        forced, note = self.passed_options()

        def call():
            result = dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=case.causal,
                                 return_lse=want_lse, **forced)
            return result if want_lse else (result, None)

        return Bound(call, build, note)

    def kernel_options(self) -> dict | None:
        """The ``kernel_options`` every call passes (None: the default schedule)."""
        return None

    def passed_options(self) -> tuple[dict, str]:
        """(the keyword arguments that give a call ``kernel_options``, the row's note of them):
        both empty where the backend passes none."""
        options = self.kernel_options()
        if options is None:
            return {}, ""
        return {"kernel_options": options}, f"kernel_options {options}"

    def kernels(self):
        """The kernels package this backend calls."""
        import kernels

        return kernels

    def route_record(self):
        """``kernels.record_routes()``: the routes the calls took as the launchers report them
        (``forward hopper; backward fused``); None for kernels without it (an older
        ``triton-base`` checkout)."""
        record = getattr(self.kernels(), "record_routes", None)
        return record() if record is not None else None

    def _bind_varlen(self, adapted: dict[str, Any], case: Case, want_lse: bool) -> Bound:
        dmattn_varlen_func = self.kernels().dmattn_varlen_func

        q, k, v, bias, layout = (adapted[n] for n in ("q", "k", "v", "bias", "layout"))
        batch, length = case.batch, case.seqlen_q
        forced, note = self.passed_options()

        def call():
            result = dmattn_varlen_func(q, k, v, layout.cu_seqlens, layout.cu_seqlens,
                                        layout.max_seqlen, layout.max_seqlen, attn_bias=bias,
                                        is_causal=case.causal, return_lse=want_lse, **forced)
            out, lse = result if want_lse else (result, None)
            out = out.view(batch, length, *out.shape[1:])
            if lse is not None:  # (Hq, B * L) -> (B, Hq, L)
                lse = lse.view(lse.shape[0], batch, length).transpose(0, 1)
            return out, lse

        return Bound(call, None, note)


class PerCallBackend(TritonBackend):
    """Ours as flash-dmattn's API is used: a new bool mask each step, passed as it is, so the
    call reads it (its activity, lists or kept keys) inside the timed call."""

    name = "triton-per-call"
    description = ("ours with the bool mask passed as it is on every call (nothing prepared: "
                   "the call reads the mask inside the timing); bool-mask cases only")
    prepares_mask = False

    def skip_reason(self, case: Case) -> str | None:
        if case.mask == "none" or case.mask_format != "bool":
            return ("it passes a bool mask unprepared: cases with a mask in mask_format bool "
                    f"only, got mask {case.mask}, mask_format {case.mask_format}")
        return None


class SelectingBackend(TritonBackend):
    """Ours as a top-W model decodes: the case's ``topk_intervals`` made from its kv_row bias
    inside the timed call, then ``dmattn_func``, so a row's time is the whole step's."""

    name = "triton-select"
    description = ("ours with the top-W selection inside the timed call: kernels.topk_intervals "
                   "of the kv_row bias, then kernels.dmattn_func (topk intervals cases only)")

    def skip_reason(self, case: Case) -> str | None:
        if case.mask != "topk" or case.mask_format != "intervals" or case.bias != "kv_row":
            return ("it selects inside the call: mask topk, mask_format intervals and bias "
                    f"kv_row only, got mask {case.mask_format} {case.mask}, bias {case.bias}")
        return None

    def bind(self, adapted: dict[str, Any], case: Case, want_lse: bool) -> Bound:
        kernels = self.kernels()
        dmattn_func, topk_intervals = kernels.dmattn_func, kernels.topk_intervals
        q, k, v, bias = (adapted[n] for n in ("q", "k", "v", "bias"))

        def call():
            chosen = topk_intervals(bias, case.window, seqlen_q=case.seqlen_q,
                                    is_causal=case.causal)
            result = dmattn_func(q, k, v, attn_mask=chosen, attn_bias=bias,
                                 is_causal=case.causal, return_lse=want_lse)
            return result if want_lse else (result, None)

        return Bound(call)


BASELINE_ENV = "DMBENCH_BASELINE_KERNELS"
BASELINE_OPTIONS_ENV = "DMBENCH_BASELINE_OPTIONS"
BASELINE_MODULE = "dmbench_baseline_kernels"


class BaselineBackend(TritonBackend):
    """Our kernels as another checkout has them, beside ``triton`` in the same process: an A/B
    of two kernel versions on every row of a sweep, each point timed alternately with the
    others when ``timing.rounds`` > 1.

    ``DMBENCH_BASELINE_KERNELS`` names that checkout's ``kernels`` directory (for example one
    made by ``git worktree add /tmp/base <commit>``); it is imported under another module name,
    so both versions' Triton kernels and caches live side by side. A baseline without
    ``KeyIntervals`` or ``dmattn_varlen_func`` skips the cases that need them.
    ``DMBENCH_BASELINE_OPTIONS`` (a JSON object) is passed to its every call as
    ``kernel_options``: with this checkout's own ``kernels`` directory, an A/B of a schedule
    decision (``{"forward_tile_order": "heads"}``) in one process; each row's detail names them.
    """

    name = "triton-base"
    description = (f"ours from the checkout whose kernels directory ${BASELINE_ENV} names, "
                   "called as triton is (an A/B of two kernel versions in one process)")

    def __init__(self):
        self._module = None

    def unavailable_reason(self, device: torch.device) -> str | None:
        folder = os.environ.get(BASELINE_ENV)
        if not folder:
            return f"set {BASELINE_ENV} to another checkout's kernels directory"
        if not Path(folder, "__init__.py").is_file():
            return f"{BASELINE_ENV}={folder} is not a kernels package (no __init__.py there)"
        try:
            self.kernels()
        except Exception as exc:  # any failure means "not available here"; the reason is reported
            first = str(exc).splitlines()[0] if str(exc) else ""
            return f"cannot import the kernels at {folder}: {type(exc).__name__}: {first}"
        try:
            self.kernel_options()
        except ValueError as exc:
            return str(exc)
        return None

    def kernel_options(self) -> dict | None:
        """``DMBENCH_BASELINE_OPTIONS`` as the baseline checks them (ValueError naming the
        variable where it is not a JSON object of options the baseline knows)."""
        text = os.environ.get(BASELINE_OPTIONS_ENV)
        if not text:
            return None
        try:
            options = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{BASELINE_OPTIONS_ENV} is not JSON ({exc.msg}): {text!r}") from None
        if not isinstance(options, dict):
            raise ValueError(f"{BASELINE_OPTIONS_ENV} must be a JSON object of kernel_options, "
                             f"got {text!r}")
        self.kernels()  # its planning package is then importable under the baseline's name
        try:
            check = import_module(f"{BASELINE_MODULE}.planning.schedule").normalize_options
        except ImportError:  # a package without one: each call checks its options
            return options
        try:
            check(options)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{BASELINE_OPTIONS_ENV}: {exc}") from None
        return options

    def adapt(self, problem: Problem) -> dict[str, Any]:
        adapted = super().adapt(problem)
        mask = adapted.get("mask")
        if is_intervals(mask):  # the same intervals as the baseline package's own class
            own_class = self.kernels().KeyIntervals
            # Their bound on the kept keys goes along where the baseline has one: without it,
            # decode rows the bound sends to the gather route would take another route there.
            # Likewise their bound on the keys one row keeps, which the forward's route reads.
            accepts = inspect.signature(own_class).parameters
            bound = {name: getattr(mask, name) for name in ("max_kept", "_row_kept")
                     if getattr(mask, name, None) is not None and name in accepts}
            intervals = own_class(mask.start, mask.end, **bound)
            # A key order is not copied across packages: the baseline orders the keys its own
            # way, as its topk_intervals would (an older one without orders reads them plain).
            if mask.key_order is not None and hasattr(intervals, "with_key_order"):
                intervals = intervals.with_key_order()
            adapted["mask"] = intervals
        return adapted

    def skip_reason(self, case: Case) -> str | None:
        needs = {"intervals": "KeyIntervals", "varlen": "dmattn_varlen_func"}.get(case.mask_format)
        if needs and not hasattr(self.kernels(), needs):
            return f"the baseline kernels have no {needs}"
        return None

    def kernels(self):
        if self._module is None:
            self._module = load_package(BASELINE_MODULE, Path(os.environ[BASELINE_ENV]))
        return self._module


def load_package(name: str, folder: Path):
    """The package in ``folder`` imported as ``name`` (its relative imports resolve inside it);
    loaded once per process."""
    import importlib.util
    import sys

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


class ReferenceBackend(Backend):
    name = "reference"
    description = ("kernels.attention_reference in the input dtype (eager, materializes scores; "
                   "intervals expanded to a dense mask)")
    has_lse = True

    def unavailable_reason(self, device: torch.device) -> str | None:
        return import_error("kernels.reference")

    def dense_bytes(self, case: Case, mode: str) -> int:
        # The scores, and the probabilities softmax makes of them; the backward adds their grads.
        return pairs_bytes(case, case.heads_q, dtype_size(case), 2 if mode == "fwd" else 4)

    def adapt(self, problem: Problem) -> dict[str, Any]:
        adapted = super().adapt(problem)
        if is_intervals(problem.mask):
            adapted["mask"], adapted["build"] = timed_build(
                lambda: dense_mask(problem.case, problem.mask), problem.q.device,
                "dense expansion")
        return adapted

    def bind(self, adapted: dict[str, Any], case: Case, want_lse: bool) -> Bound:
        from kernels import attention_reference

        q, k, v, mask, bias = (adapted[n] for n in ("q", "k", "v", "mask", "bias"))

        def call():
            result = attention_reference(q, k, v, mask, bias, case.causal, None,
                                         return_lse=want_lse, upcast=False)
            return result if want_lse else (result, None)

        return Bound(call)
