"""Plots: which points share a line, one colour per backend everywhere, titles and file names."""

from __future__ import annotations

from dataclasses import replace

import matplotlib
import pytest

from dmbench import plot
from dmbench.backends import BACKEND_NAMES
from dmbench.envinfo import Environment
from dmbench.results import Row, new_row
from dmbench.sweep import Case

matplotlib.use("Agg")
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
    fig = plot.draw(series, "seqlen_k", "ms", False, "t")
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
    fig = plot.draw(series, "case", "ms", False, "t")
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
    fig = plot.draw(series, "seqlen_k", "ms", False, "t")
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


def test_file_names_do_not_repeat_the_mode(tmp_path):
    rows = _rows(modes=("bwd", "fwd+bwd"))
    paths = plot.plot_rows(rows, tmp_path, "smoke-bwd", "reference")
    names = sorted(p.name for p in paths)
    assert names == ["smoke-bwd-seqlen_k-speedup.png", "smoke-bwd-seqlen_k-tflops.png",
                     "smoke-fwd_bwd-seqlen_k-speedup.png", "smoke-fwd_bwd-seqlen_k-tflops.png"]
    numbered = plot.plot_rows(rows, tmp_path, "smoke-bwd.2", "reference")
    assert {p.name for p in numbered} == {n.replace("smoke-", "smoke.2-") for n in names}


def test_cuda_graph_rows_are_charted_apart_and_named_so(tmp_path, monkeypatch):
    titles = []
    draw = plot.draw
    monkeypatch.setattr(plot, "draw", lambda series, axis, ylabel, log_y, title:
                        titles.append(title) or draw(series, axis, ylabel, log_y, title))
    eager, graph = _rows(), _rows()
    for row in graph:
        row.timing = "cuda_graph"
        row.ms_p50 = row.ms_p20 = row.ms_p80 = 5.0
    names = sorted(p.name for p in plot.plot_rows(eager + graph, tmp_path, "smoke-fwd.2",
                                                   "reference"))
    assert names == ["smoke-cuda_graph.2-fwd-seqlen_k-speedup.png",
                     "smoke-cuda_graph.2-fwd-seqlen_k-tflops.png",
                     "smoke.2-fwd-seqlen_k-speedup.png", "smoke.2-fwd-seqlen_k-tflops.png"]
    assert sum("smoke (CUDA graphs) fwd on Test GPU" in t for t in titles) == 2
    assert sum(t.startswith("smoke fwd on Test GPU") for t in titles) == 2


def test_memory_and_build_charts_where_rows_record_them(tmp_path):
    """peak_mib gives a memory chart per mode; build_ms a build chart for the first mode only
    (the mask is built once per point whatever is timed)."""
    rows = _rows(modes=("bwd", "fwd+bwd"))
    for i, row in enumerate(rows):
        row.peak_mib = 100.0 + i
        row.build_ms = 2.0 if row.backend != "reference" else None
    names = sorted(p.name for p in plot.plot_rows(rows, tmp_path, "smoke-bwd", "reference"))
    assert names == sorted(f"smoke-{mode}-seqlen_k-{metric}.png"
                           for mode, metrics in (("bwd", ("speedup", "tflops", "memory", "build")),
                                                 ("fwd_bwd", ("speedup", "tflops", "memory")))
                           for metric in metrics)


def test_mask_formats_are_an_axis_and_never_share_a_line():
    case = replace(TOPK_48, mask_format="intervals")
    rows = _rows(cases=(TOPK_48, case, replace(case, seqlen_q=96, seqlen_k=96)))
    assert plot.has_line(rows, "mask_format")
    # Along seqlen_k only the two intervals cases make a line; the bool one stands alone.
    lines = [s for s in plot.group_series(rows, "seqlen_k", _values(rows)) if len(s.points) > 1]
    assert lines and all(dict(s.panel + s.context).get("mask_format") == "intervals" for s in lines)
