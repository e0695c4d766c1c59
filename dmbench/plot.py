"""Speedup, TFLOP/s, memory and mask-build charts, drawn from a results CSV and nothing else.

For every swept axis (a case parameter along which some points differ in that parameter alone)
and every timed mode, two PNGs are written: speedup over a baseline backend, and
dense-equivalent TFLOP/s; where rows record them, also ``memory`` (``peak_mib``: what one call
allocates above its inputs) and, once per file (its first mode, since the mask is built once
per point whatever is timed), ``build`` (``build_ms``: the mask's build). Points are joined by a line only when every other case parameter is
equal. The other parameters that vary split the points into panels (up to ``MAX_PANELS`` per
figure) and, past that, into separate series whose legend names the values that differ. When no
axis has two such points, the cases themselves are the x axis and nothing is joined.

Axes (``draw``): an x axis of text values, or with a single value, is a row of categories, one
tick per value labelled with it; numbers sit at their value, with a tick at each (up to
``MAX_X_TICKS``). Speedup, memory and build are drawn on a log scale, TFLOP/s only in a panel
whose values span more than ``WIDE_SPAN`` times (``uses_log_scale``); log axes are labelled
with plain numbers, both ends of the data included (``log_ticks``).

Each backend keeps one colour and marker in every chart (``backend_style``), whatever order the
rows come in. Titles name the sweep (the CSV's ``sweep`` column, else the file name without its
``-fwd``/``-bwd``/``-equiv`` suffix), the mode and the GPU. Files are named after the CSV's
stem, so that two CSVs plotted into one folder never overwrite each other's charts
(``chart_file_name``). Rows timed as CUDA graph replays (``timing`` ``cuda_graph``) are charted
apart from eager rows: their titles say "(CUDA graphs)" and their file names ``cuda_graph``.
"""

from __future__ import annotations

import math
import re
import textwrap
import zlib
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .results import TIMED_MODES, Row

AXES = ("window", "seqlen_k", "head_dim", "heads", "batch", "mask", "mask_format", "bias",
        "causal", "dtype")
# Every case parameter, as plotted: points on one line agree on all of these but the axis.
PARAMS = ("batch", "heads", "seqlen_q", "seqlen_k", "head_dim", "window", "causal", "dtype",
          "mask", "mask_format", "documents", "bias", "seed")
COMMAND_SUFFIXES = ("-fwd", "-bwd", "-equiv")
BASELINE_FALLBACKS = ("fdma", "sdpa", "flex", "fa4", "reference")
MAX_PANELS = 12
# Numeric x values up to this many get a tick each; past it matplotlib places the ticks.
MAX_X_TICKS = 12

# y scales (``draw``): LOG_IF_WIDE is log only in a panel whose largest value exceeds its
# smallest by more than WIDE_SPAN times; LOG whenever all values are positive.
LINEAR, LOG, LOG_IF_WIDE = "linear", "log", "log_if_wide"
WIDE_SPAN = 10.0
# Tick values within a decade for log axes, coarsest first; ``log_ticks`` takes the first that
# puts MIN_LOG_TICKS ticks in the data range.
LOG_TICK_STEPS = ((1,), (1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8))
MIN_LOG_TICKS = 3
# An end of a log axis's data range gets its own tick unless one lies within this fraction of
# the range (in log space) from it.
NEAR_END = 0.1

