"""Speedup, TFLOP/s, memory and mask-build charts, drawn from a results CSV and nothing else.

For every swept axis (a case parameter along which some points differ in that parameter alone)
and every timed mode, two PNGs are written: speedup over a baseline backend, and
dense-equivalent TFLOP/s; where rows record them, also ``memory`` (``peak_mib``: what one call
allocates above its inputs) and, once per file (its first mode, since the mask is built once
per point whatever is timed), ``build`` (``build_ms``: the mask's build). Points are joined by a line only when every other case parameter is
equal. The other parameters that vary split the points into panels (up to ``MAX_PANELS`` per
figure) and, past that, into separate series whose legend names the values that differ. When no
axis has two such points, the cases themselves are the x axis and nothing is joined.

Each backend keeps one colour and marker in every chart (``backend_style``), whatever order the
rows come in. Titles name the sweep (the CSV's ``sweep`` column, else the file name without its
``-fwd``/``-bwd``/``-equiv`` suffix); files are named ``<sweep>-<mode>-<axis>-<metric>.png``.
Rows timed as CUDA graph replays (``timing`` ``cuda_graph``) are charted apart from eager rows:
their titles say "(CUDA graphs)" and their files are named ``<sweep>-cuda_graph-<mode>-...``.
"""

from __future__ import annotations

import math
import re
import textwrap
import zlib
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .results import Row

AXES = ("window", "seqlen_k", "head_dim", "heads", "batch", "mask", "mask_format", "bias",
        "causal", "dtype")
# Every case parameter, as plotted: points on one line agree on all of these but the axis.
PARAMS = ("batch", "heads", "seqlen_q", "seqlen_k", "head_dim", "window", "causal", "dtype",
          "mask", "mask_format", "documents", "bias", "seed")
TIMED = ("fwd", "bwd", "fwd+bwd")
COMMAND_SUFFIXES = ("-fwd", "-bwd", "-equiv")
BASELINE_FALLBACKS = ("fdma", "sdpa", "reference")
MAX_PANELS = 12

# One colour and marker per backend, in every chart.
BACKEND_STYLE = {
    "triton": ("tab:blue", "o"),
    "sdpa": ("tab:orange", "s"),
    "sdpa-dense": ("tab:gray", "^"),
    "flex": ("tab:green", "D"),
    "fdma": ("tab:red", "v"),
    "reference": ("tab:brown", "x"),
    "triton-base": ("tab:cyan", "P"),
}
# For a backend not listed above: chosen by a hash of its name, so still stable across charts.
SPARE_STYLES = (("tab:purple", "<"), ("tab:pink", "*"), ("tab:olive", "h"), ("black", ">"))
LINE_STYLES = ("-", "--", ":", "-.")


def backend_style(name: str) -> tuple[str, str]:
    """(matplotlib colour, marker) of a backend: fixed by its name."""
    if name in BACKEND_STYLE:
        return BACKEND_STYLE[name]
    return SPARE_STYLES[zlib.crc32(name.encode()) % len(SPARE_STYLES)]


def param_value(row: Row, name: str):
    """A row's value of a case parameter as charted (``heads`` as "Hq/Hk", the mask with a
    shape other than the full one)."""
    if name == "heads":
        return f"{row.heads_q}/{row.heads_kv}"
    if name == "q_shape":
        return "Lq=Lk" if row.seqlen_q == row.seqlen_k else f"Lq={row.seqlen_q}"
    if name == "mask":
        return row.mask if row.mask_shape == "BxHkxLqxLk" else f"{row.mask}[{row.mask_shape}]"
    if name == "case":
        return row.case_id
    if name == "documents":
        return row.documents or "drawn"
    return getattr(row, name)


def context_params(axis: str) -> tuple[str, ...]:
    """The parameters that must be equal for two points to share a line along ``axis``.

    Along ``seqlen_k`` the query length usually follows the key length, so what must match is
    how they relate (``q_shape``: Lq=Lk, or a fixed Lq) rather than Lq itself.
    """
    if axis == "case":
        return ()
    names = [p for p in PARAMS if p != axis]
    if axis == "seqlen_k":
        names[names.index("seqlen_q")] = "q_shape"
    return tuple(names)


