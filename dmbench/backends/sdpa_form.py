"""SDPA in the form a competent user would run it, and the kernel it runs.

For a GQA case there are two ways to call ``F.scaled_dot_product_attention``:

- ``enable_gqa=True`` with K/V at their own Hk heads (torch >= 2.5);
- K/V repeated to Hq heads (``repeat_interleave`` inside the call, as a model without GQA support
  does on every call), no ``enable_gqa``.

Which is faster depends on the kernel torch's dispatcher picks for each. Measured on the H100
(torch 2.11, bf16): a forward with a float mask runs cuDNN either way; a backward through a
float mask that needs a gradient runs the math kernel under ``enable_gqa`` (2.6-4x slower than
the memory-efficient kernel the repeated form gets), while decode (Lq = 1) backward is faster
under ``enable_gqa`` (math 17 ms against efficient 204 ms at B8 H32/8 Lk32768). A user who cares
about speed picks the faster form, so on a CUDA device both are timed once, untimed by the
sweep, and the faster one is bound. Each row's ``detail`` names the kernel that ran, and when
the repeated form won, both forms' times.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from .base import Bound

# torch.nn.attention.SDPBackend's members as the row's detail names them.
_KERNEL_NAMES = {"CUDNN_ATTENTION": "cudnn", "FLASH_ATTENTION": "flash",
                 "EFFICIENT_ATTENTION": "efficient", "MATH": "math"}
TRIAL_CALLS = 3  # timed calls per form, after one warm-up call


def _gqa(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether K/V (B, Hk, Lk, D) have fewer heads than Q, so SDPA needs ``enable_gqa``."""
    return k.shape[1] != q.shape[1]


def _repeated(t: torch.Tensor, repeat: int) -> torch.Tensor:
    return t if repeat == 1 else t.repeat_interleave(repeat, dim=1)


def sdpa_kernel_name(q, k, v, mask, is_causal: bool) -> str:
    """The kernel F.scaled_dot_product_attention runs for these arguments (``enable_gqa`` where
    K/V have fewer heads than Q): torch's own dispatcher decision (``torch._fused_sdp_choice``,
    the function SDPA itself consults; for a lower-right ``CausalBias``, the flash / efficient
    checks its dispatch makes), ``unknown`` where this torch offers neither."""
    from torch.nn.attention.bias import CausalBias

    if isinstance(mask, CausalBias):
        return _causal_bias_kernel(q, k, v, _gqa(q, k))
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return "unknown"
    from torch.nn.attention import SDPBackend

    try:
        choice = SDPBackend(choose(q, k, v, mask, 0.0, is_causal, scale=None,
                                   enable_gqa=_gqa(q, k)))
    except (RuntimeError, TypeError, ValueError) as exc:
        return f"unknown ({type(exc).__name__})"
    return _KERNEL_NAMES.get(choice.name, choice.name.lower())


def _causal_bias_kernel(q, k, v, gqa: bool) -> str:
    try:
        from torch.backends.cuda import (SDPAParams, can_use_efficient_attention,
                                         can_use_flash_attention)

        params = SDPAParams(q, k, v, None, 0.0, False, gqa)
    except (ImportError, RuntimeError, TypeError) as exc:
        return f"unknown ({type(exc).__name__})"
    if can_use_flash_attention(params):
        return "flash"
    return "efficient" if can_use_efficient_attention(params) else "math"


def sdpa_call(q, k, v, mask, is_causal: bool, repeat: int = 1) -> Callable:
    """The zero-argument call, (out in (B, Lq, Hq, D), None): K/V repeated ``repeat`` times over
    heads inside the call (1: not repeated), ``enable_gqa`` while they have fewer heads than Q."""

    def call():
        kk, vv = _repeated(k, repeat), _repeated(v, repeat)
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=is_causal,
                                             enable_gqa=_gqa(q, kk))
        return out.transpose(1, 2), None

    return call


def sdpa_bound(q, k, v, mask, is_causal: bool, repeat: int = 1, note: str = "") -> Bound:
    """``sdpa_call`` with the kernel it runs named for the row's detail, then ``note``."""
    name = sdpa_kernel_name(q, _repeated(k, repeat), _repeated(v, repeat), mask, is_causal)
    return Bound(sdpa_call(q, k, v, mask, is_causal, repeat), kernel=f"sdpa kernel: {name}{note}")


def trial_ms(call: Callable, leaves: list[torch.Tensor]) -> float:
    """Median wall milliseconds of ``call`` (with the backward when ``leaves`` need grad) over
    TRIAL_CALLS calls after one warm-up; inf if the form does not fit in memory or fails."""
    def step():
        out = call()[0]
        if leaves:
            torch.autograd.grad(out, leaves, torch.ones_like(out))

    try:
        step()
        times = []
        for _ in range(TRIAL_CALLS):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    except (torch.cuda.OutOfMemoryError, RuntimeError):
        return float("inf")
    finally:
        torch.cuda.empty_cache()
    return sorted(times)[len(times) // 2]


def bind_sdpa(q, k, v, mask, is_causal: bool,
              timer: Callable[[Callable, list], float] | None = None) -> Bound:
    """The SDPA call in its faster form: ``enable_gqa`` where K/V have as many heads as Q, on the
    CPU, or where it is at least as fast as K/V repeated to Q's heads (``timer``, by default
    ``trial_ms``, times both)."""
    group = q.shape[1] // k.shape[1]
    if group == 1 or (timer is None and q.device.type != "cuda"):
        return sdpa_bound(q, k, v, mask, is_causal)
    timer = timer or trial_ms
    leaves = [t for t in (q, k, v, mask) if isinstance(t, torch.Tensor) and t.requires_grad]
    native_ms = timer(sdpa_call(q, k, v, mask, is_causal), leaves)
    repeated_ms = timer(sdpa_call(q, k, v, mask, is_causal, repeat=group), leaves)
    if native_ms <= repeated_ms:
        return sdpa_bound(q, k, v, mask, is_causal)
    native = sdpa_kernel_name(q, k, v, mask, is_causal)
    return sdpa_bound(q, k, v, mask, is_causal, repeat=group,
                      note=(f", K/V repeated to Hq heads (trial: {repeated_ms:.3g} ms; "
                            f"enable_gqa ran {native} in {native_ms:.3g} ms)"))
