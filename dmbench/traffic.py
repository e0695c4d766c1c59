"""The one memory-traffic model, and the peak rates of the GPUs the results come from.

Compulsory bytes count every tensor a call is given and every tensor it returns, each read or
written once:

- forward: q, k, v, the mask and the bias read; the output and its log-sum-exp written;
- backward: q, k, v, the output, its gradient, the log-sum-exp, the mask and the bias read;
  dq, dk, dv and the bias gradient written;
- fwd+bwd: both.

The mask counts at the fraction of pairs it keeps (``kept_fraction``): a kernel need not read
it where it skips whole tiles, so only the kept pairs' share of it is compulsory.

That is a floor: a kernel that reads k and v again for every query tile moves more. A call's
GB/s against this floor, beside its TFLOP/s, says how near it runs to either limit of the
hardware; when neither rate comes near its peak, the time goes to the host (Python, launches,
allocations), to launch latency, or to a grid too small to fill the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .case import Case, shape_from_tokens

ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
LSE_BYTES = 4  # float32 per (batch, query head, row)
INTERVAL_BYTES = 8  # int32 start and end per key
# The (batch, head) extent of the intervals dmbench builds per mask kind (dmbench.masks,
# dmbench.documents): topk per (B, Hk) from its per-key score, documents per batch row, one
# sliding window for all.
INTERVAL_EXTENT = {"topk": ("B", "Hk"), "document": ("B", "1"), "sliding": ("1", "1")}
# Documents packed as varlen carry only their offsets (n + 1 int32 per batch row): no per-key
# tensor, counted as nothing.


def _elements(tokens: str, case: Case) -> int:
    return math.prod(shape_from_tokens(tokens, case))


def mask_bytes(case: Case) -> int:
    """What the mask the call is given occupies, in the case's format, all of it."""
    if case.mask == "none" or case.mask_format == "varlen":
        return 0
    if case.mask_format == "intervals":
        batch, heads = INTERVAL_EXTENT[case.mask]
        return _elements(f"{batch}x{heads}x1xLk", case) * INTERVAL_BYTES
    return _elements(case.mask_shape, case)  # one byte per bool


def compulsory_bytes(case: Case, mode: str, kept_fraction: float = 1.0) -> float:
    """The floor of bytes one call of ``mode`` moves (see the module docstring);
    ``kept_fraction``: the share of (query, key) pairs the mask and causality keep."""
    element = ELEMENT_BYTES[case.dtype]
    rows = case.batch * case.heads_q * case.seqlen_q
    query = rows * case.head_dim * element  # q, the output and each of their gradients
    key = case.batch * case.heads_kv * case.seqlen_k * case.head_dim * element  # k or v
    lse = rows * LSE_BYTES
    bias = _elements(case.bias_shape, case) * element if case.bias_shape else 0
    given = mask_bytes(case) * kept_fraction + bias
    forward = (query + 2 * key + given) + (query + lse)  # read q, k, v; write out, lse
    # read q, out, its gradient, k, v, lse; write dq, dk, dv and the bias gradient
    backward = (3 * query + 2 * key + lse + given) + (query + 2 * key + bias)
    return {"fwd": forward, "bwd": backward, "fwd+bwd": forward + backward}[mode]


def gbps(case: Case, mode: str, ms: float | None, kept_fraction: float = 1.0) -> float | None:
    """Compulsory GB/s (10^9 bytes per second) of a call that took ``ms``."""
    if ms is None or ms <= 0:
        return None
    return compulsory_bytes(case, mode, kept_fraction) / (ms * 1e-3) / 1e9


@dataclass(frozen=True)
class PeakRates:
    """A GPU's datasheet peaks: dense 16-bit tensor-core TFLOP/s (no structured sparsity) and
    memory GB/s."""

    tflops_16bit: float
    gbps: float


# NVIDIA's datasheet figures, keyed by the name torch reports (the ``gpu`` column). Only exact
# names: an NVL or PCIe card of the same chip has other clocks and memory.
PEAK_RATES = {
    "NVIDIA H100 80GB HBM3": PeakRates(tflops_16bit=989.4, gbps=3350.0),
    "NVIDIA H100 PCIe": PeakRates(tflops_16bit=756.5, gbps=2000.0),
    "NVIDIA H200": PeakRates(tflops_16bit=989.4, gbps=4800.0),
}
