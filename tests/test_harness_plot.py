"""Plots: which points share a line, one colour per backend everywhere, axes and their tick
labels, titles and file names."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path

import matplotlib
import pytest
from typer.testing import CliRunner

from dmbench import plot
from dmbench.errors import ConfigError
from dmbench.backends import BACKEND_NAMES
from dmbench.case import Case
from dmbench.cli import app
from dmbench.envinfo import Environment
from dmbench.results import TIMED_MODES, Row, new_row, rewrite
from dmbench.train_results import TrainRow, TrainWriter, plot_train

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

ENV = Environment("Test GPU", "1.0", "2.13", "3.9", "abc", False, "h")
# The smoke sweep's shapes: Lq48 and Lq96 share every other parameter; the rest do not.
TOPK_48 = Case(1, 2, 1, 48, 48, 32, 32, True, "bf16", "topk", bias="kv_row")
SMOKE_CASES = (
    TOPK_48,
    replace(TOPK_48, seqlen_q=96, seqlen_k=96),
    Case(1, 2, 1, 130, 130, 32, 100, True, "bf16", "block_topk", bias="kv_row"),
    Case(1, 4, 2, 64, 64, 32, 16, True, "fp16", "sliding", bias="q_full"),
    Case(1, 4, 1, 1, 130, 32, None, False, "bf16", "none", bias="shared"),
)


def _rows(cases=SMOKE_CASES, backends=("triton", "sdpa", "reference"), modes=("fwd",),
          sweep="smoke") -> list[Row]:
    rows = []
    for i, case in enumerate(cases):
        for j, backend in enumerate(backends):
            for mode in modes:
                row = new_row(sweep, case, backend, mode, "ok", ENV)
                row.ms_p20 = row.ms_p50 = row.ms_p80 = 1.0 + i + 0.5 * j
                row.tflops_dense = 10.0 / row.ms_p50
                rows.append(row)
    return rows


def _values(rows):
    return {id(r): r.ms_p50 for r in rows}


@pytest.fixture
def charted(monkeypatch):
    """``plot_rows`` without rendering: (file name, title) of each chart it would write."""
    charts = []
    monkeypatch.setattr(plot, "draw", lambda series, axis, ylabel, scale, title, unit="": title)
    monkeypatch.setattr(plot, "_save", lambda title, path: charts.append((path.name, title)))
    return charts


def _drawn(rows, axis, values, scale=plot.LINEAR, unit=""):
    """The visible panels of the chart of ``values`` along ``axis``, with tick labels made."""
    fig = plot.draw(plot.group_series(rows, axis, values), axis, "y", scale, "t", unit)
    fig.canvas.draw()
    plt.close(fig)
    return [ax for ax in fig.axes if ax.get_visible()]


def _labels(ticks) -> list[str]:
    return [t.get_text() for t in ticks if t.get_text()]


def test_smoke_points_are_joined_only_when_all_else_is_equal():
    rows = _rows()
    assert plot.has_line(rows, "seqlen_k")
    series = plot.group_series(rows, "seqlen_k", _values(rows))
    triton = [s for s in series if s.backend == "triton"]
    xs = sorted(tuple(x for x, _ in s.points) for s in triton)
    assert xs == [(48, 96), (64,), (130,), (130,)]
    for s in series:
        members = [r for r in rows if r.backend == s.backend and
                   all(plot.param_value(r, p) == v for p, v in s.panel + s.context)]
        params = plot.context_params("seqlen_k")
        assert len({tuple(plot.param_value(r, p) for p in params) for r in members}) == 1


def test_drawn_lines_never_join_different_cases():
    rows = _rows()
    series = plot.group_series(rows, "seqlen_k", _values(rows))
    fig = plot.draw(series, "seqlen_k", "ms", plot.LINEAR, "t")
    joined = [tuple(line.get_xdata()) for ax in fig.axes for line in ax.get_lines()
              if len(line.get_xdata()) > 1]
    assert joined and all(set(x) == {48, 96} for x in joined)


def test_axes_with_no_line_are_not_charted():
    rows = _rows()
    charted = [a for a in plot.AXES if plot.has_line(rows, a)]
    assert charted == ["seqlen_k"]  # heads, mask, dtype... never change alone in smoke


def test_unrelated_cases_fall_back_to_unjoined_points():
    rows = _rows(SMOKE_CASES[2:])
    assert not any(plot.has_line(rows, a) for a in plot.AXES)
    series = plot.group_series(rows, "case", _values(rows))
    fig = plot.draw(series, "case", "ms", plot.LINEAR, "t")
    assert all(line.get_linestyle() == "None" for ax in fig.axes for line in ax.get_lines())


def test_too_many_contexts_become_named_series():
    cases = [replace(TOPK_48, seqlen_q=L, seqlen_k=L, head_dim=d, seed=s)
             for L in (48, 96) for d in (32, 64, 96, 128) for s in range(4)]
    rows = _rows(cases, backends=("triton",))
    series = plot.group_series(rows, "seqlen_k", _values(rows))
    panels = {s.panel for s in series}
    assert len(panels) <= plot.MAX_PANELS
    assert all(len(s.points) == 2 for s in series)  # each joins 48 and 96 of one case
    assert len(series) == 16
    named = [s for s in series if s.context]
    assert named and all("=" in s.label and s.label.startswith("triton, ") for s in named)


def _colours(rows) -> dict[str, tuple]:
    series = plot.group_series(rows, "seqlen_k", _values(rows))
    fig = plot.draw(series, "seqlen_k", "ms", plot.LINEAR, "t")
    found = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            backend = line.get_label().split(",")[0]
            found.setdefault(backend, set()).add((matplotlib.colors.to_hex(line.get_color()),
                                                  line.get_marker()))
    return found


def test_each_backend_keeps_its_colour_whatever_the_order():
    one = _colours(_rows(backends=("triton", "sdpa", "reference")))
    two = _colours(_rows(backends=("reference", "sdpa")))
    three = _colours(list(reversed(_rows(backends=("sdpa", "triton")))))
    for found in (one, two, three):
        for backend, styles in found.items():
            colour, marker = plot.backend_style(backend)
            assert styles == {(matplotlib.colors.to_hex(colour), marker)}, backend
    assert one["sdpa"] == two["sdpa"] == three["sdpa"]


def test_backend_styles_are_distinct_and_stable():
    styles = [plot.backend_style(name) for name in BACKEND_NAMES]
    assert len(set(c for c, _ in styles)) == len(styles)
    assert len(set(m for _, m in styles)) == len(styles)
    assert plot.backend_style("someday") == plot.backend_style("someday")


@pytest.mark.parametrize("sweep, stem, title", [
    ("smoke", "anything", "smoke"),
    ("", "smoke-bwd", "smoke"),
    ("", "smoke-fwd.2", "smoke"),
    ("", "custom", "custom"),
])
def test_title_names_the_sweep(sweep, stem, title):
    assert plot.sweep_title(_rows(sweep=sweep), stem) == title


def test_file_names_hold_the_whole_stem_and_the_mode(charted, tmp_path):
    rows = _rows(modes=("bwd", "fwd+bwd"))
    names = sorted(p.name for p in plot.plot_rows(rows, tmp_path, "smoke-bwd", "reference"))
    assert names == ["smoke-bwd-bwd-seqlen_k-speedup.png", "smoke-bwd-bwd-seqlen_k-tflops.png",
                     "smoke-bwd-fwd_bwd-seqlen_k-speedup.png",
                     "smoke-bwd-fwd_bwd-seqlen_k-tflops.png"]
    numbered = plot.plot_rows(rows, tmp_path, "smoke-bwd.2", "reference")
    assert {p.name for p in numbered} == {n.replace("smoke-bwd-", "smoke-bwd.2-") for n in names}


def test_metrics_choose_the_charts_drawn(charted, tmp_path):
    rows = _rows(modes=("bwd",))
    names = sorted(p.name for p in plot.plot_rows(rows, tmp_path, "smoke-bwd", "reference",
                                                  ("speedup",)))
    assert names == ["smoke-bwd-bwd-seqlen_k-speedup.png"]


def test_speedup_takes_the_first_peer_with_rows_and_says_when_there_is_none(charted, tmp_path):
    """Without --baseline the speedup charts are over the first of ``BASELINE_FALLBACKS`` with
    rows (fa4 where only it ran beside ours); with none of them, asking for speedup alone is a
    ConfigError that names --baseline, not a run that writes nothing."""
    rows = _rows(backends=("triton", "triton-base", "fa4"), modes=("bwd",))
    paths = plot.plot_rows(rows, tmp_path, "smoke-bwd", None, ("speedup",))
    assert [p.name for p in paths] == ["smoke-bwd-bwd-seqlen_k-speedup.png"]
    ours = _rows(backends=("triton", "triton-base"), modes=("bwd",))
    with pytest.raises(ConfigError, match="--baseline"):
        plot.plot_rows(ours, tmp_path, "smoke-bwd", None, ("speedup",))
    assert plot.plot_rows(ours, tmp_path, "smoke-bwd", None, ("speedup", "tflops"))


@pytest.mark.parametrize("metrics", [(), ("speedup", "colour")])
def test_unknown_or_no_metrics_are_refused(tmp_path, metrics):
    with pytest.raises(ConfigError, match="--metrics"):
        plot.plot_rows(_rows(modes=("bwd",)), tmp_path, "smoke-bwd", "reference", metrics)


def test_file_names_of_different_stems_never_meet():
    """Read from its end, a name gives back the stem: no stem ending like a mode, a timing or
    a run number makes another stem's name."""
    stems = ("x", "x-fwd", "x-bwd", "x-fwd.2", "x.2", "x-fwd_bwd", "x-cuda_graph",
             "x-fwd-cuda_graph", "x-bwd-fwd_bwd", "x-seqlen_k", "x-seqlen_k-speedup")
    names = [plot.chart_file_name(*parts) for parts in itertools.product(
        stems, ("eager", "cuda_graph"), TIMED_MODES, ("seqlen_k", "case"), ("speedup", "build"))]
    assert len(set(names)) == len(names)


