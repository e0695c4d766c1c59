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
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .base import Bound

# torch.nn.attention.SDPBackend's members as the row's detail names them.
_KERNEL_NAMES = {"CUDNN_ATTENTION": "cudnn", "FLASH_ATTENTION": "flash",
                 "EFFICIENT_ATTENTION": "efficient", "MATH": "math"}
TRIAL_CALLS = 3  # timed calls per form, after one warm-up call


def sdpa_kernel_name(q, k, v, mask, is_causal: bool, gqa: bool) -> str:
    """The kernel F.scaled_dot_product_attention runs for these arguments: torch's own
    dispatcher decision (``torch._fused_sdp_choice``, the function SDPA itself consults; for a
    lower-right ``CausalBias``, the flash / efficient checks its dispatch makes), ``unknown``
    where this torch offers neither."""
    from torch.nn.attention.bias import CausalBias

    if isinstance(mask, CausalBias):
        return _causal_bias_kernel(q, k, v, gqa)
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return "unknown"
    from torch.nn.attention import SDPBackend

    try:
        choice = SDPBackend(choose(q, k, v, mask, 0.0, is_causal, scale=None, enable_gqa=gqa))
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


@dataclass(frozen=True)
class SdpaForm:
    """One way of calling SDPA: K/V repeated ``repeat`` times over heads (1: not repeated),
    ``enable_gqa`` when K/V keep fewer heads than Q."""
    repeat: int

    @property
    def gqa(self) -> bool:
        return self.repeat == 1

    def describe(self) -> str:
        return "enable_gqa" if self.repeat == 1 else "K/V repeated to Hq heads"


def sdpa_call(q, k, v, mask, is_causal: bool, form: SdpaForm, group: int) -> Callable:
    """The zero-argument call: (out in (B, Lq, Hq, D), None)."""
    gqa = group > 1 and form.gqa

    def call():
        kk = k if form.repeat == 1 else k.repeat_interleave(form.repeat, dim=1)
        vv = v if form.repeat == 1 else v.repeat_interleave(form.repeat, dim=1)
        out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=is_causal,
                                             enable_gqa=gqa)
        return out.transpose(1, 2), None

    return call


def _form_kernel(q, k, v, mask, is_causal: bool, form: SdpaForm, group: int) -> str:
    if form.repeat > 1:
        k, v = (t.repeat_interleave(form.repeat, dim=1) for t in (k, v))
    return sdpa_kernel_name(q, k, v, mask, is_causal, gqa=group > 1 and form.gqa)


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


def bind_sdpa(q, k, v, mask, is_causal: bool, group: int,
              timer: Callable[[Callable, list], float] | None = None) -> Bound:
    """The SDPA call in its faster form (``enable_gqa`` where there is no GQA, on the CPU, or
    where it is at least as fast), with the kernel it runs named for the row's detail."""
    native = SdpaForm(1)
    name = _form_kernel(q, k, v, mask, is_causal, native, group)
    if group == 1 or (timer is None and q.device.type != "cuda"):
        return Bound(sdpa_call(q, k, v, mask, is_causal, native, group),
                     kernel=f"sdpa kernel: {name}")
    timer = timer or trial_ms
    leaves = [t for t in (q, k, v, mask) if isinstance(t, torch.Tensor) and t.requires_grad]
    repeated = SdpaForm(group)
    native_ms = timer(sdpa_call(q, k, v, mask, is_causal, native, group), leaves)
    repeated_ms = timer(sdpa_call(q, k, v, mask, is_causal, repeated, group), leaves)
    if native_ms <= repeated_ms:
        return Bound(sdpa_call(q, k, v, mask, is_causal, native, group),
                     kernel=f"sdpa kernel: {name}")
    repeated_name = _form_kernel(q, k, v, mask, is_causal, repeated, group)
    return Bound(sdpa_call(q, k, v, mask, is_causal, repeated, group),
                 kernel=(f"sdpa kernel: {repeated_name}, {repeated.describe()} (trial: "
                         f"{repeated_ms:.3g} ms; enable_gqa ran {name} in {native_ms:.3g} ms)"))
