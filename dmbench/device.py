"""Choosing the device, and the Triton interpreter on CPU.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it must be set
before ``kernels`` is first imported. ``select_device`` is called by the CLI before any backend
touches ``kernels``; it only sets the variable when the user has not.
"""

from __future__ import annotations

import os

import torch

from .errors import ConfigError

CPU_NOTE = ("CPU run: Triton kernels execute under the interpreter (TRITON_INTERPRET=1). "
            "CPU timings are NOT performance numbers; they only show that the harness works.")


def select_device(requested: str = "auto", local_rank: int | None = None) -> torch.device:
    """``auto`` picks CUDA when present, else CPU. ``local_rank`` pins cuda:<local_rank>."""
    if requested not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"--device: expected auto, cuda or cpu, got {requested!r}")
    use_cuda = torch.cuda.is_available() if requested == "auto" else requested == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here")
    if not use_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return torch.device("cpu")
    index = 0 if local_rank is None else local_rank
    if index >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK {index} has no GPU: only {torch.cuda.device_count()} visible")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class DeviceFault(Exception):
    """The CUDA context died (an illegal address, a device-side assert): every later kernel in
    this process fails too, so the sweep can only go on in a fresh process."""


def context_alive(device: torch.device) -> bool:
    """Whether ``device`` still runs kernels. Used after a failure, to tell an error confined to
    one point (a bad argument, an OOM) from one that poisoned the whole CUDA context."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return torch.ones(1, device=device).add_(1).item() == 2.0
    except Exception:  # the errors a dead context raises vary by torch version
        return False
