"""Doors a new user found open in the command line. A bad sweep `name` or `heads` value is exit 2
and one line naming the file and the key, with no traceback and nothing written anywhere (the
default results folder is moved under tmp_path, so a file that escapes it shows); the help of
every command labels no flag with a type."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cli_helpers import assert_refused_in_one_line
from dmbench.cli import app
from dmbench.errors import ExitCode

runner = CliRunner()
RUN = ["--device", "cpu", "--no-progress"]
POINT = "{batch: 1, heads: 2, seqlen: 8, head_dim: 16, dtype: fp32}"
HEAD = "backends: [reference]\ntiming: {warmup: 0, repeats: 1, budget_s: 1.0}\n"


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    """tmp_path as the working folder, with the default results folder at repo/results in it:
    ``results/<gpu>/../../x`` lands in tmp_path, where the listing sees it."""
    results = tmp_path / "repo" / "results"
    results.mkdir(parents=True)
    monkeypatch.setattr("dmbench.execute.RESULTS_DIR", results)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _refused_in_one_line(root: Path, args: list[str], *named: str) -> None:
    before = _listing(root)
    assert_refused_in_one_line(runner.invoke(app, args), *named)
    assert _listing(root) == before  # nothing written, in results/ or anywhere else


# -- 1. the sweep's name names the default results files: a plain file name only

@pytest.mark.parametrize("command", ["fwd", "bwd", "equiv"])
@pytest.mark.parametrize("name", ["../../escape", "{root}/abs/escape", "a/b", "'a\\b'", "..", "''"])
def test_a_name_that_is_no_plain_file_name_is_refused(root, command, name):
    name = name.format(root=root)
    sweep = root / "s.yaml"
    sweep.write_text(f"name: {name}\n{HEAD}cases: [{POINT}]\n")
    _refused_in_one_line(root, [command, str(sweep), *RUN], f"{sweep}: name: ")


def test_a_file_stem_that_is_no_plain_file_name_is_refused(root):
    sweep = root / "...yaml"  # stem '..'
    sweep.write_text(f"{HEAD}cases: [{POINT}]\n")
    _refused_in_one_line(root, ["fwd", str(sweep), *RUN], f"{sweep}: name: absent, so the file stem '..'")


def test_a_plain_name_writes_into_the_results_folder(root):
    sweep = root / "s.yaml"
    sweep.write_text(f"name: plain\n{HEAD}cases: [{POINT}]\n")
    result = runner.invoke(app, ["fwd", str(sweep), *RUN, "--no-plot"])
    assert result.exit_code == ExitCode.OK, result.output
    assert (root / "repo" / "results" / "cpu" / "plain-fwd.csv").is_file()


# -- 2. heads whose q is not a multiple of kv, where the value reaches only points that cannot run

RULE = "heads q (3) must be a multiple of kv (2)"


@pytest.mark.parametrize("body, key", [
    ('defaults: {batch: 1, heads: "3/2", seqlen: 8, head_dim: 16, dtype: fp32}\n'
     'grid: {seqlen: [8, 16]}\n', 'defaults.heads: "3/2": '),
    ('cases: [{batch: 1, heads: {q: 3, kv: 2}, seqlen: 8, head_dim: 16}]\n',
     "cases[0].heads: {q: 3, kv: 2}: "),
    ('grid: {batch: 1, heads: "3/2", seqlen: [8, 16], head_dim: 16}\n', 'grid.heads: "3/2": '),
    ('grid: {batch: 1, heads: ["3/2", "6/4"], seqlen: 8, head_dim: 16}\n',
     "grid.heads: no point of the sweep can run: "),
])
@pytest.mark.parametrize("command", ["fwd", "equiv"])
def test_heads_that_cannot_run_are_refused(root, body, key, command):
    sweep = root / "h.yaml"
    sweep.write_text(HEAD + body)
    _refused_in_one_line(root, [command, str(sweep), *RUN], f"{sweep}: {key}", RULE)


def test_compile_cost_heads_follow_the_same_rule(root):
    _refused_in_one_line(root, ["compile-cost", "--heads", "3/2", "--device", "cpu"],
                         f"--heads: '3/2': {RULE}")


# -- 3. help: flags take no value, so no type label beside them

def _commands() -> list[str]:
    return sorted(typer.main.get_command(app).commands)


def test_every_command_is_checked():
    assert {"fwd", "bwd", "equiv", "compare", "train", "compile-cost"} <= set(_commands())


@pytest.mark.parametrize("command", ["", *_commands()])
def test_help_has_no_type_label_on_flags(command):
    result = runner.invoke(app, [*command.split(), "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output
    help_line = next(line for line in result.output.splitlines() if "--help" in line)
    assert help_line.split() == ["--help", "Show", "this", "message", "and", "exit."], help_line
