"""PyTorch peers: SDPA with a float mask, dense SDPA (the ceiling), and FlexAttention."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

from ..problem import Problem
from ..sweep import Case
from .base import Backend, Bound, causal_keep, per_query_head, timed_build


def _bhld(t: torch.Tensor) -> torch.Tensor:
    """(B, L, H, D) -> (B, H, L, D) as a view: the layout SDPA and flex take."""
    return t.transpose(1, 2)


def _causal_mask_arg(case: Case, device):
    """SDPA's own is_causal is top-left aligned, so unequal lengths need the lower-right bias."""
    from torch.nn.attention.bias import causal_lower_right

    if not case.causal:
        return None, False
    if case.seqlen_q == case.seqlen_k:
        return None, True
    return causal_lower_right(case.seqlen_q, case.seqlen_k), False


class SdpaBackend(Backend):
    name = "sdpa"
    description = "F.scaled_dot_product_attention with a float mask built from mask and bias"

    def adapt(self, problem: Problem) -> dict[str, Any]:
        case = problem.case
        group = case.heads_q // case.heads_kv
        # A float mask rules out the flash kernel, and the memory-efficient kernel has no GQA,
        # so KV heads are repeated here, outside the timed call.
        k = _bhld(problem.k).repeat_interleave(group, dim=1) if group > 1 else _bhld(problem.k)
        v = _bhld(problem.v).repeat_interleave(group, dim=1) if group > 1 else _bhld(problem.v)
        adapted = {"q": _bhld(problem.q), "k": k, "v": v, "bias": None, "attn_mask": None,
                   "is_causal": False}
        if problem.mask is None and problem.bias is None:
            adapted["attn_mask"], adapted["is_causal"] = _causal_mask_arg(case, problem.q.device)
            return adapted
        keep = causal_keep(case, problem.q.device) if case.causal else None
        if problem.mask is not None:
            mask = per_query_head(problem.mask, case.heads_q)
            keep = mask if keep is None else mask & keep
        if problem.bias is None:
            zero = torch.zeros((), dtype=problem.q.dtype, device=problem.q.device)
            adapted["attn_mask"] = torch.where(keep, zero, float("-inf"))
            return adapted
        bias = per_query_head(problem.bias, case.heads_q)
        # The float mask carries the bias, so it is the tensor the backward differentiates.
        adapted["bias"] = bias if keep is None else torch.where(keep, bias, float("-inf"))
        return adapted

    def bind(self, adapted: dict[str, Any], case: Case, want_lse: bool) -> Bound:
        q, k, v = adapted["q"], adapted["k"], adapted["v"]
        mask = adapted["bias"] if adapted["bias"] is not None else adapted["attn_mask"]
        is_causal = adapted["is_causal"]

        def call():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
            return out.transpose(1, 2), None

        return Bound(call)


class SdpaDenseBackend(Backend):
    name = "sdpa-dense"
    description = "F.scaled_dot_product_attention without mask or bias (causal only): the ceiling"
    exact = False

    def adapt(self, problem: Problem) -> dict[str, Any]:
        attn_mask, is_causal = _causal_mask_arg(problem.case, problem.q.device)
        return {"q": _bhld(problem.q), "k": _bhld(problem.k), "v": _bhld(problem.v),
                "attn_mask": attn_mask, "is_causal": is_causal}

    def bind(self, adapted: dict[str, Any], case: Case, want_lse: bool) -> Bound:
        q, k, v = adapted["q"], adapted["k"], adapted["v"]
        mask, is_causal = adapted["attn_mask"], adapted["is_causal"]
        gqa = case.heads_q != case.heads_kv

        def call():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                 enable_gqa=gqa)
            return out.transpose(1, 2), None

        return Bound(call)


