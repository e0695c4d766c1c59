"""flash-dmattn 1.2.2's Triton kernel (``triton_dmattn_func``), when it is importable.

Its launcher (read from the sdist's ``flash_dmattn/flash_dmattn_triton.py``) wants:

- q (B, Lq, H, D) and k/v (B, Lk, H, D) with the same H: no GQA, so KV heads are repeated;
- mask and bias both materialized as (B, H, Lq, Lk) in the query dtype (a bool mask is converted
  inside the timed call, and a missing one is allocated there), so both are built here (and
  timed, in ``build_ms``), intervals expanded;
- D <= 128, fp16 or bf16, CUDA tensors;
- top-left aligned causality (``offs_m >= offs_n``). That equals ours when Lq == Lk; otherwise
  the bottom-right pattern is folded into the mask and its causal flag is left off;
- mask and bias offsets that fit in 32 bits (see ``_offset_overflow``).

All of this happens in ``adapt``, outside the timed region. Its code is never part of this repo:
``python -m dmbench fetch-peer`` downloads and unpacks the sdist into the git-ignored ``.peer/``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch

from ..case import Case
from ..problem import Problem
from ..mask_views import dense_mask
from .base import Backend, Bound, causal_keep, dtype_size, pairs_bytes, per_query_head, timed_build

MODULE = "flash_dmattn.flash_dmattn_triton"
HINT = ("run `python -m dmbench fetch-peer` and put .peer/flash_dmattn-1.2.2 on PYTHONPATH")
INT32_MAX = 2**31 - 1


def _offset_overflow(case: Case) -> str | None:
    """Why the peer's kernels would address outside its (B, H, Lq, Lk) mask and bias, or None.

    They form ``off_b * stride_b``, ``off_h * stride_h`` and ``offs_m * stride_m + offs_n`` as
    separate products. Triton passes a stride that fits in 32 bits as int32 and multiplies it by
    an int32 program index, so such a product wraps once it passes 2**31 - 1. On the H100 the
    seqlen sweep's B1 H16 L16384 case (15 * 16384**2 > 2**31) died with an illegal memory
    access. A stride too large for int32 arrives as int64 and cannot wrap.
    """
    plane = case.seqlen_q * case.seqlen_k
    largest = [plane - 1]  # offs_m * Lk + offs_n, within one (b, h) plane
    for count, stride in ((case.batch, case.heads_q * plane), (case.heads_q, plane)):
        if stride <= INT32_MAX:
            largest.append((count - 1) * stride)
    if max(largest) > INT32_MAX:
        return (f"fdma's kernels compute mask/bias offsets in 32 bits; a (B, H, Lq, Lk) = "
                f"({case.batch}, {case.heads_q}, {case.seqlen_q}, {case.seqlen_k}) mask "
                "overflows them (illegal memory access)")
    return None


def load_peer_function():
    """``triton_dmattn_func`` or an exception. Falls back to loading the file by path when the
    package ``__init__`` fails for reasons other than its optional CUDA extension."""
    try:
        return importlib.import_module(MODULE).triton_dmattn_func
    except ImportError:
        raise
    except Exception:
        spec = importlib.util.find_spec("flash_dmattn")
        if spec is None or not spec.submodule_search_locations:
            raise
        path = Path(list(spec.submodule_search_locations)[0]) / "flash_dmattn_triton.py"
        file_spec = importlib.util.spec_from_file_location("_dmbench_fdma_triton", path)
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[file_spec.name] = module
        file_spec.loader.exec_module(module)
        return module.triton_dmattn_func


class FdmaBackend(Backend):
    name = "fdma"
    description = "flash-dmattn 1.2.2 triton_dmattn_func (peer; MHA layout, dense mask and bias)"
    interpreted = True

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "fdma needs a CUDA device (its launcher asserts q.is_cuda)"
        try:
            load_peer_function()
        except Exception as exc:
            return f"{MODULE} is not importable ({type(exc).__name__}: {exc}); {HINT}"
        return None

    def skip_reason(self, case: Case) -> str | None:
        if case.head_dim > 128:
            return f"fdma supports head_dim <= 128, got {case.head_dim}"
        if case.dtype == "fp32":
            return "fdma supports fp16 and bf16 only"
        return _offset_overflow(case)

    def dense_bytes(self, case: Case, mode: str) -> int:
        # The mask and the bias, (B, H, Lq, Lk) each; a backward adds the bias gradient.
        return pairs_bytes(case, case.heads_q, dtype_size(case), 2 if mode == "fwd" else 3)

    def adapt(self, problem: Problem) -> dict[str, Any]:
        case = problem.case
        q = problem.q
        group = case.heads_q // case.heads_kv
        k = problem.k.repeat_interleave(group, dim=2) if group > 1 else problem.k
        v = problem.v.repeat_interleave(group, dim=2) if group > 1 else problem.v
        fold_causal = case.causal and case.seqlen_q != case.seqlen_k
        (mask, bias), build = timed_build(lambda: _dense_inputs(problem, fold_causal), q.device,
                                          "dense mask and bias")
        return {"q": q, "k": k, "v": v, "mask": mask, "bias": bias, "build": build,
                "is_causal": case.causal and not fold_causal}

    def bind(self, adapted: dict[str, Any], case: Case, want_lse: bool) -> Bound:
        func = load_peer_function()
        q, k, v, mask, bias = (adapted[n] for n in ("q", "k", "v", "mask", "bias"))
        is_causal = adapted["is_causal"]

        def call():
            return func(q, k, v, mask, bias, is_causal), None

        return Bound(call)


def _dense_inputs(problem: Problem, fold_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The peer's (B, H, Lq, Lk) mask and bias in the query dtype, causality folded into the
    mask when the lengths differ (its causality is top-left)."""
    case, q = problem.case, problem.q
    full = (case.batch, case.heads_q, case.seqlen_q, case.seqlen_k)
    keep = dense_mask(case, problem.mask)
    if keep is not None:
        keep = per_query_head(keep, case.heads_q)
    if fold_causal:
        causal = causal_keep(case, q.device)
        keep = causal if keep is None else keep & causal
    if keep is None:
        mask = torch.ones(full, dtype=q.dtype, device=q.device)
    else:
        mask = keep.expand(full).to(q.dtype).contiguous()
    if problem.bias is None:
        bias = torch.zeros(full, dtype=q.dtype, device=q.device)
    else:
        bias = per_query_head(problem.bias, case.heads_q).expand(full).contiguous()
    return mask, bias
