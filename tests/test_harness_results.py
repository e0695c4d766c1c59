"""The results CSV (schema, round trip, partial lines) and the `compare` regression gate."""

from __future__ import annotations

import csv
import math
from dataclasses import fields, replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dmbench.case import Case
from dmbench.cli import app
from dmbench.errors import ConfigError, ExitCode
from dmbench.results import (CASE_COLUMNS, COLUMNS, ENV_COLUMNS, Row, RowWriter, accuracy_failures,
                             read_rows, rewrite)

runner = CliRunner()


def _row(case: Case | None = None, backend: str = "triton", mode: str = "fwd", status: str = "ok",
         p20: float | None = 1.0, p50: float | None = 1.1, p80: float | None = 1.2, **extra) -> Row:
    case = case or Case(1, 4, 2, 64, 128, 32, 16, True, "bf16", "topk", bias="kv_row", seed=3)
    values = dict(
        sweep="unit", case_id=case.case_id, batch=case.batch, heads_q=case.heads_q,
        heads_kv=case.heads_kv, seqlen_q=case.seqlen_q, seqlen_k=case.seqlen_k,
        head_dim=case.head_dim, window=case.window, causal=case.causal, dtype=case.dtype,
        mask=case.mask, mask_shape=case.mask_shape, bias=case.bias, seed=case.seed,
        backend=backend, mode=mode, status=status, ms_p20=p20, ms_p50=p50, ms_p80=p80,
        repeats=10, gpu="Test GPU", driver="1.0", torch="2.13", triton="3.9", git_sha="abc123",
        git_dirty=False, host="h", timestamp="2026-01-01T00:00:00Z")
    values.update(extra)
    return Row(**values)


def _cases(n: int = 3) -> list[Case]:
    return [Case(1, 2, 1, 32 * (i + 1), 32 * (i + 1), 32, causal=bool(i % 2)) for i in range(n)]


def _write_csv(path: Path, rows: list[Row]) -> Path:
    rewrite(path, rows)
    return path


# -- schema and round trip


def test_row_field_order_is_columns():
    assert tuple(f.name for f in fields(Row)) == COLUMNS
    assert len(set(COLUMNS)) == len(COLUMNS)
    for name in ("case_id", "backend", "mode", "status", "ms_p20", "ms_p50", "ms_p80",
                 "tflops_dense", "tflops_active", "peak_mib", "err_out", "allowed_out",
                 "gpu", "driver", "torch", "triton", "git_sha", "git_dirty", "seed", "timestamp"):
        assert name in COLUMNS


def test_columns_are_pinned_and_case_columns_are_case_fields():
    # The CSV layout: a change here is a change of file format (ADDED_COLUMNS, readers).
    assert COLUMNS == (
        "sweep", "case_id", "batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "head_dim",
        "window", "causal", "dtype", "mask", "mask_shape", "mask_format", "documents", "bias",
        "seed", "backend", "mode", "status", "detail", "ms_p20", "ms_p50", "ms_p80", "repeats",
        "timing", "build_ms", "tflops_dense", "tflops_active", "active_fraction", "peak_mib",
        *(f"{kind}_{t}" for t in ("out", "lse", "dq", "dk", "dv", "dbias")
          for kind in ("err", "eager", "allowed")),
        "gpu", "driver", "torch", "triton", "git_sha", "git_dirty", "host", "timestamp",
        "sweep_hash")
    assert sorted(CASE_COLUMNS) == sorted(f.name for f in fields(Case))
    assert ENV_COLUMNS == ("gpu", "driver", "torch", "triton", "git_sha", "git_dirty")


def test_train_columns_share_the_environment_columns():
    from dmbench.train_results import TRAIN_COLUMNS

    assert TRAIN_COLUMNS == (
        "model", "params", "context", "batch", "keep_window", "dtype", "implementation", "mode",
        "status", "detail", "warmup", "steps", "ms_p20", "ms_p50", "ms_p80", "tokens_per_s",
        "peak_mib", "start_mib", "first_loss", "last_loss", "gpu", "driver", "torch", "triton",
        "transformers", "git_sha", "git_dirty", "host", "timestamp")
    train_env = TRAIN_COLUMNS[TRAIN_COLUMNS.index("gpu"):]
    assert COLUMNS[COLUMNS.index("gpu"):-1] == tuple(c for c in train_env if c != "transformers")


