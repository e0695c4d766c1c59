"""The main command run again: the default results file is resumed when it holds the same run,
and a numbered file is started when it does not. An explicit --out keeps needing --resume or
--force. Runs a tiny sweep on the CPU with the default output redirected to tmp_path."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

import dmbench.execute as execute_module
from dmbench.cli import app
from dmbench.envinfo import collect
from dmbench.errors import ExitCode
from dmbench.results import COLUMNS, read_rows

runner = CliRunner()
TINY = """
name: tiny
backends: [triton, reference]
timing: {warmup: 0, repeats: 1, budget_s: 1.0}
defaults: {batch: 1, heads: "2/1", head_dim: 16, dtype: fp32, causal: true, mask: none, bias: none, seed: 0}
grid:
  seqlen: [8, 16]
"""
RUN = ("--device", "cpu", "--no-plot", "--no-progress")


@pytest.fixture
def results(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "results"
    monkeypatch.setattr(execute_module, "RESULTS_DIR", folder)
    return folder / "cpu"


@pytest.fixture
def sweep(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


def _run(sweep: Path, *extra: str, command: str = "fwd"):
    result = runner.invoke(app, [command, str(sweep), *RUN, *extra])
    assert "Traceback" not in result.output
    return result


def _stamps(path: Path) -> list[tuple]:
    return [(r.key, r.timestamp, r.ms_p50) for r in read_rows(path)]


def test_main_command_twice_resumes_the_finished_file(sweep, results):
    first = _run(sweep)
    assert first.exit_code == ExitCode.OK, first.output
    path = results / "tiny-fwd.csv"
    assert len(read_rows(path)) == 4
    before = _stamps(path)
    second = _run(sweep)
    assert second.exit_code == ExitCode.OK, second.output
    assert f"results: resuming {path}" in second.output
    assert "nothing to run, all 4 points already done" in second.output
    assert _stamps(path) == before
    assert sorted(p.name for p in results.iterdir()) == ["tiny-fwd.csv"]


def test_changed_sweep_goes_to_a_numbered_file_which_is_resumed_next(sweep, results):
    assert _run(sweep).exit_code == ExitCode.OK
    sweep.write_text(TINY.replace("seqlen: [8, 16]", "seqlen: [8, 16, 24]"))
    changed = _run(sweep)
    assert changed.exit_code == ExitCode.OK, changed.output
    numbered = results / "tiny-fwd.2.csv"
    notes = [line for line in changed.output.splitlines() if line.startswith("results: writing")]
    assert len(notes) == 1 and str(numbered) in notes[0] and "sweep content" in notes[0]
    assert len(read_rows(numbered)) == 6 and len(read_rows(results / "tiny-fwd.csv")) == 4
    again = _run(sweep)
    assert again.exit_code == ExitCode.OK, again.output
    assert f"results: resuming {numbered}" in again.output and "nothing to run" in again.output
    assert not (results / "tiny-fwd.3.csv").exists()


def test_another_commit_goes_to_a_numbered_file(sweep, results, monkeypatch):
    assert _run(sweep).exit_code == ExitCode.OK
    monkeypatch.setattr(execute_module, "collect",
                        lambda device: replace(collect(device), git_sha="0123456789ab"))
    result = _run(sweep)
    assert result.exit_code == ExitCode.OK, result.output
    assert "git_sha" in result.output and str(results / "tiny-fwd.2.csv") in result.output
    assert {r.git_sha for r in read_rows(results / "tiny-fwd.2.csv")} == {"0123456789ab"}


def test_a_killed_run_is_resumed(sweep, results):
    results.mkdir(parents=True)
    path = results / "tiny-fwd.csv"
    path.write_text(",".join(COLUMNS) + "\n")  # killed before its first row
    result = _run(sweep)
    assert result.exit_code == ExitCode.OK, result.output
    assert "resuming" in result.output and len(read_rows(path)) == 4


def test_a_file_from_before_sweep_hashes_is_kept(sweep, results):
    assert _run(sweep).exit_code == ExitCode.OK
    path = results / "tiny-fwd.csv"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(line.rsplit(",", 1)[0] for line in lines) + "\n")
    result = _run(sweep)
    assert result.exit_code == ExitCode.OK, result.output
    assert "sweep content unrecorded" in result.output
    assert len(read_rows(results / "tiny-fwd.2.csv")) == 4


def test_explicit_out_that_exists_needs_resume_or_force_in_one_line(sweep, tmp_path):
    out = tmp_path / "mine.csv"
    assert _run(sweep, "--out", str(out)).exit_code == ExitCode.OK
    size = out.stat().st_size
    result = _run(sweep, "--out", str(out))
    assert result.exit_code == ExitCode.USAGE, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and str(out) in lines[0] and "--resume" in lines[0] and "--force" in lines[0]
    assert out.stat().st_size == size
    assert _run(sweep, "--out", str(out), "--resume").exit_code == ExitCode.OK
    assert _run(sweep, "--out", str(out), "--force").exit_code == ExitCode.OK


def test_a_restart_after_a_device_fault_resumes_the_file_it_was_writing():
    from dmbench.restart import resume_argv

    numbered = Path("results/cpu/tiny-fwd.2.csv")
    assert resume_argv(["fwd", "tiny.yaml", "--force"], numbered) == \
        ["fwd", "tiny.yaml", "--out", str(numbered), "--resume"]
    assert resume_argv(["fwd", "tiny.yaml", "--out", "mine.csv"], numbered) == \
        ["fwd", "tiny.yaml", "--out", "mine.csv", "--resume"]