# One colour and marker per backend, in every chart.
BACKEND_STYLE = {
    "triton": ("tab:blue", "o"),
    "sdpa": ("tab:orange", "s"),
    "sdpa-dense": ("tab:gray", "^"),
    "flex": ("tab:green", "D"),
    "fdma": ("tab:red", "v"),
    "fa4": ("tab:purple", "*"),
    "reference": ("tab:brown", "x"),
    "triton-base": ("tab:cyan", "P"),
    "triton-select": ("darkblue", "p"),
    "triton-per-call": ("steelblue", "d"),
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


def chart_file_name(stem: str, timing: str, mode: str, axis: str, metric: str) -> str:
    """``<stem>-<mode>[-<timing>]-<axis>-<metric>.png``, the timing only when not eager.

    ``stem`` is the CSV's file name without ``.csv``, whole (``smoke-bwd.2``). Mode, timing,
    axis and metric names hold no ``-`` and no timing is named like a mode, so the name read
    from its end gives back the stem: CSVs with different stems never write the same file.
    """
    marked = [] if timing == "eager" else [timing]
    return "-".join([stem, mode.replace("+", "_"), *marked, axis, metric]) + ".png"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plain_number(value: float, digits: int = 3) -> str:
    """``value`` in positional notation with ``digits`` significant digits at most, trailing
    zeros dropped: 0.8, 1, 2.47, 1500."""
    if value == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def tick_labels(values: list[float], unit: str = "") -> list[str]:
    """Plain-number labels for ``values``, each followed by ``unit``, with as many significant
    digits as it takes (three at least) for distinct values to read differently."""
    for digits in range(3, 16):
        labels = [plain_number(v, digits) + unit for v in values]
        if len(set(labels)) == len(set(values)):
            return labels
    return labels


def _ticks_with_steps(lo: float, hi: float, steps: tuple[float, ...]) -> list[float]:
    """The values ``step * 10**k`` within [lo, hi]."""
    found = []
    for exponent in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        for step in steps:
            value = float(f"{step * 10.0 ** exponent:.12g}")
            if lo * (1 - 1e-9) <= value <= hi * (1 + 1e-9):
                found.append(value)
    return found


def log_ticks(lo: float, hi: float) -> list[float]:
    """Labelled tick values for a log axis over the positive data range [lo, hi].

    Round values from the coarsest of ``LOG_TICK_STEPS`` that places ``MIN_LOG_TICKS`` in the
    range (the finest otherwise), plus ``lo`` and ``hi`` themselves where no tick lies within
    ``NEAR_END`` of the range from them: both ends of the data always carry a label.
    """
    if hi <= lo:
        return [lo]
    for steps in LOG_TICK_STEPS:
        ticks = _ticks_with_steps(lo, hi, steps)
        if len(ticks) >= MIN_LOG_TICKS:
            break
    near = NEAR_END * math.log(hi / lo)
    if not any(math.log(t / lo) <= near for t in ticks):
        ticks.insert(0, lo)
    if not any(math.log(hi / t) <= near for t in ticks):
        ticks.append(hi)
    return ticks


def uses_log_scale(values: list[float], scale: str) -> bool:
    """Whether a panel of ``values`` is drawn on a log y scale: never for LINEAR; for LOG when
    every value is positive; for LOG_IF_WIDE when, besides, the largest value exceeds the
    smallest by more than ``WIDE_SPAN`` times (TFLOP/s of backends or shapes that differ by an
    order of magnitude or more)."""
    if scale == LINEAR or not values or min(values) <= 0:
        return False
    return scale == LOG or max(values) / min(values) > WIDE_SPAN


def _fixed_ticks(axis, values: list[float], unit: str = "") -> None:
    """Ticks at ``values`` only, labelled as plain numbers; minor ticks unlabelled."""
    import matplotlib.ticker as mticker

    axis.set_ticks(values, labels=tick_labels(values, unit))
    axis.set_minor_formatter(mticker.NullFormatter())


def _draw_y_axis(ax, values: list[float], scale: str, unit: str) -> None:
    """The y scale of one panel; a single value is its one tick, a log axis gets ``log_ticks``."""
    log = uses_log_scale(values, scale)
    if log:
        ax.set_yscale("log")
    if len(set(values)) == 1:
        _fixed_ticks(ax.yaxis, [values[0]], unit)
    elif log:
        _fixed_ticks(ax.yaxis, log_ticks(min(values), max(values)), unit)


def x_positions(xs: list) -> tuple[dict, bool]:
    """Where each distinct x value (sorted) is drawn, and whether the axis is categorical:
    text values, and a single value of any kind, are categories 0, 1, ...; numbers sit at their
    value."""
    categorical = len(xs) == 1 or not all(_is_number(x) for x in xs)
    return {x: (i if categorical else x) for i, x in enumerate(xs)}, categorical


def _draw_x_axis(ax, xs: list, categorical: bool) -> None:
    """One labelled tick per category; numbers on a linear or (past a ratio of 8) base-2 log
    scale, with a tick at each value when there are at most ``MAX_X_TICKS``."""
    import matplotlib.ticker as mticker

    if categorical:
        if len(xs) == 1:
            ax.set_xticks([0], [str(xs[0])])
            ax.set_xlim(-1, 1)  # the one category in the middle, no range around it
        else:
            ax.set_xticks(range(len(xs)), [str(x) for x in xs], rotation=30, ha="right",
                          fontsize=7)
        return
    if xs[0] > 0 and xs[-1] / xs[0] >= 8:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(mticker.FuncFormatter(lambda v, _: plain_number(v, 6)))
    if len(xs) <= MAX_X_TICKS:
        _fixed_ticks(ax.xaxis, xs)
    ax.xaxis.set_minor_formatter(mticker.NullFormatter())


def draw(series: list[Series], axis: str, ylabel: str, scale: str, title: str, unit: str = ""):
    """A matplotlib figure with one panel per distinct ``Series.panel``; ``scale`` is LINEAR,
    LOG or LOG_IF_WIDE (``uses_log_scale``), and ``unit`` follows each y tick label of a
    log or single-valued axis ("×" for speedups)."""
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
        position, categorical = x_positions(xs_all)
        for s in members:
            colour, marker = backend_style(s.backend)
            style = LINE_STYLES[contexts.index(s.context) % len(LINE_STYLES)]
            ax.plot([position[x] for x, _ in s.points], [y for _, y in s.points],
                    color=colour, marker=marker, linestyle=style if axis != "case" else "none",
                    label=s.label)
        _draw_x_axis(ax, xs_all, categorical)
        _draw_y_axis(ax, [y for s in members for _, y in s.points], scale, unit)
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


METRICS = ("speedup", "tflops", "memory", "build")


def plot_rows(rows: list[Row], out_dir: Path, stem: str, baseline: str | None,
              metrics: tuple[str, ...] = METRICS) -> list[Path]:
    """Write the charts of ``metrics`` (``METRICS``) for ``rows`` (read from a CSV named
    ``stem``) into ``out_dir``, eager rows and CUDA graph rows apart."""
    unknown = [m for m in metrics if m not in METRICS]
    if unknown or not metrics:
        raise ConfigError(f"--metrics: expected a comma-separated subset of {', '.join(METRICS)}, "
                          f"got {','.join(metrics) or 'nothing'}")
    timed = [r for r in rows if r.mode in TIMED_MODES and r.status in ("ok", "accuracy") and r.ms_p50]
    if not timed:
        raise ConfigError(f"{stem}: no timed rows with status ok to plot")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for timing in sorted({r.timing for r in timed}, key=lambda t: (t != "eager", t)):
        written += _plot_timed([r for r in timed if r.timing == timing], out_dir, stem, baseline,
                               timing, metrics)
    if not written:
        raise ConfigError(f"{stem}: nothing to draw for --metrics {','.join(metrics)}: speedup "
                          f"needs a baseline (none of {', '.join(BASELINE_FALLBACKS)} has timed "
                          f"rows; name one with --baseline), the others rows that record them")
    return written


@dataclass(frozen=True)
class Chart:
    """One kind of chart of one mode: y ``values`` by ``id(row)``, and how they are drawn."""

    metric: str  # the file name's last part
    values: dict[int, float]
    title: str
    ylabel: str
    scale: str
    unit: str = ""


def _gpu_name(rows: list[Row]) -> str:
    return "+".join(sorted({r.gpu for r in rows})) or "unknown GPU"


def mode_charts(mode_rows: list[Row], baseline: str | None, title: str,
                with_build: bool) -> list[Chart]:
    """The charts of one mode's rows; ``title`` names the sweep, the mode and the GPU."""
    base_ms = {r.case_id: r.ms_p50 for r in mode_rows if r.backend == baseline}
    speedup = {id(r): base_ms[r.case_id] / r.ms_p50 for r in mode_rows if r.case_id in base_ms}
    rate = {id(r): r.tflops_dense for r in mode_rows if r.tflops_dense is not None}
    memory = {id(r): r.peak_mib for r in mode_rows if r.peak_mib is not None}
    build = ({id(r): r.build_ms for r in mode_rows if r.build_ms is not None}
             if with_build else {})
    return [Chart("speedup", speedup, f"{title}: speedup over {baseline} (p50)",
                  f"speedup vs {baseline}", LOG, "×"),
            Chart("tflops", rate, f"{title}: dense-equivalent TFLOP/s (p50)", "TFLOP/s",
                  LOG_IF_WIDE),
            Chart("memory", memory, f"{title}: peak memory of one call above its inputs", "MiB",
                  LOG),
            Chart("build", build, f"{title}: mask build (build_ms)", "ms", LOG)]


def _plot_timed(timed: list[Row], out_dir: Path, stem: str, baseline: str | None,
                timing: str, metrics: tuple[str, ...]) -> list[Path]:
    """The charts of rows of one timing."""
    baseline = choose_baseline(timed, baseline)
    axes = [a for a in AXES if has_line(timed, a)] or ["case"]
    sweep = sweep_title(timed, stem) + ("" if timing == "eager" else " (CUDA graphs)")
    gpu = _gpu_name(timed)
    written = []
    modes = [m for m in TIMED_MODES if any(r.mode == m for r in timed)]
    for mode in modes:
        mode_rows = [r for r in timed if r.mode == mode]
        charts = mode_charts(mode_rows, baseline, f"{sweep} {mode} on {gpu}", mode == modes[0])
        for axis in axes:
            for chart in (c for c in charts if c.metric in metrics):
                series = group_series(mode_rows, axis, chart.values)
                if not series:
                    continue
                path = out_dir / chart_file_name(stem, timing, mode, axis, chart.metric)
                _save(draw(series, axis, chart.ylabel, chart.scale, chart.title, chart.unit),
                      path)
                written.append(path)
    return written