def test_header_written_in_column_order(tmp_path):
    path = tmp_path / "r.csv"
    with RowWriter(path, append=False) as writer:
        writer.write(_row())
    with open(path, newline="") as f:
        header = next(csv.reader(f))
    assert tuple(header) == COLUMNS


def test_round_trip(tmp_path):
    case_a, case_b = _cases(2)
    rows = [
        _row(),
        _row(case_a, backend="reference", mode="bwd", p20=0.25, p50=0.5, p80=0.75,
             tflops_dense=12.5, tflops_active=3.25, peak_mib=1024.0, build_ms=None, git_dirty=True),
        _row(case_b, status="error", p20=None, p50=None, p80=None, repeats=None,
             detail='RuntimeError: "quoted", with comma\nand newline'),
        _row(case_b, backend="reference", mode="equiv", err_out=1e-3, eager_out=5e-4,
             allowed_out=2e-3, err_dbias=float("nan"), allowed_dbias=1.0, window=None),
    ]
    path = tmp_path / "r.csv"
    with RowWriter(path, append=False) as writer:
        for row in rows:
            writer.write(row)
    back = read_rows(path)
    assert len(back) == len(rows)
    for a, b in zip(rows, back):
        for name in COLUMNS:
            x, y = getattr(a, name), getattr(b, name)
            if isinstance(x, float) and math.isnan(x):
                assert math.isnan(y), name
            else:
                assert x == y, name
            assert type(x) is type(y), name
    assert back[3].window is None and back[0].window == 16
    assert back[1].git_dirty is True and back[0].causal is True


def test_append_keeps_single_header(tmp_path):
    path = tmp_path / "r.csv"
    with RowWriter(path, append=False) as writer:
        writer.write(_row())
    with RowWriter(path, append=True) as writer:
        writer.write(_row(backend="reference"))
    rows = read_rows(path)
    assert [r.backend for r in rows] == ["triton", "reference"]
    with RowWriter(path, append=False) as writer:  # not appending starts over
        writer.write(_row(backend="sdpa"))
    assert [r.backend for r in read_rows(path)] == ["sdpa"]


@pytest.mark.parametrize("content", [
    "a,b,c\n1,2,3\n",
    ",".join(reversed(COLUMNS)) + "\n",
    ",".join(c for c in COLUMNS if c != "ms_p50") + "\n",
    ",".join(c for c in COLUMNS if c != "timestamp") + "\n",
    "",
])
def test_read_rows_rejects_foreign_csv(tmp_path, content):
    path = tmp_path / "foreign.csv"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        read_rows(path)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_read_rows_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        read_rows(tmp_path / "absent.csv")


def _csv_with_cell(tmp_path: Path, column: str, value: str) -> Path:
    """A one-row results CSV whose ``column`` holds ``value`` as written."""
    path = _write_csv(tmp_path / "r.csv", [_row()])
    values = next(csv.reader([path.read_text().splitlines()[1]]))
    values[COLUMNS.index(column)] = value
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        w.writerow(values)
    return path


def test_read_rows_bad_value(tmp_path):
    with pytest.raises(ConfigError, match="column batch"):
        read_rows(_csv_with_cell(tmp_path, "batch", "many"))


@pytest.mark.parametrize("timing", ["graphs", "../x", ""])
def test_read_rows_refuses_an_unknown_timing(tmp_path, timing):
    """The timing names the plot files a CSV's rows give: only the two documented values."""
    with pytest.raises(ConfigError, match="column timing: expected one of eager, cuda_graph"):
        read_rows(_csv_with_cell(tmp_path, "timing", timing))