def _csv(path: Path, rows: list[Row]) -> Path:
    rewrite(path, rows)
    return path


def test_two_csvs_of_one_sweep_plot_into_one_folder_side_by_side(tmp_path):
    """a.csv and b.csv hold the same sweep (its name in their sweep column): ``dmbench plot``
    names each one's PNGs after its own file, so neither overwrites the other."""
    one_panel = SMOKE_CASES[:2]
    out = tmp_path / "plots"
    written = {}
    for stem in ("a", "b"):
        csv = _csv(tmp_path / f"{stem}.csv", _rows(one_panel, backends=("triton", "reference")))
        result = CliRunner().invoke(app, ["plot", str(csv), "--out-dir", str(out)])
        assert result.exit_code == 0, result.output
        written[stem] = {line.split("plot: ", 1)[1] for line in result.output.splitlines()
                         if line.startswith("plot: ")}
    assert written["a"] and not written["a"] & written["b"]
    assert {str(p) for p in out.glob("*.png")} == written["a"] | written["b"]
    assert all(Path(p).name.startswith(f"{stem}-fwd-") for stem in written for p in written[stem])


def test_cuda_graph_rows_are_charted_apart_and_named_so(charted, tmp_path):
    eager, graph = _rows(), _rows()
    for row in graph:
        row.timing = "cuda_graph"
        row.ms_p50 = row.ms_p20 = row.ms_p80 = 5.0
    plot.plot_rows(eager + graph, tmp_path, "smoke-fwd.2", "reference")
    assert sorted(name for name, _ in charted) == [
        "smoke-fwd.2-fwd-cuda_graph-seqlen_k-speedup.png",
        "smoke-fwd.2-fwd-cuda_graph-seqlen_k-tflops.png",
        "smoke-fwd.2-fwd-seqlen_k-speedup.png", "smoke-fwd.2-fwd-seqlen_k-tflops.png"]
    titles = [title for _, title in charted]
    assert sum("smoke (CUDA graphs) fwd on Test GPU" in t for t in titles) == 2
    assert sum(t.startswith("smoke fwd on Test GPU") for t in titles) == 2