@dataclass(frozen=True)
class Series:
    """Points of one backend that differ only along the axis."""

    backend: str
    panel: tuple[tuple[str, object], ...]  # (parameter, value) shared by the whole panel
    context: tuple[tuple[str, object], ...]  # further (parameter, value) naming this series
    points: tuple[tuple[object, float], ...]  # (x, y) sorted by x

    @property
    def label(self) -> str:
        return ", ".join([self.backend] + [f"{p}={v}" for p, v in self.context])


def _sort_key(value):
    return (0, value, "") if isinstance(value, (int, float)) and not isinstance(value, bool) else (1, 0, str(value))


def _split_params(rows: list[Row], names: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Varying parameters as (panel parameters, series parameters): panels while they fit in
    ``MAX_PANELS``, series for the rest."""
    varying = [n for n in names if len({param_value(r, n) for r in rows}) > 1]
    panel: list[str] = []
    for name in varying:
        if len({tuple(param_value(r, p) for p in panel + [name]) for r in rows}) <= MAX_PANELS:
            panel.append(name)
    return panel, [n for n in varying if n not in panel]


def group_series(rows: list[Row], axis: str, values: dict[int, float]) -> list[Series]:
    """Series along ``axis`` for ``rows``; ``values`` maps ``id(row)`` to its y value (rows
    without one are left out, as are rows with no value on the axis)."""
    rows = [r for r in rows if id(r) in values and param_value(r, axis) is not None]
    panel_params, series_params = _split_params(rows, context_params(axis))
    grouped: dict[tuple, list] = {}
    for r in rows:
        panel = tuple((p, param_value(r, p)) for p in panel_params)
        context = tuple((p, param_value(r, p)) for p in series_params)
        grouped.setdefault((r.backend, panel, context), []).append((param_value(r, axis), values[id(r)]))
    return [Series(backend, panel, context, tuple(sorted(pts, key=lambda p: _sort_key(p[0]))))
            for (backend, panel, context), pts in grouped.items()]


def has_line(rows: list[Row], axis: str) -> bool:
    """Whether some backend has two points that differ only along ``axis``."""
    seen: dict[tuple, set] = {}
    names = context_params(axis)
    for r in rows:
        if param_value(r, axis) is None:
            continue
        key = (r.backend, r.mode) + tuple(param_value(r, p) for p in names)
        seen.setdefault(key, set()).add(param_value(r, axis))
    return any(len(xs) > 1 for xs in seen.values())


def choose_baseline(rows: list[Row], requested: str | None) -> str | None:
    present = {r.backend for r in rows}
    if requested:
        if requested not in present:
            raise ConfigError(f"--baseline: backend {requested!r} has no timed rows in this file; "
                              f"present: {', '.join(sorted(present))}")
        return requested
    return next((b for b in BASELINE_FALLBACKS if b in present), None)


def sweep_title(rows: list[Row], stem: str) -> str:
    """The sweep's name: the CSV's ``sweep`` column, else the file stem less its command suffix
    (and a run number such as ``.2``)."""
    names = sorted({r.sweep for r in rows if r.sweep})
    if names:
        return "+".join(names)
    base = re.sub(r"\.\d+$", "", stem)
    for suffix in COMMAND_SUFFIXES:
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def _file_prefix(rows: list[Row], stem: str, timing: str = "eager") -> str:
    """The sweep's name, ``-<timing>`` unless eager, and the run number of a numbered results
    file (``smoke-fwd.2``)."""
    number = re.search(r"\.\d+$", stem)
    marked = "" if timing == "eager" else f"-{timing}"
    return sweep_title(rows, stem) + marked + (number.group(0) if number else "")


def draw(series: list[Series], axis: str, ylabel: str, log_y: bool, title: str):
    """A matplotlib figure with one panel per distinct ``Series.panel``."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    panels = sorted({s.panel for s in series}, key=str)
    cols = min(3, len(panels))
    rows_n = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5.2 * cols, 3.8 * rows_n), squeeze=False)
    contexts = sorted({s.context for s in series}, key=str)
    for ax, panel in zip(axes.flat, panels):
        members = sorted((s for s in series if s.panel == panel), key=lambda s: (s.backend, str(s.context)))
        xs_all = sorted({x for s in members for x, _ in s.points}, key=_sort_key)
        numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs_all)
        position = {x: (x if numeric else i) for i, x in enumerate(xs_all)}
        for s in members:
            colour, marker = backend_style(s.backend)
            style = LINE_STYLES[contexts.index(s.context) % len(LINE_STYLES)]
            ax.plot([position[x] for x, _ in s.points], [y for _, y in s.points],
                    color=colour, marker=marker, linestyle=style if axis != "case" else "none",
                    label=s.label)
        if numeric and len(xs_all) > 1 and xs_all[-1] / max(xs_all[0], 1e-9) >= 8:
            ax.set_xscale("log", base=2)
        if not numeric:
            ax.set_xticks(range(len(xs_all)))
            ax.set_xticklabels([str(x) for x in xs_all], rotation=30, ha="right", fontsize=7)
        if log_y and all(y > 0 for s in members for _, y in s.points):
            ax.set_yscale("log")
        name = ", ".join(f"{p}={v}" for p, v in panel) or "all"
        ax.set_title(textwrap.fill(name, 60), fontsize=7)
        ax.set_xlabel(axis)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rows(rows: list[Row], out_dir: Path, stem: str, baseline: str | None) -> list[Path]:
    """Write the charts for ``rows`` (read from a CSV named ``stem``) into ``out_dir``, eager
    rows and CUDA graph rows apart."""
    timed = [r for r in rows if r.mode in TIMED and r.status in ("ok", "accuracy") and r.ms_p50]
    if not timed:
        raise ConfigError(f"{stem}: no timed rows with status ok to plot")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for timing in sorted({r.timing for r in timed}, key=lambda t: (t != "eager", t)):
        written += _plot_timed([r for r in timed if r.timing == timing], out_dir, stem, baseline,
                               timing)
    return written