def test_truncated_last_line(tmp_path):
    path = _write_csv(tmp_path / "r.csv", [_row(), _row(backend="reference")])
    text = path.read_text()
    path.write_text(text[: len(text) - len(text.splitlines()[-1]) // 2 - 1])  # cut the last row
    with pytest.raises(ConfigError, match="line 3"):
        read_rows(path)
    rows = read_rows(path, tolerate_partial_last_line=True)
    assert [r.backend for r in rows] == ["triton"]


def test_truncated_middle_line_is_never_tolerated(tmp_path):
    path = _write_csv(tmp_path / "r.csv", [_row(), _row(backend="reference"), _row(backend="sdpa")])
    lines = path.read_text().splitlines()
    lines[2] = lines[2][:40]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="line 3"):
        read_rows(path, tolerate_partial_last_line=True)


def test_accuracy_failures():
    assert accuracy_failures(_row(err_out=1.0, allowed_out=2.0)) == []
    assert accuracy_failures(_row(err_out=3.0, allowed_out=2.0)) == ["out"]
    assert accuracy_failures(_row(err_dq=float("nan"), allowed_dq=2.0)) == ["dq"]
    assert accuracy_failures(_row(err_dv=float("inf"), allowed_dv=2.0)) == ["dv"]


# -- compare gate through the CLI


def _timed_rows(scale: float = 1.0, spread: float = 0.05, **kw) -> list[Row]:
    rows = []
    for case in _cases():
        for backend in ("triton", "reference"):
            for mode in ("fwd", "bwd", "fwd+bwd"):
                mid = 2.0 * scale
                rows.append(_row(case, backend, mode, p20=mid * (1 - spread), p50=mid,
                                 p80=mid * (1 + spread), **kw))
    return rows


def _compare(tmp_path: Path, base: list[Row], new: list[Row], *extra: str):
    b = _write_csv(tmp_path / "base.csv", base)
    n = _write_csv(tmp_path / "new.csv", new)
    return runner.invoke(app, ["compare", str(b), str(n), *extra])


def test_compare_equal_passes(tmp_path):
    result = _compare(tmp_path, _timed_rows(), _timed_rows())
    assert result.exit_code == ExitCode.OK, result.output
    assert "18 same" in result.output


def test_compare_3x_slower_is_regression(tmp_path):
    result = _compare(tmp_path, _timed_rows(), _timed_rows(scale=3.0))
    assert result.exit_code == ExitCode.PERF_REGRESSION, result.output
    assert "SLOWER" in result.output


def test_compare_one_slower_row_is_regression(tmp_path):
    new = _timed_rows()
    new[4] = replace(new[4], ms_p20=5.8, ms_p50=6.0, ms_p80=6.2)
    result = _compare(tmp_path, _timed_rows(), new)
    assert result.exit_code == ExitCode.PERF_REGRESSION, result.output
    assert result.output.count("SLOWER") == 1
    assert new[4].case_id in result.output


def test_compare_faster_passes(tmp_path):
    result = _compare(tmp_path, _timed_rows(), _timed_rows(scale=0.3))
    assert result.exit_code == ExitCode.OK, result.output
    assert "FASTER" in result.output


def test_compare_noisy_within_quantiles_passes(tmp_path):
    # 30% slower median, above the threshold, but the new p20 is inside the baseline's p20-p80.
    base = _timed_rows(spread=0.5)
    new = _timed_rows(scale=1.3, spread=0.5)
    result = _compare(tmp_path, base, new)
    assert result.exit_code == ExitCode.OK, result.output
    # The same slowdown with tight quantiles fails: the noise rule is what let it pass.
    result = _compare(tmp_path, _timed_rows(spread=0.01), _timed_rows(scale=1.3, spread=0.01))
    assert result.exit_code == ExitCode.PERF_REGRESSION, result.output


def test_compare_threshold_option(tmp_path):
    base, new = _timed_rows(spread=0.01), _timed_rows(scale=1.3, spread=0.01)
    assert _compare(tmp_path, base, new, "--threshold", "1.5").exit_code == ExitCode.OK
    assert _compare(tmp_path, base, new, "--threshold", "0.9").exit_code == ExitCode.USAGE


def test_compare_accuracy_status_exits_3(tmp_path):
    new = _timed_rows()
    new[0] = replace(new[0], status="accuracy", detail="out over allowed error")
    result = _compare(tmp_path, _timed_rows(), new)
    assert result.exit_code == ExitCode.ACCURACY, result.output
    assert "ACCURACY" in result.output


def test_compare_recorded_error_over_allowed_exits_3(tmp_path):
    new = _timed_rows()
    new[1] = replace(new[1], err_out=0.5, allowed_out=0.01)
    assert _compare(tmp_path, _timed_rows(), new).exit_code == ExitCode.ACCURACY


def test_compare_accuracy_wins_over_regression(tmp_path):
    new = _timed_rows(scale=3.0)
    new[0] = replace(new[0], status="accuracy")
    assert _compare(tmp_path, _timed_rows(), new).exit_code == ExitCode.ACCURACY


def test_compare_broken_backend_is_regression(tmp_path):
    new = _timed_rows()
    new[2] = replace(new[2], status="error", ms_p20=None, ms_p50=None, ms_p80=None,
                     detail="RuntimeError")
    result = _compare(tmp_path, _timed_rows(), new)
    assert result.exit_code == ExitCode.PERF_REGRESSION, result.output
    assert "BROKEN" in result.output


def test_compare_unreadable_file_exits_2(tmp_path):
    good = _write_csv(tmp_path / "base.csv", _timed_rows())
    bad = tmp_path / "bad.csv"
    bad.write_text("not,a,dmbench\nfile,at,all\n")
    for args in ([str(good), str(bad)], [str(bad), str(good)],
                 [str(good), str(tmp_path / "missing.csv")]):
        result = runner.invoke(app, ["compare", *args])
        assert result.exit_code == ExitCode.USAGE, result.output
        assert "Traceback" not in result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)