def test_memory_and_build_charts_where_rows_record_them(charted, tmp_path):
    """peak_mib gives a memory chart per mode; build_ms a build chart for the first mode only
    (the mask is built once per point whatever is timed)."""
    rows = _rows(modes=("bwd", "fwd+bwd"))
    for i, row in enumerate(rows):
        row.peak_mib = 100.0 + i
        row.build_ms = 2.0 if row.backend != "reference" else None
    names = sorted(p.name for p in plot.plot_rows(rows, tmp_path, "smoke-bwd", "reference"))
    assert names == sorted(f"smoke-bwd-{mode}-seqlen_k-{metric}.png"
                           for mode, metrics in (("bwd", ("speedup", "tflops", "memory", "build")),
                                                 ("fwd_bwd", ("speedup", "tflops", "memory")))
                           for metric in metrics)


def test_every_chart_title_names_the_sweep_mode_and_gpu(charted, tmp_path):
    rows = _rows(modes=("bwd", "fwd+bwd")) + _rows(modes=("fwd",))
    graph = _rows(modes=("fwd",))
    for row in rows + graph:
        row.peak_mib, row.build_ms = 100.0, 2.0
    for row in graph:
        row.timing = "cuda_graph"
    plot.plot_rows(rows + graph, tmp_path, "smoke-bwd", "reference")
    metrics = {name.rsplit("-", 1)[1] for name, _ in charted}
    assert metrics == {"speedup.png", "tflops.png", "memory.png", "build.png"}
    for name, title in charted:
        mode = name.removeprefix("smoke-bwd-").split("-")[0].replace("_", "+")
        assert title.startswith("smoke ") and f" {mode} on Test GPU: " in title, (name, title)
        assert ("cuda_graph" in name) == ("(CUDA graphs)" in title)


