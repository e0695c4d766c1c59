"""PyTorch peers: SDPA with a float mask, dense SDPA (the ceiling), and FlexAttention."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

from ..case import Case
from ..problem import Problem
from ..mask_views import dense_mask, is_intervals
from .base import (Backend, Bound, causal_keep, dtype_size, pairs_bytes, per_query_head,
                   timed_build)
from .sdpa_form import bind_sdpa, sdpa_bound


def _bhld(t: torch.Tensor) -> torch.Tensor:
    """(B, L, H, D) -> (B, H, L, D) as a view: the layout SDPA and flex take."""
    return t.transpose(1, 2)


def _causal_mask_arg(case: Case, device):
    """(attn_mask, is_causal) for causality alone. SDPA's own is_causal is top-left aligned, so
    unequal lengths need the lower-right bias; a single query row (decode) sees every key under
    bottom-right causality, so it gets no mask at all, as a decoding user calls it."""
    from torch.nn.attention.bias import causal_lower_right

    if not case.causal or case.seqlen_q == 1:
        return None, False
    if case.seqlen_q == case.seqlen_k:
        return None, True
    return causal_lower_right(case.seqlen_q, case.seqlen_k), False


class SdpaBackend(Backend):
    name = "sdpa"
    description = ("F.scaled_dot_product_attention with a float mask built from mask (intervals "
                   "expanded) and bias; GQA through enable_gqa or repeated K/V, whichever is faster "
                   "(sdpa_form); the kernel it ran is in each row's detail")

    def dense_bytes(self, case: Case, mode: str) -> int:
        if case.mask == "none" and case.bias == "none":
            return 0  # causality alone runs a flash kernel, no mask
        # The float mask, and in a backward its gradient.
        return pairs_bytes(case, case.heads_q, dtype_size(case), 1 if mode == "fwd" else 2)

    def adapt(self, problem: Problem) -> dict[str, Any]:
        case = problem.case
        # K and V keep their Hk heads here; bind picks enable_gqa or repeated K/V (sdpa_form).
        # The float mask has Hq heads (or 1), since SDPA broadcasts it to (B, Hq, Lq, Lk).
        adapted = {"q": _bhld(problem.q), "k": _bhld(problem.k), "v": _bhld(problem.v),
                   "bias": None, "attn_mask": None, "is_causal": False}
        if problem.mask is None and problem.bias is None:
            adapted["attn_mask"], adapted["is_causal"] = _causal_mask_arg(case, problem.q.device)
            return adapted
        float_mask, adapted["build"] = timed_build(lambda: _float_mask(problem),
                                                   problem.q.device, "float mask")
        # With a bias the float mask carries it, so it is the tensor the backward differentiates.
        adapted["bias" if problem.bias is not None else "attn_mask"] = float_mask
        return adapted

    def bind(self, adapted: dict[str, Any], case: Case, want_lse: bool) -> Bound:
        mask = adapted["bias"] if adapted["bias"] is not None else adapted["attn_mask"]
        return bind_sdpa(adapted["q"], adapted["k"], adapted["v"], mask, adapted["is_causal"])


def _float_mask(problem: Problem) -> torch.Tensor:
    """SDPA's additive mask: the bias (or 0) where the mask and causality keep, -inf elsewhere."""
    case = problem.case
    keep = causal_keep(case, problem.q.device) if case.causal else None
    mask = dense_mask(case, problem.mask)
    if mask is not None:
        mask = per_query_head(mask, case.heads_q)
        keep = mask if keep is None else mask & keep
    if problem.bias is None:
        zero = torch.zeros((), dtype=problem.q.dtype, device=problem.q.device)
        return torch.where(keep, zero, float("-inf"))
    bias = per_query_head(problem.bias, case.heads_q)
    return bias if keep is None else torch.where(keep, bias, float("-inf"))


