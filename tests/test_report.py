"""`dmbench report`: the README headline and the full tables, generated from result CSVs."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from dmbench.case import Case
from dmbench.cli import app
from dmbench.errors import ExitCode
from dmbench.collected import collect
from dmbench.report import HEADLINE, TABLES, headline_markdown, measured_on, tables_markdown
from dmbench.results import Row, rewrite

runner = CliRunner()
GPU = "Test GPU"
CPU = "cpu (triton interpreter)"


def _rows(case: Case, sweep: str, mode: str, times: dict[str, float], gpu: str = GPU,
          sha: str = "abc1234def", stamp: str = "2026-01-01T00:00:00Z", **extra) -> list[Row]:
    rows = []
    for backend, ms in times.items():
        values = dict(
            sweep=sweep, case_id=case.case_id, batch=case.batch, heads_q=case.heads_q,
            heads_kv=case.heads_kv, seqlen_q=case.seqlen_q, seqlen_k=case.seqlen_k,
            head_dim=case.head_dim, window=case.window, causal=case.causal, dtype=case.dtype,
            mask=case.mask, mask_shape=case.mask_shape, bias=case.bias, seed=case.seed,
            backend=backend, mode=mode, status="ok", ms_p20=ms * 0.9, ms_p50=ms, ms_p80=ms * 1.1,
            repeats=10, gpu=gpu, driver="1.0", torch="2.13", triton="3.9", git_sha=sha,
            git_dirty=False, host="h", timestamp=stamp)
        values.update(extra)
        rows.append(Row(**values))
    return rows


def _masked(i: int) -> Case:
    return Case(1, 4, 2, 64 * (i + 1), 64 * (i + 1), 64, 32, True, "bf16", "topk", bias="kv_row")


def _csv(path: Path, rows: list[Row]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rewrite(path, rows)
    return path


def _readme(path: Path) -> Path:
    path.write_text(f"intro\n{HEADLINE[0]}\nold headline\n{HEADLINE[1]}\noutro\n")
    return path


# -- what the sections say


def test_headline_summarizes_targets_from_the_rows(tmp_path):
    rows = (_rows(_masked(0), "win", "fwd", {"triton": 1.0, "sdpa": 1.5, "flex": 3.0, "fdma": 2.5})
            + _rows(_masked(1), "win", "fwd", {"triton": 2.0, "sdpa": 1.0, "flex": 4.0, "fdma": 3.0})
            + _rows(_masked(2), "win", "fwd", {"triton": 1.0, "sdpa-dense": 0.1}))
    dense = [Case(2, 16, 4, 4096, 4096, 128, None, causal, "bf16", "none", bias="none")
             for causal in (False, True)]
    rows += (_rows(dense[0], "dense", "fwd", {"triton": 1.0}, tflops_dense=470.0)
             + _rows(dense[1], "dense", "fwd", {"triton": 1.0}, tflops_dense=440.0)
             + _rows(dense[0], "dense", "bwd", {"triton": 1.0}, tflops_dense=300.0))
    # Not a dense-target row: a short decode row without mask or bias.
    rows += _rows(Case(1, 4, 2, 1, 8192, 128), "dense", "fwd", {"triton": 0.1}, tflops_dense=10.0)
    collected = collect([_csv(tmp_path / "r.csv", rows)])
    text = headline_markdown(collected)

    # win/fwd: 3 cases; peers on two; faster than all on one (1.5x sdpa), 0.5x on the other;
    # fdma 2.5x and 1.5x.
    assert "| win | 3 | 1 of 2 (0.50× – 1.50×) | – | – | 1 of 2 |" in text
    # dense has no peer rows at all: no row in the targets table (not "0 of 0").
    assert "| dense |" not in text
    assert "of 0" not in text
    assert ("- No mask, no bias, D128, L ≥ 4096: fwd 1 of 2 rows at or above 450 TFLOP/s "
            "(lowest 440); bwd 1 of 1 rows at or above 250 TFLOP/s (lowest 300).") in text
    assert "docs/TARGETS.md" in text
    # The per-case rows are in the tables, not in the headline.
    case_row = "| 2.000 | 1.000 | 4.000 | 3.000 | – | 0.50× (sdpa) |"
    assert case_row not in text
    assert case_row in tables_markdown(collected)


def test_sdpa_dense_is_a_peer_only_where_the_case_has_no_mask_and_no_bias(tmp_path):
    """Without mask and bias sdpa-dense makes sdpa's own call: the faster of the two is the
    best peer there (a slow spell of one identical call is no lead); a masked case's sdpa-dense
    computes another function and stays out."""
    dense = Case(8, 32, 8, 1, 32768, 128, None, True, "bf16", "none", bias="none")
    rows = (_rows(dense, "decode", "fwd", {"triton": 0.258, "sdpa": 0.291, "sdpa-dense": 0.257})
            + _rows(_masked(0), "decode", "fwd", {"triton": 1.0, "sdpa": 2.0, "sdpa-dense": 0.5}))
    collected = collect([_csv(tmp_path / "r.csv", rows)])
    assert "| decode | 2 | 1 of 2 (1.00× – 2.00×) |" in headline_markdown(collected)
    tables = tables_markdown(collected)
    assert "| 0.258 | 0.291 | 0.257 | 1.00× (sdpa-dense) |" in tables
    assert "| 1.000 | 2.000 | 0.500 | 2.00× (sdpa) |" in tables


def test_block_sparse_time_against_the_full_tile_row(tmp_path):
    def sparse(window, fraction, times, seqlen=1024):
        case = Case(2, 4, 2, seqlen, seqlen, 64, window, False, "bf16", "block_sparse")
        return _rows(case, "sparsity", "fwd", times, active_fraction=fraction)

    rows = (sparse(1024, 1.0, {"triton": 2.0, "flex": 3.0})
            + sparse(128, 0.125, {"triton": 0.3, "flex": 0.6})
            + sparse(64, 0.0625, {"triton": 0.2})
            # No full-tile row in this group: nothing to divide by, so no table.
            + sparse(128, 0.25, {"triton": 1.0}, seqlen=512)
            # Time that falls too slowly: 0.3 of the full-tile time at 1/16.
            + sparse(2048, 1.0, {"triton": 1.0}, seqlen=2048)
            + sparse(128, 0.0625, {"triton": 0.3}, seqlen=2048))
    collected = collect([_csv(tmp_path / "r.csv", rows)])
    tables = tables_markdown(collected)
    assert "**sparsity, fwd: time ÷ time with every tile active** (B2 H4/2 L1024 D64; bias none;" in tables
    assert "| 1.0000 | 2.000 | 1.000 | 3.000 | 1.000 |" in tables
    assert "| 0.1250 | 0.300 | 0.150 | 0.600 | 0.200 |" in tables
    assert "| 0.0625 | 0.200 | 0.100 | – | – |" in tables
    assert tables.count("time with every tile active") == 2
    headline = headline_markdown(collected)
    assert ("- Block-sparse (sparsity, B2 H4/2 L1024 D64, bias none): our time at 0.0625 of the "
            "tiles ÷ with all of them, at most 0.125 wanted: fwd 0.100 (met).") in headline
    assert "(sparsity, B2 H4/2 L2048 D64, bias none)" in headline
    assert "fwd 0.300 (NOT met)." in headline
    assert "L512" not in headline  # no full-tile row: no verdict


def test_cuda_graph_rows_are_reported_apart_from_the_same_sweeps_eager_rows(tmp_path):
    def timed(timing, times, dense_tflops):
        dense = Case(2, 16, 4, 4096, 4096, 128, None, True, "bf16", "none", bias="none")
        sparse = [Case(2, 4, 2, 1024, 1024, 64, w, False, "bf16", "block_sparse")
                  for w in (1024, 64)]
        return (_rows(_masked(0), "win", "fwd", times, timing=timing)
                + _rows(dense, "win", "fwd", {"triton": 1.0}, timing=timing,
                        tflops_dense=dense_tflops)
                + _rows(sparse[0], "win", "fwd", {"triton": 2.0}, timing=timing,
                        active_fraction=1.0)
                + _rows(sparse[1], "win", "fwd", {"triton": times["triton"]}, timing=timing,
                        active_fraction=0.0625))

    eager = _csv(tmp_path / "win-fwd.csv", timed("eager", {"triton": 1.0, "sdpa": 1.5}, 470.0))
    graph = _csv(tmp_path / "win-fwd.2.csv",
                 timed("cuda_graph", {"triton": 0.5, "sdpa": 2.0}, 440.0))
    collected = collect([eager, graph])
    assert set(collected.tables) == {("win", "fwd"), ("win (CUDA graphs)", "fwd")}
    assert collected.tables[("win (CUDA graphs)", "fwd")][
        "B1 H4/2 L64 D64 topk W32 kv_row causal"] == {"triton": 0.5, "sdpa": 2.0}
    headline = headline_markdown(collected)
    assert "| win | 4 | 1 of 1 (1.50× – 1.50×) | – | – | – |" in headline
    assert "| win (CUDA graphs) | 4 | 1 of 1 (4.00× – 4.00×) | – | – | – |" in headline
    assert ("- No mask, no bias, D128, L ≥ 4096: fwd 1 of 1 rows at or above 450 TFLOP/s "
            "(lowest 470).") in headline
    assert ("- No mask, no bias, D128, L ≥ 4096 (CUDA graphs): fwd 0 of 1 rows at or above "
            "450 TFLOP/s (lowest 440).") in headline
    assert "- Block-sparse (win, B2 H4/2 L1024 D64, bias none)" in headline
    assert "- Block-sparse (win (CUDA graphs), B2 H4/2 L1024 D64, bias none)" in headline
    tables = tables_markdown(collected)
    assert "\n**win, fwd**\n" in tables and "\n**win (CUDA graphs), fwd**\n" in tables
    assert "**win (CUDA graphs): mask build, ms**" not in tables  # no build_ms in these rows
    assert "**win (CUDA graphs), fwd: time ÷ time with every tile active**" in tables


def test_measured_on_names_device_versions_and_the_commit_range(tmp_path):
    rows = (_rows(_masked(0), "s", "fwd", {"triton": 1.0}, sha="bbbbbbbbbb", stamp="2026-01-03T00:00:00Z")
            + _rows(_masked(1), "s", "fwd", {"triton": 1.0}, sha="aaaaaaaaaa", stamp="2026-01-01T00:00:00Z")
            + _rows(_masked(2), "s", "fwd", {"triton": 1.0}, sha="cccccccccc", stamp="2026-01-02T00:00:00Z",
                    git_dirty=True))
    line = measured_on(rows)
    assert line == ("Measured on: Test GPU (driver 1.0), torch 2.13, triton 3.9; 3 commits, "
                    "aaaaaaa (2026-01-01) to bbbbbbb (2026-01-03); 1 of 3 rows from a tree with "
                    "uncommitted changes.")
    assert measured_on(rows[:1]) == ("Measured on: Test GPU (driver 1.0), torch 2.13, triton 3.9; "
                                     "commit bbbbbbb (2026-01-03).")


def test_cpu_rows_get_no_targets_and_say_they_are_not_performance_numbers(tmp_path):
    rows = (_rows(_masked(0), "smoke", "fwd", {"triton": 50.0, "sdpa": 1.0, "fdma": 90.0}, gpu=CPU)
            + _rows(Case(2, 4, 2, 256, 256, 64, 256, False, "bf16", "block_sparse"), "smoke",
                    "fwd", {"triton": 9.0}, gpu=CPU, active_fraction=1.0)
            + _rows(Case(2, 4, 2, 256, 256, 64, 16, False, "bf16", "block_sparse"), "smoke",
                    "fwd", {"triton": 8.0}, gpu=CPU, active_fraction=0.0625))
    collected = collect([_csv(tmp_path / "r.csv", rows)])
    assert collected.interpreted
    for text in (headline_markdown(collected), tables_markdown(collected)):
        assert "CPU timings are not performance numbers" in text
        assert "of 0" not in text
        assert "target" not in text.replace("no target is checked", "")
        assert "faster than every peer" not in text
    assert "| smoke, fwd | 3 | triton, sdpa, fdma |" in headline_markdown(collected)
    tables = tables_markdown(collected)
    assert "vs best peer" not in tables and "×" not in tables
    assert "| B1 H4/2 L64 D64 topk W32 kv_row causal | 50.000 | 1.000 | 90.000 |" in tables


def test_rows_of_two_devices_are_refused(tmp_path):
    rows = (_rows(_masked(0), "s", "fwd", {"triton": 1.0})
            + _rows(_masked(1), "s", "fwd", {"triton": 1.0}, gpu="Other GPU"))
    result = runner.invoke(app, ["report", str(_csv(tmp_path / "r.csv", rows)), "--print"])
    assert result.exit_code == ExitCode.USAGE
    assert "2 devices" in result.output and "Traceback" not in result.output


# -- writing README.md and results/<gpu>/README.md


def test_report_writes_the_headline_and_the_tables(tmp_path):
    readme = _readme(tmp_path / "README.md")
    csv_path = _csv(tmp_path / "results" / "test-gpu" / "s-fwd.csv",
                    _rows(_masked(0), "s", "fwd", {"triton": 1.0, "flex": 2.0}))
    result = runner.invoke(app, ["report", str(csv_path), "--readme", str(readme)])
    assert result.exit_code == 0, result.output
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{HEADLINE[1]}\noutro\n")
    assert "old headline" not in text
    assert "| s | 1 | 1 of 1 (2.00× – 2.00×) | – | – | – |" in text
    assert "[results/test-gpu/README.md](results/test-gpu/README.md)" in text

    tables = tmp_path / "results" / "test-gpu" / "README.md"
    body = tables.read_text()
    assert body.startswith("# Results: Test GPU\n") and TABLES[0] in body and TABLES[1] in body
    assert "| B1 H4/2 L64 D64 topk W32 kv_row causal | 1.000 | 2.000 | 2.00× (flex) |" in body

    # Text around the tables' markers is kept, and a second run changes nothing.
    tables.write_text("# My notes\n\n" + body + "\nafter\n")
    kept = tables.read_text()
    assert runner.invoke(app, ["report", str(csv_path), "--readme", str(readme)]).exit_code == 0
    assert tables.read_text() == kept and readme.read_text() == text


def test_report_refuses_files_without_markers(tmp_path):
    csv_path = _csv(tmp_path / "r.csv", _rows(_masked(0), "s", "fwd", {"triton": 1.0}))
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n")
    result = runner.invoke(app, ["report", str(csv_path), "--readme", str(readme)])
    assert result.exit_code == ExitCode.USAGE
    assert "missing the generated-section markers" in result.output
    assert readme.read_text() == "no markers here\n"

    tables = tmp_path / "tables.md"
    tables.write_text("hand-written\n")
    result = runner.invoke(app, ["report", str(csv_path), "--readme", str(_readme(readme)),
                                 "--tables", str(tables)])
    assert result.exit_code == ExitCode.USAGE
    assert str(tables) in result.output and tables.read_text() == "hand-written\n"


def test_report_without_readme_flag_leaves_the_readme_alone_for_cpu_rows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    readme = _readme(tmp_path / "README.md")
    before = readme.read_text()
    csv_path = _csv(tmp_path / "results" / "cpu" / "smoke-fwd.csv",
                    _rows(_masked(0), "smoke", "fwd", {"triton": 5.0}, gpu=CPU))
    result = runner.invoke(app, ["report", str(csv_path)])
    assert result.exit_code == 0, result.output
    assert readme.read_text() == before
    assert "left as it is" in result.output
    assert "not performance numbers" in (tmp_path / "results" / "cpu" / "README.md").read_text()

    # GPU rows with the same command do write the README in the current folder.
    gpu_csv = _csv(tmp_path / "results" / "test-gpu" / "s-fwd.csv",
                   _rows(_masked(0), "s", "fwd", {"triton": 1.0, "sdpa": 1.5}))
    result = runner.invoke(app, ["report", str(gpu_csv)])
    assert result.exit_code == 0, result.output
    assert "| s | 1 | 1 of 1 (1.50× – 1.50×) | – | – | – |" in readme.read_text()


@pytest.mark.parametrize("where", ["two folders", "no tables folder"])
def test_report_tables_path_problems_exit_2(tmp_path, where):
    a = _csv(tmp_path / "a" / "s-fwd.csv", _rows(_masked(0), "s", "fwd", {"triton": 1.0}))
    b = _csv(tmp_path / "b" / "s-bwd.csv", _rows(_masked(0), "s", "bwd", {"triton": 1.0}))
    readme = _readme(tmp_path / "README.md")
    if where == "two folders":
        args = [str(a), str(b)]
    else:
        args = [str(a), "--tables", str(tmp_path / "missing" / "README.md")]
    result = runner.invoke(app, ["report", *args, "--readme", str(readme)])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "--tables" in result.output and "Traceback" not in result.output


def test_report_print_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    readme = _readme(tmp_path / "README.md")
    before = readme.read_text()
    csv_path = _csv(tmp_path / "results" / "test-gpu" / "s-fwd.csv",
                    _rows(_masked(0), "s", "fwd", {"triton": 1.0, "flex": 2.0}))
    result = runner.invoke(app, ["report", str(csv_path), "--print"])
    assert result.exit_code == 0, result.output
    assert "| s | 1 | 1 of 1 (2.00× – 2.00×) | – | – | – |" in result.output
    assert "| B1 H4/2 L64 D64 topk W32 kv_row causal | 1.000 | 2.000 | 2.00× (flex) |" in result.output
    assert readme.read_text() == before
    assert sorted(p.name for p in csv_path.parent.iterdir()) == ["s-fwd.csv"]


def test_tables_show_each_backends_mask_build_per_case_and_name_the_format(tmp_path):
    """One build table per sweep, from the fwd rows; a case in another format has its own row."""
    from dataclasses import replace

    case = _masked(0)
    intervals = replace(case, mask_format="intervals")
    rows = []
    for c, builds in ((case, {"triton": 5.0, "flex": 9.0}), (intervals, {"triton": 0.5})):
        for mode in ("fwd", "bwd"):
            for row in _rows(c, "long", mode, {"triton": 1.0, "flex": 2.0, "sdpa-dense": 0.5},
                             mask_format=c.mask_format):
                row.build_ms = builds.get(row.backend)
                rows.append(row)
    text = tables_markdown(collect([_csv(tmp_path / "long.csv", rows)]))
    table = text.split("**long: mask build, ms**", 1)[1].split("\n\n", 2)[1]
    assert table.splitlines() == [
        "| case | triton | flex |", "|---|---|---|",
        "| B1 H4/2 L64 D64 topk W32 kv_row causal | 5.000 | 9.000 |",
        "| B1 H4/2 L64 D64 topk W32 as intervals kv_row causal | 0.500 | – |"]
    assert "**long, fwd**" in text and "topk W32 as intervals kv_row causal | 1.000" in text


def test_report_leaves_compile_cost_and_train_files_alone(tmp_path):
    """``results/<gpu>/*.csv`` also matches other commands' files: they are named and left
    out, and the sweep rows are reported as without them."""
    from dmbench.compile_cost import COLUMNS as COST_COLUMNS
    from dmbench.train_results import TRAIN_COLUMNS

    readme = _readme(tmp_path / "README.md")
    folder = tmp_path / "results" / "test-gpu"
    csv_path = _csv(folder / "s-fwd.csv", _rows(_masked(0), "s", "fwd", {"triton": 1.0, "flex": 2.0}))
    cost, train = folder / "compile-cost.csv", folder / "train.csv"
    cost.write_text(",".join(COST_COLUMNS) + "\n")
    train.write_text(",".join(TRAIN_COLUMNS) + "\n")
    result = runner.invoke(app, ["report", str(cost), str(csv_path), str(train),
                                 "--readme", str(readme)])
    assert result.exit_code == 0, result.output
    assert f"left {cost} alone: a compile-cost file" in result.output
    assert f"left {train} alone: a train file" in result.output
    assert "| s | 1 | 1 of 1 (2.00× – 2.00×) | – | – | – |" in readme.read_text()


def test_report_knows_other_commands_files_by_their_columns(tmp_path):
    """A compile-cost or train file from before (or after) a column was added is still that
    command's file, not a sweep CSV with a bad header."""
    from dmbench.compile_cost import COLUMNS as COST_COLUMNS
    from dmbench.collected import other_command
    from dmbench.train_results import TRAIN_COLUMNS

    older_cost = tmp_path / "compile-cost-old.csv"
    older_cost.write_text(",".join(c for c in COST_COLUMNS if c != "warmup_workers") + "\n")
    newer_train = tmp_path / "train-new.csv"
    newer_train.write_text(",".join((*TRAIN_COLUMNS, "a_later_column")) + "\n")
    sweep = _csv(tmp_path / "s-fwd.csv", _rows(_masked(0), "s", "fwd", {"triton": 1.0}))
    assert other_command(older_cost) == "compile-cost"
    assert other_command(newer_train) == "train"
    assert other_command(sweep) is None


def test_rows_behind_the_best_peer_carry_their_rates_and_bound(tmp_path):
    h100 = "NVIDIA H100 80GB HBM3"
    dense = Case(2, 16, 4, 4096, 4096, 128, None, True, "bf16", "none", bias="none")
    short = Case(1, 8, 2, 256, 256, 128, None, True, "bf16", "none", bias="none")
    rows = (_rows(dense, "d", "fwd", {"triton": 1.25, "sdpa": 1.0}, gpu=h100,
                  tflops_active=400.0, active_fraction=0.5)
            + _rows(short, "d", "fwd", {"triton": 0.1, "sdpa": 0.05, "flex": 0.2}, gpu=h100,
                    tflops_active=10.0, active_fraction=0.5)
            + _rows(short, "d", "fwd", {"triton": 0.02, "sdpa": 0.03}, gpu=h100,
                    timing="cuda_graph", tflops_active=50.0, active_fraction=0.5)
            + _rows(_masked(0), "d", "fwd", {"triton": 1.0, "sdpa": 2.0}, gpu=h100))
    collected = collect([_csv(tmp_path / "d.csv", rows)])
    headline = headline_markdown(collected)
    assert ("- Behind the best peer: 2 (sweep, mode, case) rows, by what bounds them: "
            "1 compute, 1 latency") in headline
    tables = tables_markdown(collected)
    assert "**Rows behind the best peer** (2)" in tables
    # 400 of 989.4 TFLOP/s; q, k, v, out and lse of the dense case over 1.25 ms.
    dense_bytes = 2 * (2 * 16 * 4096 * 128 * 2) + 2 * (2 * 4 * 4096 * 128 * 2) + 2 * 16 * 4096 * 4
    assert (f"| d, fwd | B2 H16/4 L4096 D128 none none causal | 0.80× (sdpa) | 1.250 | – | 400 | "
            f"40% | {dense_bytes / 1.25e-3 / 1e9:.0f} | ") in tables
    assert "| compute |" in tables
    # The short row: slowest first, with its CUDA graph time beside it; it is ahead as a graph.
    assert "| d, fwd | B1 H8/2 L256 D128 none none causal | 0.50× (sdpa) | 0.100 | 0.020 | 10 | 1% |" in tables
    assert tables.index("0.50× (sdpa)") < tables.index("0.80× (sdpa)")
    assert "| latency |" in tables


def test_rows_behind_a_peer_on_an_unknown_gpu_get_no_shares_or_bound(tmp_path):
    rows = _rows(_masked(0), "d", "fwd", {"triton": 2.0, "flex": 1.0}, tflops_active=1.0)
    tables = tables_markdown(collect([_csv(tmp_path / "d.csv", rows)]))
    assert "not known for this GPU" in tables
    # No share of a peak, and so no bound: the GB/s stays, the last four cells are dashes.
    row = next(line for line in tables.splitlines() if line.startswith("| d, fwd |"))
    assert row.startswith("| d, fwd | B1 H4/2 L64 D64 topk W32 kv_row causal | 0.50× (flex) | "
                          "2.000 | – | 1 | – | ")
    assert row.endswith(" | – | – |")


def test_no_row_behind_a_peer_says_so(tmp_path):
    rows = _rows(_masked(0), "d", "fwd", {"triton": 1.0, "sdpa": 2.0})
    collected = collect([_csv(tmp_path / "d.csv", rows)])
    assert "- No row is behind the best peer." in headline_markdown(collected)
    assert "No row is behind the best peer." in tables_markdown(collected)


# -- one row per (sweep, case, backend, mode, timing) across the files


def test_two_files_with_one_key_are_refused_naming_both(tmp_path):
    """Two runs of a sweep given together would leave the table to whichever file came last."""
    readme = _readme(tmp_path / "README.md")
    before = readme.read_text()
    folder = tmp_path / "results" / "test-gpu"
    first = _csv(folder / "s-fwd.csv", _rows(_masked(0), "s", "fwd", {"triton": 1.0, "flex": 2.0}))
    second = _csv(folder / "s-fwd.2.csv",
                  _rows(_masked(1), "s", "fwd", {"triton": 1.0})
                  + _rows(_masked(0), "s", "fwd", {"flex": 3.0}))
    result = runner.invoke(app, ["report", str(first), str(second), "--readme", str(readme)])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.strip()]
    assert line == (f"error: {second}: line 3: sweep s case {_masked(0).case_id} backend flex "
                    f"mode fwd timing eager is also at {first} line 3; expected one row per "
                    "(sweep, case, backend, mode, timing): report one run of each sweep")
    assert readme.read_text() == before
    assert sorted(p.name for p in folder.iterdir()) == ["s-fwd.2.csv", "s-fwd.csv"]


def test_a_key_twice_in_one_file_is_refused(tmp_path):
    path = _csv(tmp_path / "s-fwd.csv", _rows(_masked(0), "s", "fwd", {"triton": 1.0}) * 2)
    result = runner.invoke(app, ["report", str(path), "--print"])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert f"{path}: line 3: sweep s case" in result.output
    assert f"is also at {path} line 2" in result.output


def test_one_case_in_two_sweeps_and_in_both_timings_is_not_a_duplicate(tmp_path):
    """The committed folder has such files: seqlen and headdim share a case, and a sweep's
    eager and --cuda-graph files share every case."""
    case = _masked(0)
    paths = [_csv(tmp_path / "seqlen-fwd.csv", _rows(case, "seqlen", "fwd", {"triton": 1.0})),
             _csv(tmp_path / "headdim-fwd.csv", _rows(case, "headdim", "fwd", {"triton": 2.0})),
             _csv(tmp_path / "seqlen-fwd-cuda-graph.csv",
                  _rows(case, "seqlen", "fwd", {"triton": 0.5}, timing="cuda_graph")),
             _csv(tmp_path / "seqlen-bwd.csv", _rows(case, "seqlen", "bwd", {"triton": 3.0}))]
    result = runner.invoke(app, ["report", *map(str, paths), "--print"])
    assert result.exit_code == ExitCode.OK, result.output
    tables = collect(paths).tables
    assert {key: next(iter(cases.values()))["triton"] for key, cases in tables.items()} == {
        ("seqlen", "fwd"): 1.0, ("headdim", "fwd"): 2.0, ("seqlen (CUDA graphs)", "fwd"): 0.5,
        ("seqlen", "bwd"): 3.0}


def test_every_committed_results_folder_still_reports():
    """Each folder whose README has generated tables holds one run per sweep and timing."""
    root = Path(__file__).resolve().parents[1] / "results"
    folders = [readme.parent for readme in sorted(root.rglob("README.md"))
               if TABLES[0] in readme.read_text()]
    assert len(folders) >= 2
    for folder in folders:
        assert collect(sorted(folder.glob("*.csv"))).rows, folder


def test_times_of_rows_that_spread_wide_are_marked_and_the_marker_explained(tmp_path):
    """A row whose p80 exceeds its p20 by more than WIDE_SPREAD gets ' ~' after its median, in
    its own cell only; rows at or within the bound and CPU tables get none."""
    from dmbench.collected import WIDE_SPREAD

    rows = _rows(_masked(0), "win", "fwd", {"triton": 1.0, "sdpa": 2.0})
    rows[0].ms_p20, rows[0].ms_p80 = 0.8, 0.8 * WIDE_SPREAD * 1.01  # triton: wide
    rows[1].ms_p20, rows[1].ms_p80 = 1.6, 1.6 * WIDE_SPREAD  # sdpa: at the bound, not wide
    collected = collect([_csv(tmp_path / "win-fwd.csv", rows)])
    assert collected.wide == {("win", "fwd"): {"B1 H4/2 L64 D64 topk W32 kv_row causal":
                                               {"triton"}}}
    tables = tables_markdown(collected)
    assert "| B1 H4/2 L64 D64 topk W32 kv_row causal | 1.000 ~ | 2.000 | 2.00× (sdpa) |" in tables
    assert f"more than {WIDE_SPREAD:g}x" in tables
    cpu = [Row(**{**vars(r), "gpu": CPU}) for r in rows]
    cpu_tables = tables_markdown(collect([_csv(tmp_path / "cpu" / "win-fwd.csv", cpu)]))
    assert " ~" not in cpu_tables