def test_train_chart_titles_name_the_run_mode_and_gpu(tmp_path, monkeypatch):
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)
    csv = tmp_path / "train-tiny.csv"
    with TrainWriter(csv) as writer:
        for implementation, tokens in (("eager", 100.0), ("dmattn", 250.0)):
            writer.write(TrainRow("doge-tiny", 1000, 32, 1, 16, "fp32", implementation, "eager",
                                  "ok", tokens_per_s=tokens, gpu="Test GPU"))
    assert [p.name for p in plot_train(csv)] == ["train-tiny-throughput.png",
                                                 "train-tiny-speedup.png"]
    for fig in figures:
        title = fig.axes[0].get_title()
        assert title.startswith("train-tiny: ") and "fwd+bwd" in title, title
        assert title.endswith("on Test GPU")
        fig.canvas.draw()
        assert _labels(fig.axes[0].get_xticklabels()) == ["32"]  # the one context
        assert _labels(fig.axes[0].get_xticklabels(minor=True)) == []
        close(fig)


def _one_x_tick_per_panel(rows, axis, value):
    """The panels of the chart of ``rows`` along ``axis``, after checking that each has one
    x tick, labelled ``value``, where all its points sit."""
    axes = _drawn(rows, axis, _values(rows))
    for ax in axes:
        assert _labels(ax.get_xticklabels()) == [str(value)]
        assert _labels(ax.get_xticklabels(minor=True)) == []
        assert all(list(line.get_xdata()) == [0] for line in ax.get_lines())
    return axes


def test_a_single_number_on_the_x_axis_is_one_category():
    """Lk = 130 alone: one tick labelled 130 at the middle, no numeric range around it."""
    axes = _one_x_tick_per_panel(_rows((SMOKE_CASES[2],)), "seqlen_k", 130)
    assert axes[0].get_xlim() == (-1, 1)