# Dynamo falls back to eager without an error once a function recompiles more often than its
# limit (8 by default), which would make flex numbers worthless: every new shape or block mask
# structure is a recompile. The limits are raised far above any sweep's case count, and where
# torch offers it, hitting a limit raises instead of falling back, so the row records an error.
# Not resetting dynamo between cases lets cases of one shape share a compiled kernel.
_RECOMPILE_LIMIT = 4096
_LIMITS = ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
           "accumulated_cache_size_limit")  # names before and after torch 2.6
_FAIL_FLAGS = ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit")


class FlexBackend(Backend):
    name = "flex"
    description = "torch.compile'd flex_attention; score_mod adds the bias, block_mask from the mask"
    has_lse = True

    def __init__(self):
        self._compiled = None

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "flex needs a CUDA device (its compiled kernels are GPU kernels)"
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except ImportError as exc:
            return f"torch {torch.__version__} has no flex_attention ({exc})"
        return None

    def _flex(self):
        from torch.nn.attention.flex_attention import flex_attention

        config = torch._dynamo.config
        for limit in _LIMITS:
            if hasattr(config, limit):
                setattr(config, limit, max(getattr(config, limit), _RECOMPILE_LIMIT))
        for flag in _FAIL_FLAGS:
            if hasattr(config, flag):
                setattr(config, flag, True)
        try:
            from torch._functorch import config as functorch_config
        except ImportError:
            functorch_config = None
        if hasattr(functorch_config, "donated_buffer"):
            # bwd mode times autograd.grad(..., retain_graph=True) on one forward graph. A
            # backward compiled with donated buffers refuses a retained graph (it raised at
            # L=32768 on the H100); donation only saves memory, so turn it off.
            functorch_config.donated_buffer = False
        if self._compiled is None:
            self._compiled = torch.compile(flex_attention, dynamic=False)
        return self._compiled

    def adapt(self, problem: Problem) -> dict[str, Any]:
        return {"q": _bhld(problem.q), "k": _bhld(problem.k), "v": _bhld(problem.v),
                "mask": problem.mask, "bias": problem.bias}

    def bind(self, adapted: dict[str, Any], case: Case, want_lse: bool) -> Bound:
        from torch.nn.attention.flex_attention import create_block_mask

        flex = self._flex()
        q, k, v, mask, bias = (adapted[n] for n in ("q", "k", "v", "mask", "bias"))
        b, hq, lq, lk = case.batch, case.heads_q, case.seqlen_q, case.seqlen_k
        offset = lk - lq
        device = q.device

        block_mask = None
        build_ms = None
        if mask is not None or case.causal:
            mask_view = None if mask is None else mask.expand(b, mask.shape[1], lq, lk)
            mask_div = 1 if mask is None else hq // mask.shape[1]

            def mask_mod(bi, h, qi, ki):
                keep = ki <= qi + offset if case.causal else ki >= 0
                if mask_view is not None:
                    keep = keep & mask_view[bi, h // mask_div, qi, ki]
                return keep

            compile_arg = {"_compile": True} if "_compile" in inspect.signature(create_block_mask).parameters else {}
            block_mask, build_ms = timed_build(
                lambda: create_block_mask(mask_mod, b, hq, lq, lk, device=device, **compile_arg),
                device)

        score_mod = None
        if bias is not None:
            bias_view = bias.expand(b, bias.shape[1], lq, lk)
            bias_div = hq // bias.shape[1]

            def score_mod(score, bi, h, qi, ki):
                return score + bias_view[bi, h // bias_div, qi, ki]

        lse_kwargs = {}
        if want_lse:
            from torch.nn.attention import flex_attention as flex_module

            # return_lse is deprecated in favour of return_aux where AuxRequest exists.
            aux = getattr(flex_module, "AuxRequest", None)
            lse_kwargs = {"return_aux": aux(lse=True)} if aux is not None else {"return_lse": True}
        gqa = case.heads_q != case.heads_kv

        def call():
            result = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa,
                          **lse_kwargs)
            if not want_lse:
                return result.transpose(1, 2), None
            out, extra = result
            lse = extra.lse if hasattr(extra, "lse") else extra
            return out.transpose(1, 2), lse

        return Bound(call, build_ms)
