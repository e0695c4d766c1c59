"""The main command run again: the default results file is resumed when it holds the same run,
and a numbered file is started when it does not. An explicit --out keeps needing --resume or
--force (not both), and --resume continues only a file of the same sweep, command and
environment. Ctrl-C says what was written and the command that finishes it. Runs a tiny sweep on
the CPU with the default output redirected to tmp_path."""

from __future__ import annotations

import shlex
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

import dmbench.execute as execute_module
from dmbench.cli import app
from dmbench.envinfo import collect
from dmbench.errors import ExitCode
from dmbench.restart import resume_argv
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


# -- --resume continues only this run's file; not with --force

RESUME_REFUSED = ("error: --out {out}: --resume: it holds another run's rows ({reason}); resume "
                  "it with the same sweep, command and environment, or start over with --force "
                  "or another --out")


@pytest.fixture(scope="module")
def tiny_fwd_csv(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    sweep = folder / "tiny.yaml"
    sweep.write_text(TINY)
    out = folder / "tiny-fwd.csv"
    result = _run(sweep, "--out", str(out))
    assert result.exit_code == ExitCode.OK, result.output
    return out


def _one_line(result) -> str:
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    return lines[0]


def _digest(path: Path) -> str:
    from dmbench.backends import BACKEND_NAMES
    from dmbench.sweep import load_sweep, sweep_digest

    return sweep_digest(load_sweep(path, BACKEND_NAMES))


def test_resume_refuses_another_sweeps_rows(tiny_fwd_csv, tmp_path):
    out = tmp_path / "x.csv"
    out.write_bytes(tiny_fwd_csv.read_bytes())
    other = tmp_path / "other.yaml"
    other.write_text(TINY.replace("name: tiny\n", ""))
    result = _run(other, "--out", str(out), "--resume")
    assert result.exit_code == ExitCode.USAGE, result.output
    assert _one_line(result) == RESUME_REFUSED.format(out=out, reason="sweep tiny, this run other")
    same_name = tmp_path / "tiny.yaml"
    same_name.write_text(TINY.replace("seqlen: [8, 16]", "seqlen: [8, 24]"))
    result = _run(same_name, "--out", str(out), "--resume")
    assert result.exit_code == ExitCode.USAGE, result.output
    reason = f"sweep content {_digest(tiny_fwd_csv.parent / 'tiny.yaml')}, this run {_digest(same_name)}"
    assert _one_line(result) == RESUME_REFUSED.format(out=out, reason=reason)
    assert out.read_bytes() == tiny_fwd_csv.read_bytes()


@pytest.mark.parametrize("command", ["bwd", "equiv"])
def test_resume_refuses_another_commands_rows(tiny_fwd_csv, tmp_path, command):
    out = tmp_path / "x.csv"
    out.write_bytes(tiny_fwd_csv.read_bytes())
    args = [command, str(tiny_fwd_csv.parent / "tiny.yaml"), "--device", "cpu", "--no-progress",
            "--out", str(out), "--resume"]
    result = runner.invoke(app, args)
    assert result.exit_code == ExitCode.USAGE, result.output
    reason = f"fwd rows, this run dmbench {command}"
    assert _one_line(result) == RESUME_REFUSED.format(out=out, reason=reason)
    assert out.read_bytes() == tiny_fwd_csv.read_bytes()


def test_resume_refuses_another_commits_rows(tiny_fwd_csv, tmp_path, monkeypatch):
    out = tmp_path / "x.csv"
    out.write_bytes(tiny_fwd_csv.read_bytes())
    ours = read_rows(out)[0].git_sha
    monkeypatch.setattr(execute_module, "collect",
                        lambda device: replace(collect(device), git_sha="0123456789ab"))
    result = _run(tiny_fwd_csv.parent / "tiny.yaml", "--out", str(out), "--resume")
    assert result.exit_code == ExitCode.USAGE, result.output
    reason = f"git_sha {ours}, this run 0123456789ab"
    assert _one_line(result) == RESUME_REFUSED.format(out=out, reason=reason)
    assert out.read_bytes() == tiny_fwd_csv.read_bytes()


def test_resume_of_the_default_file_applies_the_same_rule(sweep, results):
    assert _run(sweep).exit_code == ExitCode.OK
    path = results / "tiny-fwd.csv"
    before = path.read_bytes()
    sweep.write_text(TINY.replace("seqlen: [8, 16]", "seqlen: [8, 24]"))
    result = _run(sweep, "--resume")
    assert result.exit_code == ExitCode.USAGE, result.output
    assert _one_line(result).startswith(f"error: {path}: --resume: it holds another run's rows "
                                        "(sweep content ")
    assert path.read_bytes() == before


@pytest.mark.parametrize("command", ["fwd", "bwd", "equiv", "train"])
def test_resume_and_force_together_are_refused(tiny_fwd_csv, tmp_path, command):
    out = tmp_path / "x.csv"
    out.write_bytes(tiny_fwd_csv.read_bytes())
    what = ["--tiny"] if command == "train" else [str(tiny_fwd_csv.parent / "tiny.yaml")]
    result = runner.invoke(app, [command, *what, "--device", "cpu", "--out", str(out),
                                 "--resume", "--force"])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert _one_line(result) == ("error: --resume and --force: choose one (--resume keeps the "
                                 "CSV's rows and runs the rest, --force starts it over)")
    assert out.read_bytes() == tiny_fwd_csv.read_bytes()


# -- Ctrl-C: one line with the points written and the command that finishes them

# triton-base is skipped without DMBENCH_BASELINE_KERNELS: each case writes a skipped row first.
INTERRUPTED = TINY.replace("backends: [triton, reference]",
                           "backends: [triton, triton-base, reference]")


def _interrupt_at_call(monkeypatch, number: int) -> None:
    import dmbench.runner as runner_module

    real_measure, calls = runner_module.measure, []

    def measure(fn, timing, device):
        calls.append(1)
        if len(calls) == number:
            raise KeyboardInterrupt
        return real_measure(fn, timing, device)

    monkeypatch.setattr(runner_module, "measure", measure)


def _interrupted(args: list[str], monkeypatch, at_call: int, done: int, out: Path) -> list[str]:
    """Run ``dmbench *args``, interrupted at its ``at_call``-th timed point; check the line and
    the CSV, and return the command line the line gives."""
    _interrupt_at_call(monkeypatch, at_call)
    monkeypatch.setattr(sys, "argv", ["dmbench", *args])
    result = runner.invoke(app, args)
    assert result.exit_code == 130, result.output
    assert "Traceback" not in result.output
    finish = resume_argv(args, out)
    assert result.output.strip().splitlines()[-1] == (
        f"interrupted: {done} of 6 points written to {out}; finish with: "
        f"{shlex.join(['dmbench', *finish])}")
    assert len(read_rows(out)) == done  # every line whole
    return finish


def test_ctrl_c_says_what_was_written_and_how_to_finish(sweep, results, monkeypatch):
    import dmbench.runner as runner_module

    real_measure = runner_module.measure
    monkeypatch.delenv("DMBENCH_BASELINE_KERNELS", raising=False)
    sweep.write_text(INTERRUPTED)
    path = results / "tiny-fwd.csv"
    # case 8: triton-base skipped, triton, reference (call 2); case 16: triton-base skipped,
    # then triton (call 3) is interrupted.
    finish = _interrupted([*map(str, ["fwd", sweep, *RUN])], monkeypatch, 3, 4, path)
    assert finish[-3:] == ["--out", str(path), "--resume"]
    rows = read_rows(path)
    # The resumed run: its first point is written, its second interrupted.
    assert _interrupted(finish, monkeypatch, 2, 5, path) == finish
    assert [r.key for r in read_rows(path)][:4] == [r.key for r in rows]
    monkeypatch.setattr(runner_module, "measure", real_measure)
    result = runner.invoke(app, finish)
    assert result.exit_code == ExitCode.OK, result.output
    assert "1 points to run, 5 already done" in result.output
    assert len({r.key for r in read_rows(path)}) == len(read_rows(path)) == 6