class SdpaDenseBackend(Backend):
    name = "sdpa-dense"
    description = "F.scaled_dot_product_attention without mask or bias (causal only): the ceiling"
    exact = False
    takes_mask = False

    def adapt(self, problem: Problem) -> dict[str, Any]:
        attn_mask, is_causal = _causal_mask_arg(problem.case, problem.q.device)
        return {"q": _bhld(problem.q), "k": _bhld(problem.k), "v": _bhld(problem.v),
                "attn_mask": attn_mask, "is_causal": is_causal}

    def bind(self, adapted: dict[str, Any], case: Case, want_lse: bool) -> Bound:
        return sdpa_bound(adapted["q"], adapted["k"], adapted["v"], adapted["attn_mask"],
                          adapted["is_causal"])


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
    """flex_attention as its documentation recommends: compiled, ``enable_gqa`` for GQA, its own
    BlockMask, default kernel options (its docs: "most users will not need to specify these
    options as the default autotuning provides good performance"); ``USE_TMA`` and
    ``BACKEND="FLASH"`` are experimental in torch 2.11 and not used."""

    name = "flex"
    description = ("torch.compile'd flex_attention; score_mod adds the bias, block_mask from a "
                   "mask_mod over the bool mask, the intervals' start/end or the documents' ids")
    has_lse = True

    def __init__(self, compiled: bool = True):
        """``compiled=False`` runs flex_attention and create_block_mask eagerly (any device;
        materializes the scores): for checking the mask_mods on the CPU."""
        self.compiled = compiled
        self._compiled = None

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "flex needs a CUDA device (its compiled kernels are GPU kernels)"
        try:
            importlib.import_module("torch.nn.attention.flex_attention")
        except ImportError as exc:
            return f"torch {torch.__version__} has no flex_attention ({exc})"
        return None

    def _flex(self):
        from torch.nn.attention.flex_attention import flex_attention

        if not self.compiled:
            return flex_attention
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
                "mask": problem.mask, "bias": problem.bias, "documents": problem.documents}

    def _block_mask(self, adapted: dict[str, Any], case: Case, device):
        """(the BlockMask of the case's mask and causality, its build step), or (None, None)
        when there is neither. One mask_mod serves the warm-up and the timed build, so the
        compiled build is reused as it would be across calls."""
        from torch.nn.attention.flex_attention import create_block_mask

        mask = adapted["mask"]
        if mask is None and not case.causal:
            return None, None
        mask_mod, batch, heads = _mask_mod(case, mask, adapted["documents"], device)
        compile_arg = ({"_compile": True} if self.compiled and "_compile" in
                       inspect.signature(create_block_mask).parameters else {})
        return timed_build(lambda: create_block_mask(mask_mod, batch, heads, case.seqlen_q,
                                                     case.seqlen_k, device=device, **compile_arg),
                           device, "create_block_mask")

    def bind(self, adapted: dict[str, Any], case: Case, want_lse: bool) -> Bound:
        flex = self._flex()
        q, k, v, bias = (adapted[n] for n in ("q", "k", "v", "bias"))
        b, hq, lq, lk = case.batch, case.heads_q, case.seqlen_q, case.seqlen_k
        block_mask, build = self._block_mask(adapted, case, q.device)

        score_mod = None
        if bias is not None:
            score_mod = _bias_score_mod(bias.expand(b, bias.shape[1], lq, lk), hq // bias.shape[1])

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

        return Bound(call, build)


def _bias_score_mod(bias_view: torch.Tensor, heads_per_bias_head: int):
    """flex's score_mod adding a (B, Hb, Lq, Lk) bias view; query head h reads bias head
    h // heads_per_bias_head."""
    def score_mod(score, bi, h, qi, ki):
        return score + bias_view[bi, h // heads_per_bias_head, qi, ki]

    return score_mod


def _mask_mod(case: Case, mask, documents, device):
    """(mask_mod, batch, heads) for create_block_mask: the case's mask and causality over
    captured tensors (the bool mask; the intervals' start and end; for the varlen format each
    position's document id, made here in O(B·L) from the documents' lengths). A mask shared by the batch or the heads gives a block
    mask of batch or heads 1, which flex broadcasts."""
    b, hq, lq, lk = case.batch, case.heads_q, case.seqlen_q, case.seqlen_k
    offset = lk - lq

    def causal(qi, ki):
        return ki <= qi + offset if case.causal else ki >= 0

    if case.mask_format == "varlen":
        ids = documents.ids(device)

        def document_mod(bi, h, qi, ki):
            return causal(qi, ki) & (ids[bi, qi] == ids[bi, ki])

        return document_mod, b, 1
    if mask is None:
        return (lambda bi, h, qi, ki: causal(qi, ki)), 1, 1
    mask_b, mask_h = mask.shape[:2]
    div = hq // mask_h
    if is_intervals(mask):
        start = mask.start.expand(b, mask_h, lk)
        end = mask.end.expand(b, mask_h, lk)

        def mask_mod(bi, h, qi, ki):
            head = h // div
            return causal(qi, ki) & (start[bi, head, ki] <= qi) & (qi < end[bi, head, ki])
    else:
        view = mask.expand(b, mask_h, lq, lk)

        def mask_mod(bi, h, qi, ki):
            return causal(qi, ki) & view[bi, h // div, qi, ki]

    return mask_mod, (b if mask_b > 1 else 1), (hq if mask_h > 1 else 1)
