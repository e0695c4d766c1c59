"""Our rows behind the best peer, and how near each runs to the GPU's limits: TFLOP/s on kept
pairs and GB/s of compulsory bytes (``dmbench.traffic``) as shares of the datasheet peaks, and
the bound those shares point to (compute, memory or latency). The headline counts these rows
by bound; the tables list each one.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .collected import (TIMED_MODES, Collected, case_label, sweep_label,
                        timing_suffix)
from .results import row_case
from .traffic import PEAK_RATES, gbps

# A call whose compute and memory rates both stay under this share of the GPU's peaks is bound
# by neither: its time goes to the host, launch latency or a grid too small to fill the GPU.
LATENCY_SHARE = 0.2
SIXTEEN_BIT = ("bf16", "fp16")
CUDA_GRAPH_TIMING = "cuda_graph"


@dataclass(frozen=True)
class ShortRow:
    """One of our rows behind the best peer, with its rates against the GPU's peaks."""

    sweep: str
    mode: str
    label: str
    ratio: float  # the best peer's median time over ours
    peer: str
    ms: float
    graph_ms: float | None  # the same case timed as CUDA graph replays, where a run has it
    tflops: float | None  # on kept pairs (tflops_active)
    gbps: float | None  # compulsory bytes (dmbench.traffic)
    compute_share: float | None
    memory_share: float | None

    @property
    def bound(self) -> str:
        """compute, memory or latency (neither share reaches LATENCY_SHARE); a dash when the
        GPU's peaks are not known."""
        shares = (self.compute_share, self.memory_share)
        if all(share is None for share in shares):
            return "–"
        compute, memory = (share or 0.0 for share in shares)
        if max(compute, memory) < LATENCY_SHARE:
            return "latency"
        return "compute" if compute >= memory else "memory"


def _share(value: float | None, peak: float | None) -> float | None:
    return None if value is None or not peak else value / peak


def short_rows(collected: Collected) -> list[ShortRow]:
    """Every (sweep, mode, case) where a peer's median time is below ours; per sweep and mode,
    the furthest behind first."""
    ours = {(sweep_label(r), r.mode, case_label(r)): r for r in collected.rows
            if r.backend == "triton"}
    peaks = PEAK_RATES.get(collected.gpu)
    found = []
    for (sweep, mode), cases in collected.tables.items():
        for label, times in cases.items():
            best = collected.best_peer(label, times)
            if best is None or best[0] >= 1:
                continue
            row = ours[(sweep, mode, label)]
            graph = (None if row.timing == CUDA_GRAPH_TIMING else
                     ours.get((row.sweep + timing_suffix(CUDA_GRAPH_TIMING), mode, label)))
            kept = 1.0 if row.active_fraction is None else row.active_fraction
            rate = gbps(row_case(row), mode, row.ms_p50, kept)
            compute_peak = peaks.tflops_16bit if peaks and row.dtype in SIXTEEN_BIT else None
            found.append(ShortRow(
                sweep, mode, label, best[0], best[1], row.ms_p50,
                None if graph is None else graph.ms_p50, row.tflops_active, rate,
                _share(row.tflops_active, compute_peak), _share(rate, peaks and peaks.gbps)))
    return sorted(found, key=lambda r: (r.sweep, TIMED_MODES.index(r.mode), r.ratio))


def short_rows_line(collected: Collected) -> list[str]:
    """The headline's count of rows behind the best peer, by what bounds them."""
    rows = short_rows(collected)
    if not rows:
        return ["- No row is behind the best peer."]
    bounds = defaultdict(int)
    for row in rows:
        bounds[row.bound] += 1
    parts = ", ".join(f"{count} {bound}" for bound, count in sorted(bounds.items()))
    return [f"- Behind the best peer: {len(rows)} (sweep, mode, case) rows, by what bounds them: "
            f"{parts} (the tables list each with its TFLOP/s and GB/s)."]


def _percent(share: float | None) -> str:
    return "–" if share is None else f"{share:.0%}"


def _number(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def short_rows_markdown(collected: Collected) -> list[str]:
    """Each row behind the best peer: the ratio, our rates and shares of the GPU's peaks, and
    the bound they point to."""
    rows = short_rows(collected)
    peaks = PEAK_RATES.get(collected.gpu)
    peak_text = (f"{peaks.tflops_16bit:g} dense 16-bit TFLOP/s and {peaks.gbps:g} GB/s" if peaks
                 else "not known for this GPU (no shares and no bound)")
    head = [f"\n**Rows behind the best peer** ({len(rows)})\n",
            "Our median time against the best peer's, with our TFLOP/s on kept pairs "
            "(`tflops_active`) and our GB/s of compulsory bytes (every input read and every "
            "output written once, the mask at the share of pairs it keeps; "
            f"`dmbench/traffic.py`) as shares of the GPU's datasheet peaks ({peak_text}). "
            "**bound** is the resource with the larger share; `latency` where neither reaches "
            f"{LATENCY_SHARE:.0%}: host time, launches or a grid too small to fill the GPU. "
            "Both rates are floors: a mask that keeps pairs scattered over a tile makes the "
            "kernel compute the whole tile. **as graph**: our time for the same case timed as "
            "CUDA graph replays, where a run has it.\n"]
    if not rows:
        return head[:1] + ["No row is behind the best peer."]
    lines = ["| sweep, mode | case | vs best peer | ours ms | as graph ms | TFLOP/s | of peak | "
             "GB/s | of peak | bound |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.sweep}, {r.mode} | {r.label} | {r.ratio:.2f}× ({r.peer}) | "
                     f"{r.ms:.3f} | {_number(r.graph_ms, 3)} | {_number(r.tflops, 0)} | "
                     f"{_percent(r.compute_share)} | {_number(r.gbps, 0)} | "
                     f"{_percent(r.memory_share)} | {r.bound} |")
    return head + lines
