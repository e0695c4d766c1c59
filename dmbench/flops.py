"""The one FLOP model.

Forward attention does two matrix products of 2·D FLOPs per (query, key) pair, so a dense forward
is ``4·B·Hq·Lq·Lk·D``. Backward does five products (2.5× forward) and fwd+bwd 3.5×.

- Dense-equivalent FLOPs count every pair, scaled only by the exact fraction of pairs that
  bottom-right causality leaves visible. This is how flash-attn reports TFLOP/s, so numbers are
  comparable with theirs and across backends.
- Active FLOPs count only the pairs the mask keeps (and causality allows). For a sparse mask this
  is the work that had to be done.
"""

from __future__ import annotations

from .case import Case

# "equiv" runs a forward and a backward per backend, so it costs (and balances) like fwd+bwd.
MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5, "equiv": 3.5}


def causal_visible_pairs(seqlen_q: int, seqlen_k: int) -> int:
    """Number of (i, j) with j <= i + (Lk - Lq), 0 <= j < Lk: bottom-right aligned causality."""
    offset = seqlen_k - seqlen_q
    # Row i sees min(max(i + offset + 1, 0), Lk) keys. Rows split into three runs: none visible,
    # a growing prefix, and all keys; the middle run is an arithmetic series.
    first_growing = max(0, -offset)              # first row with at least one key
    first_full = min(seqlen_q, max(0, seqlen_k - 1 - offset))  # first row seeing all Lk keys
    total = 0
    if first_full > first_growing:
        lo = first_growing + offset + 1
        hi = first_full - 1 + offset + 1
        total += (lo + hi) * (first_full - first_growing) // 2
    total += (seqlen_q - max(first_full, first_growing)) * seqlen_k
    return total


def visible_pairs(case: Case) -> int:
    """(query, key) pairs per (batch, head) that causality allows; Lq·Lk when not causal."""
    if case.causal:
        return causal_visible_pairs(case.seqlen_q, case.seqlen_k)
    return case.seqlen_q * case.seqlen_k


def dense_flops(case: Case, mode: str) -> float:
    pairs = case.batch * case.heads_q * visible_pairs(case)
    return 4.0 * pairs * case.head_dim * MODE_FACTOR[mode]


def active_flops(case: Case, kept_pairs: int, mode: str) -> float:
    """``kept_pairs`` counts kept (batch, query head, i, j) entries, as the problem reports it."""
    return 4.0 * kept_pairs * case.head_dim * MODE_FACTOR[mode]


def tflops(flop: float, ms: float | None) -> float | None:
    if ms is None or ms <= 0:
        return None
    return flop / (ms * 1e-3) / 1e12


def estimated_cost(case: Case, modes: tuple[str, ...], n_backends: int) -> float:
    """A relative cost for load balancing across ranks: dense FLOPs over all modes and backends.

    A constant per-point overhead keeps tiny points from counting as free: warmup, compilation
    and input generation cost time whatever the size.
    """
    per_point_overhead = 4.0 * 1024 * 1024 * 128  # roughly one 1k x 1k x D128 forward
    work = sum(dense_flops(case, m) for m in modes)
    return n_backends * (work + per_point_overhead * len(modes))