def _plot_timed(timed: list[Row], out_dir: Path, stem: str, baseline: str | None,
                timing: str) -> list[Path]:
    """The charts of rows of one timing."""
    baseline = choose_baseline(timed, baseline)
    axes = [a for a in AXES if has_line(timed, a)] or ["case"]
    sweep = sweep_title(timed, stem) + ("" if timing == "eager" else " (CUDA graphs)")
    prefix, gpu = _file_prefix(timed, stem, timing), timed[0].gpu
    written = []
    modes = [m for m in TIMED if any(r.mode == m for r in timed)]
    for mode in modes:
        mode_rows = [r for r in timed if r.mode == mode]
        base_ms = {r.case_id: r.ms_p50 for r in mode_rows if r.backend == baseline}
        speedup = {id(r): base_ms[r.case_id] / r.ms_p50 for r in mode_rows if r.case_id in base_ms}
        rate = {id(r): r.tflops_dense for r in mode_rows if r.tflops_dense is not None}
        memory = {id(r): r.peak_mib for r in mode_rows if r.peak_mib is not None}
        build = ({id(r): r.build_ms for r in mode_rows if r.build_ms is not None}
                 if mode == modes[0] else {})
        title = f"{sweep} {mode} on {gpu}"
        charts = ((speedup, "speedup", f"{title}: speedup over {baseline} (p50)",
                   f"speedup vs {baseline}", True),
                  (rate, "tflops", f"{title}: dense-equivalent TFLOP/s (p50)", "TFLOP/s", False),
                  (memory, "memory", f"{title}: peak memory of one call above its inputs",
                   "MiB", True),
                  (build, "build", f"{sweep} on {gpu}: mask build (build_ms)", "ms", True))
        for axis in axes:
            tag = f"{prefix}-{mode.replace('+', '_')}-{axis}"
            for values, metric, chart_title, ylabel, log_y in charts:
                series = group_series(mode_rows, axis, values)
                if not series:
                    continue
                path = out_dir / f"{tag}-{metric}.png"
                _save(draw(series, axis, ylabel, log_y, chart_title), path)
                written.append(path)
    return written
