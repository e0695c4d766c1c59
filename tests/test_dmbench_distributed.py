"""Issue 6 paths not covered by the harness CLI tests: the cost-balanced assignment, a merge of
mismatched environments, and a torchrun rank killed mid-sweep followed by --resume."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dmbench import flops
from dmbench.backends import BACKEND_NAMES
from dmbench.case import Case
from dmbench.cli import app
from dmbench.distributed import assign, part_path
from dmbench.errors import ExitCode
from dmbench.results import RowWriter, new_row, read_rows
from dmbench.sweep import load_sweep

REPO = Path(__file__).resolve().parents[1]
MODES = ("fwd",)


def _cases(n: int) -> tuple[Case, ...]:
    return tuple(Case(1, 2, 1, 16 * (i + 1), 16 * (i + 1), 32) for i in range(n))


def test_assign_covers_every_case_once_and_is_deterministic():
    cases = _cases(11)
    shares = assign(cases, 3, MODES, 2)
    flat = [c for share in shares for c in share]
    assert sorted(flat, key=lambda c: c.case_id) == sorted(cases, key=lambda c: c.case_id)
    assert shares == assign(cases, 3, MODES, 2)
    for share in shares:  # each share keeps the sweep's order
        assert share == [c for c in cases if c in share]


def test_assign_balances_cost_not_count():
    big = Case(1, 16, 4, 16384, 16384, 128)
    small = _cases(6)
    shares = assign((big,) + small, 2, MODES, 1)
    with_big = next(s for s in shares if big in s)
    assert with_big == [big]  # one huge case outweighs all the small ones together
    cost = [sum(flops.estimated_cost(c, MODES, 1) for c in s) for s in shares]
    assert max(cost) == flops.estimated_cost(big, MODES, 1)


def test_merge_reports_mismatched_environments(tmp_path):
    from dmbench.envinfo import Environment

    env_a = Environment("GPU A", "1", "2.11", "3.6", "abc", False, "h1")
    env_b = replace(env_a, gpu="GPU B")
    paths = []
    for i, (env, case) in enumerate(((env_a, _cases(1)[0]), (env_b, _cases(2)[1]))):
        path = tmp_path / f"p{i}.csv"
        row = new_row("s", case, "triton", "fwd", "ok", env)
        row.ms_p20 = row.ms_p50 = row.ms_p80 = 1.0
        with RowWriter(path, append=False) as writer:
            writer.write(row)
        paths.append(path)
    result = CliRunner().invoke(app, ["merge", *map(str, paths), "--out", str(tmp_path / "m.csv")])
    assert result.exit_code == ExitCode.USAGE
    assert "mismatched environments" in result.output and "GPU A" in result.output
    assert not (tmp_path / "m.csv").exists()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of torchrun's worker with RANK=rank (its own child), from /proc."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


@pytest.mark.slow
@pytest.mark.interpreter
def test_killed_rank_then_resume_completes(tmp_path):
    sweep_path = tmp_path / "kill.yaml"
    sweep_path.write_text(textwrap.dedent("""
        name: kill
        backends: [triton, reference]
        timing: {warmup: 0, repeats: 3, budget_s: 1.0}
        defaults: {batch: 1, heads: "2/1", head_dim: 16, dtype: bf16, causal: true, mask: topk, window: 8, bias: kv_row}
        grid: {seqlen: [20, 24, 28, 32, 36, 40, 44, 48], seed: [0, 1]}
    """))
    out = tmp_path / "k.csv"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_free_port()), "-m", "dmbench", "fwd", str(sweep_path),
           "--distributed", "--no-plot", "--no-progress", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    part1 = part_path(out, 1)
    deadline = time.time() + 240
    killed = False
    while time.time() < deadline and proc.poll() is None:
        if part1.exists() and len(part1.read_text().splitlines()) >= 3:  # header + 2 rows
            pid = _rank_pid(proc.pid, 1)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed = True
                break
        time.sleep(0.05)
    output = proc.communicate(timeout=240)[0].decode(errors="replace")
    assert killed, "rank 1 finished before it could be killed:\n" + output[-2000:]
    assert proc.returncode != 0
    assert not out.exists()  # no gather happened
    survived = {r.key: r.timestamp for r in read_rows(part1, tolerate_partial_last_line=True)}
    assert survived

    cmd[cmd.index("--master-port") + 1] = str(_free_port())
    done = subprocess.run(cmd + ["--resume"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = read_rows(out)
    sweep = load_sweep(sweep_path, BACKEND_NAMES)
    expected = {(c.case_id, b, "fwd") for c in sweep.cases for b in sweep.backends}
    assert [r.key for r in rows if r.key in expected] == [r.key for r in rows]
    assert {r.key for r in rows} == expected and len(rows) == len(expected)
    by_key = {r.key: r.timestamp for r in rows}
    for key, stamp in survived.items():  # finished before the kill: kept, not measured again
        assert by_key[key] == stamp
