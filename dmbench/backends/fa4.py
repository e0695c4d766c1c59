"""FlashAttention-4 (``flash-attn-4``, CuTe DSL; sm90 and sm100 forward and backward), when its
``flash_attn.cute`` package imports: the fastest public Hopper attention, as a peer.

It runs each case in the form a user of its API would write it, and only where that form
computes the case's exact math:

- dense attention, causal or not (bottom-right aligned, as ours), GQA and MQA natively;
- ``sliding`` masks under causality: ``window_size=(window - 1, 0)``, each row's ``window``
  latest visible keys, the mask ours takes as a bool tensor or intervals;
- ``document`` masks in every format: ``flash_attn_varlen_func`` over the documents packed
  end to end (the batch's rows one after another), causal within a document when the case is;
- head dims its sm90 kernels take (8 to 256, multiples of 8 in 16 bits), fp16 and bf16.

Everything else is skipped with the reason: a bias (it has no gradient for one: its
``score_mod_bwd`` differentiates through a score modifier, and aux tensors get none), and masks
it cannot read as they are (top-W, block-sparse and random masks would need a CuTe DSL
``mask_mod`` over the dense mask plus its block-sparse index tensors; a non-causal ``sliding``
mask is a fixed set of keys, not a window relative to each row).

Its kernels compile on first use per form (seconds each), in the warm-up calls like every
backend's. Install: ``pip install flash-attn-4`` (the ``fa4`` extra) on a machine with CUDA 12.9+
and an sm90 or newer GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from ..case import Case
from ..problem import Problem
from .base import Backend, Bound
from .dmattn import import_error

MODULE = "flash_attn.cute"
HINT = "install the fa4 extra (pip install flash-attn-4)"
MIN_CAPABILITY = (9, 0)


def fa4_gap(case: Case) -> str | None:
    """Why FlashAttention-4's API cannot express ``case`` exactly, or None."""
    if case.dtype not in ("bf16", "fp16"):
        return f"fa4 takes fp16 and bf16 only, got {case.dtype}"
    if case.head_dim % 8 or not 8 <= case.head_dim <= 256:
        return f"fa4 takes head dims 8 to 256 in multiples of 8, got {case.head_dim}"
    if case.bias != "none":
        return ("fa4 has no bias gradient (score_mod_bwd differentiates a score modifier; aux "
                "tensors get no gradient)")
    if case.mask == "sliding" and not case.causal:
        return "fa4's windows are relative to each row; a non-causal sliding mask is fixed keys"
    if case.mask not in ("none", "sliding", "document"):
        return (f"fa4 cannot read a {case.mask} mask as it is (it would need a CuTe DSL mask_mod "
                "over the dense mask and its block-sparse index tensors)")
    return None


class Fa4Backend(Backend):
    name = "fa4"
    description = ("FlashAttention-4 (flash_attn.cute, CuTe DSL; peer): dense, causal, causal "
                   "sliding windows (window_size), GQA natively, documents through "
                   "flash_attn_varlen_func; no bias")
    has_lse = True
    takes_mask = False  # it reads a window size or document offsets, never the built mask

    def unavailable_reason(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "fa4 needs a CUDA device (its kernels are CuTe DSL GPU kernels)"
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            return f"fa4 needs compute capability 9.0 or newer, this device has {capability}"
        missing = import_error(MODULE)
        return f"{missing}; {HINT}" if missing else None

    def skip_reason(self, case: Case) -> str | None:
        return fa4_gap(case)

    def adapt(self, problem: Problem) -> dict[str, Any]:
        adapted = {"q": problem.q, "k": problem.k, "v": problem.v, "bias": None}
        if problem.case.mask == "document":
            adapted["documents"] = document_offsets(problem)
        return adapted

    def bind(self, adapted: dict[str, Any], case: Case, want_lse: bool) -> Bound:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        q, k, v = adapted["q"], adapted["k"], adapted["v"]
        if "documents" in adapted:
            return _bind_documents(flash_attn_varlen_func, q, k, v, adapted["documents"], case,
                                   want_lse)
        window = (case.window - 1, 0) if case.mask == "sliding" else (None, None)

        def call():
            out, lse = flash_attn_func(q, k, v, causal=case.causal, window_size=window,
                                       return_lse=want_lse)
            return out, (lse if want_lse else None)

        kernel = f"fa4 window_size={window}" if case.mask == "sliding" else "fa4 dense"
        return Bound(call, kernel=kernel)


def document_offsets(problem: Problem) -> tuple[torch.Tensor, int]:
    """(int32 offsets of every non-empty document over the B·L packed tokens, the longest)."""
    documents = problem.documents
    lengths = [n for row in documents.lengths for n in row if n > 0]
    offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    return offsets.to(device=problem.q.device, dtype=torch.int32), max(lengths)


def _bind_documents(varlen_func, q, k, v, documents, case: Case, want_lse: bool) -> Bound:
    """The documents as packed sequences: (B, L, H, D) viewed as (B·L, H, D), one sequence per
    document; out viewed back, LSE (Hq, B·L) as (B, Hq, L)."""
    offsets, longest = documents
    batch, length = case.batch, case.seqlen_q

    def packed(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])

    pq, pk, pv = packed(q), packed(k), packed(v)

    def call():
        out, lse = varlen_func(pq, pk, pv, cu_seqlens_q=offsets, cu_seqlens_k=offsets,
                               max_seqlen_q=longest, max_seqlen_k=longest, causal=case.causal,
                               return_lse=want_lse)
        out = out.view(batch, length, *out.shape[1:])
        if want_lse and lse is not None:
            lse = lse.view(lse.shape[0], batch, length).transpose(0, 1)
        return out, (lse if want_lse else None)

    return Bound(call, kernel="fa4 varlen (documents packed)")
