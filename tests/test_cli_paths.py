"""Every path mistake, in every command, is one line naming the path and exit 2, before any work."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli_helpers import assert_refused_in_one_line
from dmbench.case import Case
from dmbench.cli import app
from dmbench.envinfo import Environment
from dmbench.errors import ExitCode
from dmbench.results import new_row, rewrite

runner = CliRunner()
SWEEP = """
name: paths
backends: [reference]
timing: {warmup: 0, repeats: 1, budget_s: 1.0}
cases:
  - {batch: 1, heads: 2, seqlen: 8, head_dim: 16, dtype: fp32}
"""


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    sweep = tmp_path / "ok.yaml"
    sweep.write_text(SWEEP)
    csv = tmp_path / "ok.csv"
    env = Environment("Test GPU", "1.0", "2.13", "3.9", "abc", False, "h")
    row = new_row("paths", Case(1, 2, 2, 8, 8, 16), "reference", "fwd", "ok", env)
    row.ms_p20 = row.ms_p50 = row.ms_p80 = 1.0
    rewrite(csv, [row])
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    folder = tmp_path / "folder"
    folder.mkdir()
    return {"sweep": sweep, "csv": csv, "file": a_file, "dir": folder,
            "missing": tmp_path / "missing", "readme": tmp_path / "README.md"}


RUN = ["--device", "cpu", "--no-progress"]
# (command line with {placeholders}, the path the message must name)
CASES = [
    ("fwd {missing}/s.yaml " + " ".join(RUN), "{missing}/s.yaml"),
    ("fwd {dir} " + " ".join(RUN), "{dir}"),
    ("bwd {missing}/s.yaml " + " ".join(RUN), "{missing}/s.yaml"),
    ("fwd {sweep} --out {dir} --no-plot " + " ".join(RUN), "{dir}"),
    ("fwd {sweep} --out {file}/x.csv --no-plot " + " ".join(RUN), "{file}/x.csv"),
    ("bwd {sweep} --out {file}/deeper/x.csv --no-plot " + " ".join(RUN), "{file}/deeper/x.csv"),
    ("equiv {missing}/s.yaml " + " ".join(RUN), "{missing}/s.yaml"),
    ("equiv {sweep} --out {dir} " + " ".join(RUN), "{dir}"),
    ("equiv --irregular --out {file}/e.csv " + " ".join(RUN), "{file}/e.csv"),
    ("plot {missing}/r.csv", "{missing}/r.csv"),
    ("plot {dir}", "{dir}"),
    ("plot {csv} --out-dir {file}", "{file}"),
    ("plot {csv} --out-dir {file}/sub", "{file}/sub"),
    ("compare {missing}/a.csv {csv}", "{missing}/a.csv"),
    ("compare {csv} {missing}/b.csv", "{missing}/b.csv"),
    ("compare {csv} {dir}", "{dir}"),
    ("merge {csv} {missing}/b.csv --out {missing}/m.csv", "{missing}/b.csv"),
    ("merge {csv} --out {dir}", "{dir}"),
    ("merge {csv} --out {file}/m.csv", "{file}/m.csv"),
    ("merge {csv} --out {missing}/m.csv --sweep {missing}/s.yaml", "{missing}/s.yaml"),
    ("merge {csv} --out {missing}/m.csv --sweep {dir}", "{dir}"),
    ("report {missing}/r.csv", "{missing}/r.csv"),
    ("report {csv} --readme {readme}", "{readme}"),
    ("report {csv} --readme {dir}", "{dir}"),
    ("fetch-peer --dest {file}", "{file}"),
]


@pytest.mark.parametrize("command,named", CASES, ids=[c.split(" ", 1)[0] + str(i) for i, (c, _) in enumerate(CASES)])
def test_bad_path_is_one_line_and_exit_2(files, tmp_path, command, named):
    args = [a.format(**files) for a in command.split()]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert_refused_in_one_line(runner.invoke(app, args), named.format(**files))
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing created


def test_an_explicit_out_in_a_new_folder_is_created(files, tmp_path):
    out = tmp_path / "new" / "deeper" / "r.csv"
    result = runner.invoke(app, ["fwd", str(files["sweep"]), "--out", str(out), "--no-plot", *RUN])
    assert result.exit_code == ExitCode.OK, result.output
    assert out.is_file()


def test_plot_into_a_new_folder(files, tmp_path):
    folder = tmp_path / "plots" / "here"
    result = runner.invoke(app, ["plot", str(files["csv"]), "--out-dir", str(folder)])
    assert result.exit_code == ExitCode.OK, result.output
    assert list(folder.glob("*.png"))
