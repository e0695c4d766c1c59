"""``dmbench equiv --random``: the draw (runnable, reproducible, covering every format) and one
small run end to end under the interpreter."""

from __future__ import annotations

from collections import Counter

import pytest
from typer.testing import CliRunner

from dmbench.case import FORMAT_MASKS, MASK_FORMATS, case_problem, format_problem
from dmbench.cli import app
from dmbench.errors import ExitCode
from dmbench.random_suite import random_cases
from dmbench.results import read_rows

runner = CliRunner()


@pytest.mark.parametrize("large", [False, True])
def test_draws_are_runnable_distinct_and_reproducible(large):
    cases = random_cases(300, seed=3, large=large)
    assert len(cases) == 300 and len({c.case_id for c in cases}) == 300
    assert all(case_problem(c) is None and format_problem(c) is None for c in cases)
    assert cases == random_cases(300, seed=3, large=large)
    assert cases[:20] != random_cases(20, seed=4, large=large)


def test_draws_cover_every_format_and_the_awkward_axes():
    cases = random_cases(400, seed=0, large=True)
    pairs = Counter((c.mask_format, c.mask) for c in cases)
    assert {(fmt, mask) for fmt in MASK_FORMATS for mask in FORMAT_MASKS[fmt]} <= set(pairs)
    assert {c.dtype for c in cases} == {"bf16", "fp16", "fp32"}
    assert {1, 17, 97, 1025, 4095} <= {c.seqlen_q for c in cases} | {c.seqlen_k for c in cases}
    assert {40, 80, 256} <= {c.head_dim for c in cases}
    assert any(c.heads_kv == 1 < c.heads_q for c in cases)  # MQA
    assert any(c.seqlen_q > c.seqlen_k and c.causal for c in cases)  # rows that see nothing
    documents = [c.documents for c in cases if c.documents is not None]
    assert any(0 in d for d in documents) and any(1 in d for d in documents)
    assert {c.bias for c in cases} >= {"none", "kv_row", "kv_full", "q_full", "shared"}


def test_small_draws_stay_small():
    cases = random_cases(200, seed=1, large=False)
    assert max(max(c.seqlen_q, c.seqlen_k) for c in cases) <= 97
    assert max(c.heads_q for c in cases) <= 6 and max(c.head_dim for c in cases) <= 80


@pytest.mark.interpreter
def test_equiv_random_runs_and_checks_every_tensor(tmp_path):
    out = tmp_path / "r.csv"
    result = runner.invoke(app, ["equiv", "--random", "4", "--seed", "0", "--device", "cpu",
                                 "--out", str(out), "--no-progress"])
    assert result.exit_code == ExitCode.OK, result.output[-3000:]
    rows = read_rows(out)
    assert [r.case_id for r in rows] == [c.case_id for c in random_cases(4, 0, large=False)]
    assert all(r.mode == "equiv" and r.backend == "triton" and r.status == "ok" for r in rows)
    for r in rows:
        for name in ("out", "lse", "dq", "dk", "dv"):
            err, allowed = getattr(r, f"err_{name}"), getattr(r, f"allowed_{name}")
            assert err is not None and err <= allowed, (r.case_id, name)


@pytest.mark.parametrize("args", [["--random", "0"], ["--random", "2", "--irregular"],
                                  ["--random", "2", "--seed", "-1"]])
def test_equiv_random_rejects_bad_arguments(tmp_path, args):
    result = runner.invoke(app, ["equiv", *args, "--out", str(tmp_path / "r.csv")])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "Traceback" not in result.output and "error:" in result.output