def test_compare_different_gpu_exits_2(tmp_path):
    new = [replace(r, gpu="Other GPU") for r in _timed_rows()]
    assert _compare(tmp_path, _timed_rows(), new).exit_code == ExitCode.USAGE


def test_compare_duplicate_rows_exit_2(tmp_path):
    base = _timed_rows()
    assert _compare(tmp_path, base, base + base[:1]).exit_code == ExitCode.USAGE


def test_named_commit_overrides_a_stale_git(monkeypatch):
    """A tree copied to a GPU host records the commit it was made from, not the host's HEAD."""
    import torch

    from dmbench import envinfo

    monkeypatch.setenv("DMBENCH_GIT_SHA", "0123456789abcdef0123")  # not a commit here
    env = envinfo.collect(torch.device("cpu"))
    assert (env.git_sha, env.git_dirty) == ("0123456789ab", False)
    head = envinfo._git("rev-parse", "HEAD")
    if head:  # in a checkout: the named commit is compared with the tree like HEAD would be
        monkeypatch.setenv("DMBENCH_GIT_SHA", head)
        env = envinfo.collect(torch.device("cpu"))
        tracked_changes = bool(envinfo._git("status", "--porcelain", "--untracked-files=no",
                                            *envinfo.CODE_PATHSPEC))
        assert (env.git_sha, env.git_dirty) == (head[:12], tracked_changes)


def test_files_without_the_mask_format_and_documents_columns_read_with_defaults(tmp_path):
    path = _write_csv(tmp_path / "r.csv", [_row()])
    lines = list(csv.reader(path.read_text().splitlines()))
    keep = [i for i, c in enumerate(lines[0]) if c not in ("mask_format", "documents", "sweep_hash")]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([[line[i] for i in keep] for line in lines])
    (row,) = read_rows(path)
    assert (row.mask_format, row.documents, row.sweep_hash) == ("bool", "", "")


def test_mask_format_and_documents_round_trip(tmp_path):
    case = Case(2, 4, 2, 37, 37, 16, None, True, "bf16", "document", bias="kv_row",
                mask_format="varlen", documents=(0, 1, 36))
    from dmbench.envinfo import Environment
    from dmbench.results import new_row

    row = new_row("unit", case, "triton", "fwd", "ok", Environment("g", "1", "2", "3", "s", False, "h"))
    row.ms_p20, row.ms_p50, row.ms_p80 = 1.0, 1.1, 1.2  # an ok timed row has its times
    (back,) = read_rows(_write_csv(tmp_path / "r.csv", [row]))
    assert (back.mask_format, back.documents) == ("varlen", "0,1,36")
    assert back.case_id == case.case_id


def test_timing_column_sits_after_repeats_and_round_trips(tmp_path):
    assert COLUMNS.index("timing") == COLUMNS.index("repeats") + 1
    assert _row().timing == "eager"
    (back,) = read_rows(_write_csv(tmp_path / "r.csv", [_row(timing="cuda_graph")]))
    assert back.timing == "cuda_graph"


def test_files_without_the_timing_column_read_as_eager(tmp_path):
    path = _write_csv(tmp_path / "r.csv", [_row(timing="cuda_graph")])
    lines = list(csv.reader(path.read_text().splitlines()))
    keep = [i for i, c in enumerate(lines[0]) if c != "timing"]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([[line[i] for i in keep] for line in lines])
    (row,) = read_rows(path)
    assert row.timing == "eager" and row.repeats == 10


def test_committed_results_without_the_timing_column_read_as_eager():
    from dmbench.collected import sweep_csvs

    def header(path):
        with open(path, newline="") as f:
            return next(csv.reader(f))

    paths = sweep_csvs(sorted((Path(__file__).resolve().parents[1] / "results").glob("**/*.csv")))
    older = [path for path in paths if "timing" not in header(path)]
    assert older  # the H100 results were written before the column
    for path in older:
        rows = read_rows(path)
        assert rows and {r.timing for r in rows} == {"eager"}, path
