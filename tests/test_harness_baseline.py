"""``triton-base``: our kernels from another checkout, timed beside ``triton`` in one process,
and the report's A/B section over the two."""

from __future__ import annotations

from pathlib import Path

import pytest

from typer.testing import CliRunner

from dmbench.backends import make_backends
from dmbench.backends.dmattn import BASELINE_ENV, BASELINE_OPTIONS_ENV
from dmbench.case import Case
from dmbench.cli import app
from dmbench.errors import ExitCode
from dmbench.collected import collect
from dmbench.report import baseline_markdown, tables_markdown
from dmbench.results import read_rows
from test_report import _csv, _masked, _rows

runner = CliRunner()
SWEEP = """\
name: ab
backends: [triton, triton-base]
check: true
timing: {warmup: 1, repeats: 3, budget_s: 1.0}
defaults: {batch: 1, heads: "2/1", head_dim: 32, dtype: bf16, causal: true, seed: 0}
cases:
  - {seqlen: 40, mask: topk, window: 16, bias: kv_row}
  - {seqlen: 40, mask: topk, mask_format: intervals, window: 16, bias: kv_row}
"""


def _run(tmp_path: Path, mode: str = "fwd") -> list:
    sweep = tmp_path / "ab.yaml"
    sweep.write_text(SWEEP)
    out = tmp_path / "ab.csv"
    result = runner.invoke(app, [mode, str(sweep), "--out", str(out), "--no-plot", "--no-progress"])
    assert result.exit_code == ExitCode.OK, result.output
    return read_rows(out)


def _these_kernels_as_baseline(tmp_path, monkeypatch, module_name: str) -> None:
    """``triton-base`` set to a package by path that re-exports these kernels: importing the
    kernels themselves a second time would register their torch ops (kernels.ops) again in
    this process."""
    package = tmp_path / "same_kernels"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from kernels import (KeyIntervals, dmattn_func, dmattn_varlen_func, prepare_mask,\n"
        "                     record_routes)\n")
    monkeypatch.setenv(BASELINE_ENV, str(package))
    monkeypatch.setattr("dmbench.backends.dmattn.BASELINE_MODULE", module_name)


def test_the_same_kernels_as_a_baseline_give_the_same_outputs(tmp_path, monkeypatch):
    _these_kernels_as_baseline(tmp_path, monkeypatch, "dmbench_same_kernels_test")
    rows = _run(tmp_path, "bwd")
    by_backend = {(r.backend, r.mask_format): r for r in rows}
    assert {r.status for r in rows} == {"ok"}, [(r.backend, r.detail) for r in rows]
    for fmt in ("bool", "intervals"):
        ours, base = by_backend[("triton", fmt)], by_backend[("triton-base", fmt)]
        # Checked against the fp64 reference, each with its own error; same code, same numbers.
        for name in ("err_dq", "err_dk", "err_dv", "err_dbias"):
            assert getattr(ours, name) == getattr(base, name), name


def test_ordered_intervals_reach_the_baseline_ordered(tmp_path, monkeypatch):
    """Intervals that carry a key order (``topk_intervals`` at long lengths) are given to the
    baseline with its own key order, and with their bound on the kept keys (which sends decode
    rows to the gather route), so an A/B compares the same calls of both versions."""
    import torch
    from kernels import topk_intervals
    from dmbench.problem import Problem

    _these_kernels_as_baseline(tmp_path, monkeypatch, "dmbench_ordered_test")
    bias = torch.randn(1, 1, 1, 64, generator=torch.Generator().manual_seed(0))
    qkv = torch.zeros(1, 64, 1, 16)
    backend = make_backends()["triton-base"]
    for intervals in (topk_intervals(bias, 8, order_keys=True),
                      topk_intervals(bias, 8, order_keys=False)):
        case = Case(1, 1, 1, 64, 64, 16, 8, True, "fp32", "topk", mask_format="intervals")
        problem = Problem(case=case, q=qkv, k=qkv, v=qkv, mask=intervals, bias=None,
                          kept_pairs=0)
        given = backend.adapt(problem)["mask"]
        assert torch.equal(given.start, intervals.start) and torch.equal(given.end, intervals.end)
        assert given.max_kept == intervals.max_kept is not None
        assert given._row_kept == intervals._row_kept == 8
        if intervals.key_order is None:
            assert given.key_order is None
        else:
            assert torch.equal(given.key_order, intervals.key_order)


def test_the_baseline_reads_its_intervals_per_call_as_ours_does(tmp_path, monkeypatch):
    """The baseline's intervals (its own class, not ours) reach its dmattn_func as they are,
    never through prepare_mask: a prepared mask would time a call without the read of the
    intervals that ours makes, and a captured graph without any mask work at all."""
    import torch
    from kernels import KeyIntervals
    from dmbench.problem import Problem

    package = tmp_path / "own_class_kernels"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from dataclasses import dataclass\n"
        "@dataclass\n"
        "class KeyIntervals:\n"
        "    start: object\n"
        "    end: object\n"
        "    key_order = None\n"
        "masks = []\n"
        "def dmattn_func(q, k, v, attn_mask=None, **kwargs):\n"
        "    masks.append(attn_mask)\n"
        "    return q\n"
        "def prepare_mask(*args, **kwargs):\n"
        "    raise AssertionError('prepare_mask called for intervals')\n")
    monkeypatch.setenv(BASELINE_ENV, str(package))
    monkeypatch.setattr("dmbench.backends.dmattn.BASELINE_MODULE", "dmbench_own_class_test")
    backend = make_backends()["triton-base"]
    start = torch.zeros(1, 1, 16, dtype=torch.int32)
    case = Case(1, 1, 1, 16, 16, 16, 8, True, "fp32", "topk", mask_format="intervals")
    qkv = torch.zeros(1, 16, 1, 16)
    problem = Problem(case=case, q=qkv, k=qkv, v=qkv, mask=KeyIntervals(start, start + 16),
                      bias=None, kept_pairs=0)
    bound = backend.bind(backend.adapt(problem), case, want_lse=False)
    bound.call()
    (given,) = backend.kernels().masks
    assert bound.build is None and type(given) is backend.kernels().KeyIntervals


