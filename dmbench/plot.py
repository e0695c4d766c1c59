"""Speedup and TFLOP/s charts, drawn from a results CSV and nothing else.

For every swept axis (a case parameter with more than one value in the file) and every timed
mode, two PNGs are written: speedup over a baseline backend, and dense-equivalent TFLOP/s. The
other varying parameters split the data into panels, one line per backend in each panel. A file
with a single case is drawn against the case itself.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from .errors import ConfigError
from .results import Row

AXES = ("window", "seqlen_k", "head_dim", "heads", "batch", "mask", "bias", "causal", "dtype")
TIMED = ("fwd", "bwd", "fwd+bwd")
BASELINE_FALLBACKS = ("fdma", "sdpa", "reference")
MAX_PANELS = 12


def _axis_value(row: Row, axis: str):
    if axis == "heads":
        return f"{row.heads_q}/{row.heads_kv}"
    if axis == "seqlen":
        return f"{row.seqlen_q}/{row.seqlen_k}"
    if axis == "q_shape":
        return "Lq=Lk" if row.seqlen_q == row.seqlen_k else f"Lq={row.seqlen_q}"
    if axis == "mask":
        return row.mask if row.mask_shape == "BxHkxLqxLk" else f"{row.mask}[{row.mask_shape}]"
    if axis == "case":
        return row.case_id
    return getattr(row, axis)


def _group_axes(axis: str, varying: list[str]) -> list[str]:
    others = [a for a in varying if a != axis]
    # seqlen_q follows seqlen_k in most sweeps; as a panel key it would give one point per panel.
    return others + (["q_shape"] if axis == "seqlen_k" else ["seqlen"] if "seqlen_k" in varying else [])


def _varying(rows: list[Row]) -> list[str]:
    return [a for a in AXES if len({_axis_value(r, a) for r in rows}) > 1]


def _has_line(rows: list[Row], axis: str, groups: list[str]) -> bool:
    points: dict[tuple, set] = {}
    for r in rows:
        key = (r.backend, r.mode) + tuple(_axis_value(r, g) for g in groups)
        points.setdefault(key, set()).add(_axis_value(r, axis))
    return any(len(xs) > 1 for xs in points.values())


def choose_baseline(rows: list[Row], requested: str | None) -> str | None:
    present = {r.backend for r in rows}
    if requested:
        if requested not in present:
            raise ConfigError(f"--baseline: backend {requested!r} has no timed rows in this file; "
                              f"present: {', '.join(sorted(present))}")
        return requested
    return next((b for b in BASELINE_FALLBACKS if b in present), None)


def _sort_key(value):
    return (0, value, "") if isinstance(value, (int, float)) and not isinstance(value, bool) else (1, 0, str(value))


def _draw(path: Path, title: str, axis: str, panels: dict, ylabel: str, log_y: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    names = sorted(panels, key=str)[:MAX_PANELS]
    cols = min(3, len(names))
    rows_n = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5.2 * cols, 3.8 * rows_n), squeeze=False)
    for ax, name in zip(axes.flat, names):
        series = panels[name]
        xs_all = sorted({x for pts in series.values() for x, _ in pts}, key=_sort_key)
        numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs_all)
        position = {x: (x if numeric else i) for i, x in enumerate(xs_all)}
        for backend in sorted(series):
            pts = sorted(series[backend], key=lambda p: _sort_key(p[0]))
            ax.plot([position[x] for x, _ in pts], [y for _, y in pts], marker="o", label=backend)
        if numeric and len(xs_all) > 1 and xs_all[-1] / max(xs_all[0], 1e-9) >= 8:
            ax.set_xscale("log", base=2)
        if not numeric:
            ax.set_xticks(range(len(xs_all)))
            ax.set_xticklabels([str(x) for x in xs_all], rotation=30, ha="right", fontsize=7)
        if log_y:
            ax.set_yscale("log")
        ax.set_title(textwrap.fill(str(name), 60), fontsize=7)
        ax.set_xlabel(axis)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rows(rows: list[Row], out_dir: Path, stem: str, baseline: str | None) -> list[Path]:
    timed = [r for r in rows if r.mode in TIMED and r.status in ("ok", "accuracy") and r.ms_p50]
    if not timed:
        raise ConfigError(f"{stem}: no timed rows with status ok to plot")
    baseline = choose_baseline(timed, baseline)
    out_dir.mkdir(parents=True, exist_ok=True)
    # An axis is worth a chart when some panel has a line of at least two points along it.
    varying = _varying(timed)
    varying = [a for a in varying if _has_line(timed, a, _group_axes(a, varying))] or ["case"]
    gpu = timed[0].gpu
    written = []
    for mode in [m for m in TIMED if any(r.mode == m for r in timed)]:
        mode_rows = [r for r in timed if r.mode == mode]
        for axis in varying:
            groups = _group_axes(axis, varying)
            base_ms = {r.case_id: r.ms_p50 for r in mode_rows if r.backend == baseline}
            speed, rate = {}, {}
            for r in mode_rows:
                panel = ", ".join(f"{g}={_axis_value(r, g)}" for g in groups) or "all"
                x = _axis_value(r, axis)
                if r.tflops_dense is not None:
                    rate.setdefault(panel, {}).setdefault(r.backend, []).append((x, r.tflops_dense))
                if r.case_id in base_ms:
                    speed.setdefault(panel, {}).setdefault(r.backend, []).append((x, base_ms[r.case_id] / r.ms_p50))
            tag = f"{stem}-{mode.replace('+', '_')}-{axis}"
            title = f"{stem} {mode} on {gpu}"
            if speed:
                path = out_dir / f"{tag}-speedup.png"
                _draw(path, f"{title}: speedup over {baseline} (p50)", axis, speed,
                      f"speedup vs {baseline}", log_y=True)
                written.append(path)
            if rate:
                path = out_dir / f"{tag}-tflops.png"
                _draw(path, f"{title}: dense-equivalent TFLOP/s (p50)", axis, rate, "TFLOP/s", log_y=False)
                written.append(path)
    return written