def test_a_single_text_value_on_the_x_axis_is_its_one_tick():
    _one_x_tick_per_panel(_rows(SMOKE_CASES[:2]), "mask", "topk")


def test_each_panel_with_one_x_value_shows_that_value():
    rows = _rows()
    found = sorted(_labels(ax.get_xticklabels()) for ax in _drawn(rows, "seqlen_k", _values(rows)))
    assert found == [["130"], ["130"], ["48", "96"], ["64"]]


def test_a_single_y_value_is_its_one_tick():
    rows = _rows(SMOKE_CASES[:2])
    for scale in (plot.LINEAR, plot.LOG):
        (ax,) = _drawn(rows, "seqlen_k", {id(r): 12.5 for r in rows}, scale, "×")
        assert _labels(ax.get_yticklabels()) == ["12.5×"]
        assert _labels(ax.get_yticklabels(minor=True)) == []


def _speedup_panel(values):
    rows = _rows(SMOKE_CASES[:2], backends=("triton", "sdpa"))  # two lines in one panel
    (ax,) = _drawn(rows, "seqlen_k", dict(zip(map(id, rows), values)), plot.LOG, "×")
    return ax


def test_log_speedup_axis_is_labelled_in_plain_numbers():
    ax = _speedup_panel([0.8, 1.3, 1.9, 2.47])
    assert ax.get_yscale() == "log"
    assert _labels(ax.get_yticklabels()) == ["0.8×", "1×", "1.5×", "2×", "2.47×"]
    assert _labels(ax.get_yticklabels(minor=True)) == []


def test_top_of_a_log_axis_is_labelled_by_a_near_tick():
    ax = _speedup_panel([0.35, 0.5, 0.8, 2.05])
    assert _labels(ax.get_yticklabels()) == ["0.35×", "0.5×", "1×", "2×"]


@pytest.mark.parametrize("lo, hi", [(0.8, 2.47), (0.9, 1.1), (0.999, 1.001), (1.0, 2.0),
                                    (0.5, 40.0), (0.01, 100.0), (2.0, 300.0), (3.0, 3.3),
                                    (0.05, 0.07), (1e-4, 1e6)])
def test_log_ticks_label_both_ends_of_the_data(lo, hi):
    ticks = plot.log_ticks(lo, hi)
    near = plot.NEAR_END * math.log(hi / lo)
    assert ticks == sorted(ticks) and lo <= ticks[0] and ticks[-1] <= hi
    assert math.log(ticks[0] / lo) <= near and math.log(hi / ticks[-1]) <= near
    labels = plot.tick_labels(ticks, "×")
    assert len(set(labels)) == len(ticks)
    assert not any("e" in label or "$" in label for label in labels)


@pytest.mark.parametrize("values, log", [([5.0, 40.0], False), ([5.0, 80.0], True),
                                         ([0.0, 300.0], False)])
def test_tflops_go_log_when_they_span_more_than_an_order_of_magnitude(values, log):
    assert plot.uses_log_scale(values, plot.LOG_IF_WIDE) == log
    rows = _rows(SMOKE_CASES[:2], backends=("triton",))
    (ax,) = _drawn(rows, "seqlen_k", dict(zip(map(id, rows), values)), plot.LOG_IF_WIDE)
    assert ax.get_yscale() == ("log" if log else "linear")
    if log:
        assert _labels(ax.get_yticklabels()) == ["5", "10", "20", "50", "80"]


def test_mask_formats_are_an_axis_and_never_share_a_line():
    case = replace(TOPK_48, mask_format="intervals")
    rows = _rows(cases=(TOPK_48, case, replace(case, seqlen_q=96, seqlen_k=96)))
    assert plot.has_line(rows, "mask_format")
    # Along seqlen_k only the two intervals cases make a line; the bool one stands alone.
    lines = [s for s in plot.group_series(rows, "seqlen_k", _values(rows)) if len(s.points) > 1]
    assert lines and all(dict(s.panel + s.context).get("mask_format") == "intervals" for s in lines)