def test_without_the_variable_the_baseline_is_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.delenv(BASELINE_ENV, raising=False)
    rows = _run(tmp_path)
    base = [r for r in rows if r.backend == "triton-base"]
    assert base and {r.status for r in base} == {"skipped"}
    assert all(BASELINE_ENV in r.detail for r in base)
    assert {r.status for r in rows if r.backend == "triton"} == {"ok"}


def test_a_folder_that_is_no_package_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(BASELINE_ENV, str(tmp_path))
    reason = make_backends()["triton-base"].unavailable_reason(None)
    assert reason is not None and str(tmp_path) in reason and "__init__.py" in reason


def test_a_baseline_without_intervals_skips_their_cases(tmp_path, monkeypatch):
    package = tmp_path / "old_kernels"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from kernels import dmattn_func, prepare_mask\n")  # no KeyIntervals, no varlen
    monkeypatch.setenv(BASELINE_ENV, str(package))
    monkeypatch.setattr("dmbench.backends.dmattn.BASELINE_MODULE", "dmbench_old_kernels_test")
    backend = make_backends()["triton-base"]
    assert backend.unavailable_reason(None) is None
    bool_case = Case(1, 2, 1, 40, 40, 32, 16, True, "bf16", "topk", bias="kv_row")
    intervals = Case(1, 2, 1, 40, 40, 32, 16, True, "bf16", "topk", bias="kv_row",
                     mask_format="intervals")
    assert backend.skip_reason(bool_case) is None
    assert "KeyIntervals" in backend.skip_reason(intervals)


def test_report_gives_the_ratio_distribution_against_the_baseline(tmp_path):
    rows = []
    for i, (new, old) in enumerate([(1.0, 1.0), (0.9, 1.0), (1.1, 1.0), (1.01, 1.0)]):
        rows += _rows(_masked(i), "win", "fwd", {"triton": new, "triton-base": old, "sdpa": 2.0})
    collected = collect([_csv(tmp_path / "r.csv", rows)])
    lines = baseline_markdown(collected)
    table = [line for line in lines if line.startswith("| win, fwd")]
    assert len(table) == 1
    cells = [c.strip() for c in table[0].strip("|").split("|")]
    assert cells[1] == "4"                      # cases
    assert cells[2] == "1.005"                  # median of 0.9, 1.0, 1.01, 1.1
    assert cells[4] == "2" and cells[5] == "1"  # within ±3%; slower
    assert cells[6].startswith("0.900") and cells[7].startswith("1.100")
    # The baseline is shown beside ours in the per-case tables, never as a peer.
    text = tables_markdown(collected)
    assert "| case | triton | triton-base | sdpa | vs best peer |" in text
    assert "(triton-base)" not in text


def test_no_baseline_rows_no_section(tmp_path):
    rows = _rows(_masked(0), "win", "fwd", {"triton": 1.0, "sdpa": 2.0})
    assert baseline_markdown(collect([_csv(tmp_path / "r.csv", rows)])) == []


def test_baseline_options_reach_every_call_and_name_themselves_in_the_detail(tmp_path,
                                                                             monkeypatch):
    """``DMBENCH_BASELINE_OPTIONS``: the baseline's calls pass them as ``kernel_options`` (an
    A/B of a schedule decision); here a forced backward route, which the rows' routes show."""
    _these_kernels_as_baseline(tmp_path, monkeypatch, "dmbench_options_test")
    monkeypatch.setenv(BASELINE_OPTIONS_ENV, '{"backward": "dq+dkdv"}')
    rows = _run(tmp_path, "bwd")
    assert {r.status for r in rows} == {"ok"}, [(r.backend, r.detail) for r in rows]
    for row in rows:
        if row.backend == "triton-base":
            assert "kernel_options {'backward': 'dq+dkdv'}" in row.detail
            assert "backward dq+dkdv" in row.detail
        else:
            assert "kernel_options" not in row.detail


@pytest.mark.parametrize("text, says", [
    ("{backward: 1}", "is not JSON"), ("[1]", "must be a JSON object of kernel_options"),
    ('{"backward": "gluon"}', "kernel_options['backward']: expected one of")])
def test_bad_baseline_options_make_the_baseline_unavailable_with_the_reason(
        tmp_path, monkeypatch, text, says):
    package = tmp_path / "kernels_with_planning"
    package.mkdir()
    (package / "__init__.py").write_text("from kernels import dmattn_func, prepare_mask\n")
    (package / "planning").mkdir()
    (package / "planning" / "__init__.py").write_text("")
    (package / "planning" / "schedule.py").write_text(
        "from kernels.planning.schedule import normalize_options\n")
    monkeypatch.setenv(BASELINE_ENV, str(package))
    monkeypatch.setattr("dmbench.backends.dmattn.BASELINE_MODULE", "dmbench_bad_options_test")
    monkeypatch.setenv(BASELINE_OPTIONS_ENV, text)
    reason = make_backends()["triton-base"].unavailable_reason(None)
    assert reason is not None and BASELINE_OPTIONS_ENV in reason and says in reason
