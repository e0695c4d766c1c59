"""The backends, as one explicit name -> object mapping. Nothing registers itself at import.

Importing this package imports neither ``kernels`` nor Triton: backends import what they need
when they are asked about availability or bound to a case, after the CLI has chosen the device
(and, on CPU, turned on the Triton interpreter).
"""

from __future__ import annotations

from .base import DIFF_KEYS, Backend, Bound
from .dmattn import (BaselineBackend, PerCallBackend, ReferenceBackend, SelectingBackend,
                     TritonBackend)
from .fa4 import Fa4Backend
from .fdma import FdmaBackend
from .torch_ops import FlexBackend, SdpaBackend, SdpaDenseBackend


def make_backends() -> dict[str, Backend]:
    """A fresh mapping per run (flex keeps its compiled function on the instance)."""
    backends = (TritonBackend(), SelectingBackend(), PerCallBackend(), SdpaBackend(),
                SdpaDenseBackend(), FlexBackend(), FdmaBackend(), Fa4Backend(), ReferenceBackend(),
                BaselineBackend())
    return {b.name: b for b in backends}


BACKEND_NAMES = ("triton", "triton-select", "triton-per-call", "sdpa", "sdpa-dense", "flex",
                 "fdma", "fa4", "reference", "triton-base")

__all__ = ["BACKEND_NAMES", "DIFF_KEYS", "Backend", "Bound", "make_backends"]
