"""`dmbench compare` as a gate that cannot pass on an incomplete run, and CSVs re-saved by pandas."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from dmbench.case import Case
from dmbench.cli import app
from dmbench.envinfo import Environment
from dmbench.errors import ConfigError, ExitCode
from dmbench.results import Row, new_row, read_rows, rewrite

runner = CliRunner()
ENV = Environment("Test GPU", "1.0", "2.13", "3.9", "abc123", False, "host")
CASES = (Case(1, 2, 1, 48, 48, 32, 32, True, "bf16", "topk", bias="kv_row"),
         Case(1, 4, 2, 64, 64, 32, 16, True, "fp16", "sliding", bias="q_full"),
         Case(1, 4, 1, 1, 130, 32, None, False, "bf16", "none", bias="shared"),
         Case(2, 8, 8, 17, 97, 40, None, False, "fp32", "none"))
BACKENDS = ("triton", "sdpa", "reference")


def _rows(modes: tuple[str, ...], cases=CASES, ms: float = 2.0) -> list[Row]:
    rows = []
    for case in cases:
        for backend in BACKENDS:
            for mode in modes:
                row = new_row("unit", case, backend, mode, "ok", ENV)
                row.ms_p20, row.ms_p50, row.ms_p80 = 0.95 * ms, ms, 1.05 * ms
                rows.append(row)
    return rows


def _compare(tmp_path: Path, base: list[Row], new: list[Row], *extra: str):
    b, n = tmp_path / "base.csv", tmp_path / "new.csv"
    rewrite(b, base)
    rewrite(n, new)
    return runner.invoke(app, ["compare", str(b), str(n), *extra])


def _incomplete_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("INCOMPLETE")]
    assert len(lines) == 1, output
    return lines[0]


def test_complete_comparison_passes_without_an_incomplete_line(tmp_path):
    result = _compare(tmp_path, _rows(("fwd",)), _rows(("fwd",)))
    assert result.exit_code == ExitCode.OK, result.output
    assert "INCOMPLETE" not in result.output


def test_header_only_new_file_is_incomplete(tmp_path):
    base = _rows(("bwd", "fwd+bwd"))
    result = _compare(tmp_path, base, [])
    assert result.exit_code == ExitCode.INCOMPLETE, result.output
    line = _incomplete_line(result.output)
    assert "no rows in common" in line and f"has {len(base)}" in line and "--allow-missing" in line


def test_some_rows_missing_is_incomplete_and_names_examples(tmp_path):
    base = _rows(("fwd",))
    new = base[:-5]
    result = _compare(tmp_path, base, new)
    assert result.exit_code == ExitCode.INCOMPLETE, result.output
    line = _incomplete_line(result.output)
    assert f"5 of {len(base)}" in line
    first_missing = base[-5]
    assert f"{first_missing.case_id} {first_missing.backend} {first_missing.mode}" in line
    assert "2 more" in line  # three examples, then a count


def test_fwd_against_bwd_is_incomplete(tmp_path):
    result = _compare(tmp_path, _rows(("fwd",)), _rows(("bwd", "fwd+bwd")))
    assert result.exit_code == ExitCode.INCOMPLETE, result.output
    assert "no rows in common" in _incomplete_line(result.output)


def test_nothing_in_common_is_incomplete(tmp_path):
    result = _compare(tmp_path, _rows(("fwd",), CASES[:2]), _rows(("fwd",), CASES[2:]))
    assert result.exit_code == ExitCode.INCOMPLETE, result.output


def test_new_rows_alone_do_not_make_it_incomplete(tmp_path):
    result = _compare(tmp_path, _rows(("fwd",), CASES[:2]), _rows(("fwd",)))
    assert result.exit_code == ExitCode.OK, result.output


@pytest.mark.parametrize("new_rows", [[], _rows(("fwd",))[:3], _rows(("bwd",))])
def test_allow_missing_accepts_an_incomplete_comparison(tmp_path, new_rows):
    result = _compare(tmp_path, _rows(("fwd",)), new_rows, "--allow-missing")
    assert result.exit_code == ExitCode.OK, result.output
    assert "accepted (--allow-missing)" in _incomplete_line(result.output)


def test_a_regression_wins_over_missing_rows(tmp_path):
    base = _rows(("fwd",))
    new = _rows(("fwd",), ms=6.0)[:-2]
    assert _compare(tmp_path, base, new).exit_code == ExitCode.PERF_REGRESSION


def _timed_as(rows: list[Row], timing: str) -> list[Row]:
    for row in rows:
        row.timing = timing
    return rows


def test_eager_against_cuda_graph_rows_is_refused_naming_both_files(tmp_path):
    result = _compare(tmp_path, _rows(("fwd",)), _timed_as(_rows(("fwd",)), "cuda_graph"))
    assert result.exit_code == ExitCode.USAGE, result.output
    (line,) = [line for line in result.output.splitlines() if line.strip()]
    assert "base.csv" in line and "new.csv" in line and "cuda_graph" in line and "eager" in line
    assert "Traceback" not in result.output


def test_cuda_graph_rows_against_cuda_graph_rows_compare_as_usual(tmp_path):
    base = _timed_as(_rows(("bwd", "fwd+bwd")), "cuda_graph")
    assert _compare(tmp_path, base, base).exit_code == ExitCode.OK
    slower = _timed_as(_rows(("bwd", "fwd+bwd"), ms=6.0), "cuda_graph")
    assert _compare(tmp_path, base, slower).exit_code == ExitCode.PERF_REGRESSION


def test_files_mixing_timings_never_match_rows_of_different_timing(tmp_path):
    """Both files hold eager and CUDA graph rows, but not for the same cases."""
    def mixed(first: str, second: str) -> list[Row]:
        return (_timed_as(_rows(("fwd",), CASES[:2]), first)
                + _timed_as(_rows(("fwd",), CASES[2:]), second))

    result = _compare(tmp_path, mixed("eager", "cuda_graph"), mixed("cuda_graph", "eager"))
    assert result.exit_code == ExitCode.USAGE, result.output
    assert CASES[0].case_id in result.output and "same timing" in result.output
    assert _compare(tmp_path, mixed("eager", "cuda_graph"),
                    mixed("eager", "cuda_graph")).exit_code == ExitCode.OK


# -- CPU rows: timings under Triton's interpreter are not performance numbers

CPU_ENV = Environment("cpu (triton interpreter)", "none", "2.13", "3.9", "abc123", False, "host")


def _on(rows: list[Row], env: Environment) -> list[Row]:
    for row in rows:
        row.gpu, row.driver = env.gpu, env.driver
    return rows


def _not_compared_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("timings not compared")]


def test_two_cpu_runs_gate_accuracy_and_completeness_never_timings(tmp_path):
    base = _on(_rows(("fwd", "bwd")), CPU_ENV)
    result = _compare(tmp_path, base, _on(_rows(("fwd", "bwd"), ms=316.0), CPU_ENV))
    assert result.exit_code == ExitCode.OK, result.output
    assert "SLOWER" not in result.output and "FASTER" not in result.output
    assert _not_compared_lines(result.output) == [
        f"timings not compared: {len(base)} row pair(s) ran on the CPU under Triton's "
        "interpreter, whose timings are not performance numbers; accuracy and completeness only"]
    assert f"compared: {len(base)} untimed; 0 accuracy failure(s)" in result.output


def test_two_cpu_runs_still_fail_on_accuracy_missing_rows_and_broken_rows(tmp_path):
    base = _on(_rows(("fwd",)), CPU_ENV)
    slow_and_wrong = _on(_rows(("fwd",), ms=50.0), CPU_ENV)
    slow_and_wrong[0].status, slow_and_wrong[0].detail = "accuracy", "out over allowed error"
    assert _compare(tmp_path, base, slow_and_wrong).exit_code == ExitCode.ACCURACY
    result = _compare(tmp_path, base, _on(_rows(("fwd",), ms=50.0), CPU_ENV)[:-1])
    assert result.exit_code == ExitCode.INCOMPLETE, result.output
    assert len(_not_compared_lines(result.output)) == 1
    broken = _on(_rows(("fwd",), ms=50.0), CPU_ENV)
    broken[0].status, broken[0].detail = "error", "RuntimeError: x"
    broken[0].ms_p20 = broken[0].ms_p50 = broken[0].ms_p80 = None
    result = _compare(tmp_path, base, broken)
    assert result.exit_code == ExitCode.PERF_REGRESSION, result.output
    assert "BROKEN" in result.output and "SLOWER" not in result.output


@pytest.mark.parametrize("cpu_side", ["baseline", "new"])
def test_cpu_against_gpu_is_refused_naming_the_cpu_file_and_line(tmp_path, cpu_side):
    cpu, gpu = _on(_rows(("fwd",)), CPU_ENV), _rows(("fwd",))
    base, new = (cpu, gpu) if cpu_side == "baseline" else (gpu, cpu)
    result = _compare(tmp_path, base, new)
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.strip()]
    cpu_file, gpu_file = ((tmp_path / "base.csv", tmp_path / "new.csv") if cpu_side == "baseline"
                          else (tmp_path / "new.csv", tmp_path / "base.csv"))
    assert line == (f"error: {cpu_file}: line 2: measured on cpu (triton interpreter) but "
                    f"{gpu_file} on Test GPU; interpreter timings are not performance numbers "
                    "and never compare with a GPU's: compare runs from one GPU model, or two CPU "
                    "runs (accuracy and completeness only)")


def test_two_gpu_models_are_refused_naming_a_line(tmp_path):
    other = Environment("Other GPU", "1.0", "2.13", "3.9", "abc123", False, "host")
    new = _rows(("fwd",))
    _on(new[3:], other)
    result = _compare(tmp_path, _rows(("fwd",)), new)
    assert result.exit_code == ExitCode.USAGE, result.output
    assert (f"{tmp_path / 'new.csv'}: line 5: measured on Other GPU but {tmp_path / 'base.csv'} "
            "on Test GPU; compare runs from the same GPU model") in result.output


def test_files_mixing_devices_never_match_rows_of_different_devices(tmp_path):
    """Both files hold CPU and GPU rows, but the same case on a different device."""
    def mixed(first: Environment, second: Environment) -> list[Row]:
        return _on(_rows(("fwd",), CASES[:2]), first) + _on(_rows(("fwd",), CASES[2:]), second)

    result = _compare(tmp_path, mixed(ENV, CPU_ENV), mixed(CPU_ENV, ENV))
    assert result.exit_code == ExitCode.USAGE, result.output
    assert CASES[0].case_id in result.output and "same device" in result.output


def test_exit_code_4_is_documented():
    result = runner.invoke(app, ["compare", "--help"])
    assert result.exit_code == 0
    assert "4 incomplete" in " ".join(result.output.split())
    assert int(ExitCode.INCOMPLETE) == 4


# -- CSVs re-saved by pandas


def test_csv_resaved_by_pandas_reads_back(tmp_path):
    rows = _rows(("fwd",))
    path = tmp_path / "r.csv"
    rewrite(path, rows)
    frame = pd.read_csv(path)
    assert frame["window"].dtype == float  # blanks make pandas hold the int column as floats
    frame.to_csv(path, index=False)
    assert ",32.0," in path.read_text()
    again = read_rows(path)
    assert [(r.key, r.window, r.batch, r.ms_p50) for r in again] == \
        [(r.key, r.window, r.batch, r.ms_p50) for r in rows]
    assert all(isinstance(r.window, int) for r in again if r.window is not None)


def test_csv_with_a_pandas_index_column_reads_back(tmp_path):
    rows = _rows(("fwd",))
    path = tmp_path / "r.csv"
    rewrite(path, rows)
    pd.read_csv(path).to_csv(path)  # index=True: a leading unnamed column
    assert [r.key for r in read_rows(path)] == [r.key for r in rows]


def test_non_integral_float_in_an_int_column_is_rejected(tmp_path):
    path = tmp_path / "r.csv"
    rewrite(path, _rows(("fwd",)))
    frame = pd.read_csv(path)
    frame.loc[0, "window"] = 32.5
    frame.to_csv(path, index=False)
    with pytest.raises(ConfigError, match=r"line 2: column window: expected int, got '32.5'"):
        read_rows(path)


def test_compare_of_a_pandas_resaved_baseline_passes(tmp_path):
    base = tmp_path / "base.csv"
    rewrite(base, _rows(("fwd",)))
    pd.read_csv(base).to_csv(base, index=False)
    new = tmp_path / "new.csv"
    rewrite(new, _rows(("fwd",)))
    result = runner.invoke(app, ["compare", str(base), str(new)])
    assert result.exit_code == ExitCode.OK, result.output
