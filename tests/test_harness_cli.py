"""The dmbench command line end to end on the CPU (Triton under its interpreter).

One smoke run (module fixture) feeds the resume, plot, merge and distributed tests. The slow
ones (shards, torchrun, equiv --irregular) still run by default; they are what CI relies on.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dmbench.backends import BACKEND_NAMES
from dmbench.cli import app
from dmbench.errors import ExitCode
from dmbench.results import COLUMNS, read_rows
from dmbench.sweep import load_sweep

pytestmark = pytest.mark.interpreter  # kernels on CPU tensors (see conftest)

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "sweeps" / "smoke.yaml"
BACKENDS = "triton,reference"
runner = CliRunner()


def _invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def _fwd(out: Path, *extra: str):
    return _invoke("fwd", SMOKE, "--out", out, "--backends", BACKENDS, "--no-plot",
                   "--no-progress", *extra)


def _no_traceback(result) -> None:
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)


def _case_ids(rows) -> set[str]:
    return {r.case_id for r in rows}


@pytest.fixture(scope="module")
def smoke_csv(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smoke") / "s.csv"
    result = _fwd(out)
    assert result.exit_code == ExitCode.OK, result.output
    _no_traceback(result)
    assert "NOT performance numbers" in result.output  # the CPU note
    return out


@pytest.fixture(scope="module")
def smoke_cases() -> set[str]:
    sweep = load_sweep(SMOKE, BACKEND_NAMES)
    return {c.case_id for c in sweep.cases + tuple(s.case for s in sweep.skipped)}


def test_smoke_rows(smoke_csv, smoke_cases):
    rows = read_rows(smoke_csv)
    assert _case_ids(rows) == smoke_cases
    assert {(r.backend, r.mode) for r in rows} == {("triton", "fwd"), ("reference", "fwd")}
    assert len(rows) == 2 * len(smoke_cases)
    assert len({r.key for r in rows}) == len(rows)
    triton = [r for r in rows if r.backend == "triton"]
    assert triton and all(r.status == "ok" for r in triton), [(r.case_id, r.status, r.detail) for r in triton]
    for r in triton:
        assert r.ms_p20 <= r.ms_p50 <= r.ms_p80
        assert r.tflops_dense > 0 and r.repeats >= 1
        # smoke.yaml has check: true, so every row records its accuracy numbers.
        assert r.err_out is not None and r.allowed_out is not None and r.err_out <= r.allowed_out
        assert r.sweep == "smoke" and r.torch and r.triton and r.timestamp
    with open(smoke_csv) as f:
        assert f.readline().rstrip("\r\n").split(",") == list(COLUMNS)


def test_resume_runs_nothing_new(smoke_csv, tmp_path):
    out = tmp_path / "s.csv"
    shutil.copy(smoke_csv, out)
    before = read_rows(out)
    result = _fwd(out, "--resume")
    assert result.exit_code == ExitCode.OK, result.output
    assert f"nothing to run, all {len(before)} points already done" in result.output
    after = read_rows(out)
    assert [(r.key, r.timestamp, r.ms_p50) for r in after] == [(r.key, r.timestamp, r.ms_p50) for r in before]


def test_resume_after_a_killed_write(smoke_csv, tmp_path):
    """A half-written last line is dropped and only that point runs again."""
    out = tmp_path / "s.csv"
    text = smoke_csv.read_text()
    last = text.rstrip("\n").rsplit("\n", 1)[1]
    out.write_text(text[: len(text.rstrip("\n")) - len(last) // 2])
    before = read_rows(smoke_csv)
    result = _fwd(out, "--resume")
    assert result.exit_code == ExitCode.OK, result.output
    assert f"1 points to run, {len(before) - 1} already done" in result.output
    after = read_rows(out)
    assert {r.key for r in after} == {r.key for r in before}
    assert len(after) == len(before)


def test_compare_of_two_cpu_runs_gates_no_timing(smoke_csv, tmp_path):
    """Interpreter timings are not performance numbers: 158x slower is not a regression."""
    from dmbench.results import rewrite

    slower = read_rows(smoke_csv)
    for row in slower:
        if row.ms_p50 is not None:
            row.ms_p20, row.ms_p50, row.ms_p80 = (158 * row.ms_p20, 158 * row.ms_p50,
                                                  158 * row.ms_p80)
    rewrite(tmp_path / "slower.csv", slower)
    result = _invoke("compare", smoke_csv, tmp_path / "slower.csv")
    assert result.exit_code == ExitCode.OK, result.output
    assert "SLOWER" not in result.output
    assert sum(line.startswith("timings not compared: ") for line in result.output.splitlines()) == 1


def test_existing_output_needs_resume_or_force(smoke_csv):
    size = smoke_csv.stat().st_size
    result = _fwd(smoke_csv)
    assert result.exit_code == ExitCode.USAGE, result.output
    _no_traceback(result)
    assert "--resume" in result.output and str(smoke_csv) in result.output
    assert smoke_csv.stat().st_size == size  # nothing lost


def test_bad_sweep_path_exits_2(tmp_path):
    missing = tmp_path / "missing.yaml"
    result = _invoke("fwd", missing, "--out", tmp_path / "x.csv", "--no-plot", "--no-progress")
    assert result.exit_code == ExitCode.USAGE
    _no_traceback(result)
    assert str(missing) in result.output
    assert not (tmp_path / "x.csv").exists()


def test_bad_sweep_content_exits_2_with_one_line(tmp_path):
    sweep = tmp_path / "bad.yaml"
    sweep.write_text("cases: [{batch: 1, heads: 2, seqlen: 8, head_dim: 16, dtype: fp8}]\n")
    result = _invoke("bwd", sweep, "--out", tmp_path / "x.csv", "--no-plot", "--no-progress")
    assert result.exit_code == ExitCode.USAGE
    _no_traceback(result)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(sweep) in errors[0] and "dtype" in errors[0]


@pytest.mark.parametrize("args", [
    ["--backends", "triton,cudnn"],
    ["--shard", "2/2"],
    ["--shard", "nonsense"],
    ["--distributed"],  # not under torchrun
    ["--shard", "0/2", "--distributed"],
])
def test_bad_flags_exit_2(tmp_path, args):
    result = _invoke("fwd", SMOKE, "--out", tmp_path / "x.csv", "--no-plot", "--no-progress", *args)
    assert result.exit_code == ExitCode.USAGE, result.output
    _no_traceback(result)
    assert "error:" in result.output


def test_equiv_needs_sweep_or_irregular(tmp_path):
    result = _invoke("equiv", "--out", tmp_path / "e.csv")
    assert result.exit_code == ExitCode.USAGE
    _no_traceback(result)


def test_plot_writes_pngs(smoke_csv, tmp_path):
    result = _invoke("plot", smoke_csv, "--out-dir", tmp_path, "--baseline", "reference")
    assert result.exit_code == ExitCode.OK, result.output
    pngs = sorted(tmp_path.glob("*.png"))
    assert pngs
    listed = [line.split("plot: ", 1)[1] for line in result.output.splitlines() if line.startswith("plot: ")]
    assert {Path(p).name for p in listed} == {p.name for p in pngs}
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_rejects_foreign_csv(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("x,y\n1,2\n")
    result = _invoke("plot", bad)
    assert result.exit_code == ExitCode.USAGE
    _no_traceback(result)


def test_env_and_backends():
    result = _invoke("env")
    assert result.exit_code == ExitCode.OK, result.output
    for word in ("torch", "triton", "device", "backends:"):
        assert word in result.output
    result = _invoke("backends")
    assert result.exit_code == ExitCode.OK, result.output
    lines = result.output.splitlines()
    for name in BACKEND_NAMES:
        assert any(line.split()[:1] == [name] for line in lines), name
    triton = next(line for line in lines if line.split()[:1] == ["triton"])
    assert triton.split()[1] == "yes"  # runs under the interpreter on CPU


def test_help_lists_exit_codes():
    result = _invoke("--help")
    assert result.exit_code == 0
    assert "Exit codes" in result.output


# -- shards and merge


@pytest.fixture(scope="module")
def shard_csvs(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("shards")
    paths = []
    for i in range(2):
        out = folder / f"s{i}.csv"
        result = _fwd(out, "--shard", f"{i}/2")
        assert result.exit_code == ExitCode.OK, result.output
        assert f"shard {i}/2" in result.output
        paths.append(out)
    return paths


@pytest.mark.slow
def test_shards_split_the_cases(shard_csvs, smoke_cases):
    parts = [_case_ids(read_rows(p)) for p in shard_csvs]
    assert all(parts)
    assert not parts[0] & parts[1]
    assert parts[0] | parts[1] == smoke_cases


@pytest.mark.slow
def test_merge_shards_equals_single_run(shard_csvs, smoke_csv, tmp_path):
    out = tmp_path / "merged.csv"
    result = _invoke("merge", *shard_csvs, "--out", out, "--sweep", SMOKE)
    assert result.exit_code == ExitCode.OK, result.output
    merged, single = read_rows(out), read_rows(smoke_csv)
    assert _case_ids(merged) == _case_ids(single)
    assert sorted(r.key for r in merged) == sorted(r.key for r in single)


@pytest.mark.slow
def test_merge_reports_duplicates(shard_csvs, tmp_path):
    out = tmp_path / "merged.csv"
    result = _invoke("merge", shard_csvs[0], shard_csvs[1], shard_csvs[0], "--out", out)
    assert result.exit_code == ExitCode.USAGE, result.output
    _no_traceback(result)
    assert "duplicate" in result.output
    assert not out.exists()
    result = _invoke("merge", shard_csvs[0], shard_csvs[0], "--out", out, "--force")
    assert result.exit_code == ExitCode.USAGE
    assert len(read_rows(out)) == len(read_rows(shard_csvs[0]))


@pytest.mark.slow
def test_merge_reports_missing_cases(shard_csvs, tmp_path):
    result = _invoke("merge", shard_csvs[0], "--out", tmp_path / "m.csv", "--sweep", SMOKE)
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "missing" in result.output


# -- torchrun


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_distributed_torchrun_matches_single_run(smoke_csv, tmp_path):
    out = tmp_path / "d.csv"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_free_port()), "-m", "dmbench", "fwd", str(SMOKE), "--distributed",
           "--backends", BACKENDS, "--no-plot", "--no-progress", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        assert f.readline().rstrip("\r\n").split(",") == list(COLUMNS)
    dist_rows, single = read_rows(out), read_rows(smoke_csv)
    assert _case_ids(dist_rows) == _case_ids(single)
    # Rank 0 writes the rows in the order a single process would have.
    assert [r.key for r in dist_rows] == [r.key for r in single]
    assert all(r.status == "ok" for r in dist_rows if r.backend == "triton")


# -- equiv


@pytest.mark.slow
def test_equiv_irregular(tmp_path):
    out = tmp_path / "e.csv"
    result = _invoke("equiv", "--irregular", "--out", out, "--no-progress")
    assert result.exit_code == ExitCode.OK, result.output[-3000:]
    rows = read_rows(out)
    assert rows and all(r.mode == "equiv" and r.backend == "triton" for r in rows)
    assert all(r.status in ("ok", "skipped") for r in rows)
    ok = [r for r in rows if r.status == "ok"]
    assert len(ok) >= len(rows) // 2
    for r in ok:
        for name in ("out", "lse", "dq", "dk", "dv"):
            err, allowed = getattr(r, f"err_{name}"), getattr(r, f"allowed_{name}")
            assert err is not None and allowed is not None, (r.case_id, name)
            assert err <= allowed, (r.case_id, name, err, allowed)
    assert any(r.err_dbias is not None for r in ok)
    # The suite covers what the spec asks of it.
    assert {r.head_dim for r in rows} >= {40, 80, 96, 192, 256}
    assert any(r.seqlen_q == 1 for r in rows) and any(4095 in (r.seqlen_q, r.seqlen_k) for r in rows)
    assert any(r.heads_kv == 1 and r.heads_q > 1 for r in rows)
    checked = {(r.mask, r.mask_format) for r in ok}
    assert {("topk", "intervals"), ("sliding", "intervals"), ("document", "bool"),
            ("document", "intervals"), ("document", "varlen")} <= checked
    explicit = [r for r in ok if r.documents]
    assert explicit and all({"0", "1"} <= set(r.documents.split(",")) for r in explicit)
    assert any(r.mask_format == "varlen" and (r.batch * r.seqlen_q) % 16 for r in explicit)


FORMATS_SWEEP = """
name: formats-cli
backends: [triton, sdpa, sdpa-dense]
check: true
timing: {warmup: 0, repeats: 1, budget_s: 1.0}
defaults: {batch: 2, heads: "2/1", seqlen: 24, head_dim: 16, dtype: fp32, causal: true, mask: document, window: 8, bias: kv_row, seed: 0}
grid:
  - {mask_format: [bool, intervals, varlen]}
  - {mask: topk, window: 5, mask_format: intervals}
"""


def test_every_mask_format_through_the_cli(tmp_path):
    """Rows of each format: their columns, the same accuracy for one mask in three formats,
    and the build (the mask's, then the backend's) in build_ms and detail."""
    sweep = tmp_path / "formats-cli.yaml"
    sweep.write_text(FORMATS_SWEEP)
    out = tmp_path / "f.csv"
    result = _invoke("fwd", sweep, "--out", out, "--no-plot", "--no-progress")
    assert result.exit_code == ExitCode.OK, result.output
    rows = read_rows(out)
    assert len(rows) == 12 and all(r.status == "ok" for r in rows)
    ok = [r for r in rows if r.backend != "sdpa-dense"]  # the dense ceiling is not checked
    assert all(r.err_out <= r.allowed_out for r in ok)
    triton = {r.mask_format: r for r in ok if r.backend == "triton" and r.mask == "document"}
    assert set(triton) == {"bool", "intervals", "varlen"}
    assert len({round(r.err_out, 9) for r in triton.values()}) == 1
    assert triton["bool"].detail.startswith("build: document mask ")
    assert "prepare_mask" in triton["bool"].detail
    assert triton["intervals"].detail.startswith("build: document intervals ")
    assert triton["varlen"].detail.startswith("build: cu_seqlens ")
    for row in ok:
        build = row.detail.split("; ")[0]  # then the kernel, for sdpa
        steps = [float(part.rsplit(" ", 2)[1]) for part in build[len("build: "):].split(" + ")]
        assert row.build_ms == pytest.approx(sum(steps), rel=1e-2, abs=1e-2)
    dense = [r for r in rows if r.backend == "sdpa-dense"]
    assert all(r.build_ms is None and r.detail.startswith("sdpa kernel: ") for r in dense)
    assert all("; sdpa kernel: " in r.detail for r in ok if r.backend == "sdpa")


FAULT_SWEEP = """
name: fault
backends: [triton, reference]
timing: {warmup: 0, repeats: 1, budget_s: 1.0}
defaults: {batch: 1, heads: "2/1", head_dim: 16, dtype: fp32, causal: true, mask: none, bias: none, seed: 0}
grid:
  seqlen: [8, 16, 24]
"""


def test_device_fault_records_the_row_and_resumes_in_a_fresh_process(tmp_path, monkeypatch):
    """A point that kills the CUDA context (faked on CPU) is recorded, the process stops, and
    the same command goes on with --resume: every other point runs exactly once."""
    import dmbench.runner as runner_module

    sweep = tmp_path / "fault.yaml"
    sweep.write_text(FAULT_SWEEP)
    out = tmp_path / "fault.csv"
    args = ["fwd", str(sweep), "--out", str(out), "--no-plot", "--no-progress", "--force"]
    real_measure = runner_module.measure
    state = {"dead": False, "calls": 0}

    def measure(fn, timing, device):
        state["calls"] += 1
        if state["calls"] == 3:  # the second case's triton point
            state["dead"] = True
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        assert not state["dead"], "a point ran after the context was lost"
        return real_measure(fn, timing, device)

    execs = []
    monkeypatch.setattr(runner_module, "measure", measure)
    monkeypatch.setattr(runner_module, "context_alive", lambda device: not state["dead"])
    monkeypatch.setattr(sys, "argv", ["dmbench", *args])
    monkeypatch.setattr(os, "execv", lambda path, argv: execs.append(argv))
    result = _invoke(*args)
    _no_traceback(result)
    assert "device fault at" in result.output and "--resume" in result.output
    assert len(execs) == 1 and execs[0][1:4] == ["-m", "dmbench", "fwd"]
    assert execs[0][-1] == "--resume" and "--force" not in execs[0]
    rows = read_rows(out)
    assert [(r.backend, r.status) for r in rows] == [("triton", "ok"), ("reference", "ok"),
                                                     ("triton", "error")]
    assert rows[-1].detail.startswith("device fault, CUDA context lost: RuntimeError: CUDA error")

    state["dead"] = False  # the fresh process has a working context
    resumed = _invoke(*execs[0][3:])
    assert resumed.exit_code == ExitCode.OK, resumed.output
    rows = read_rows(out)
    assert len(rows) == 6 and len({r.key for r in rows}) == 6
    assert [r.status for r in rows].count("error") == 1


def test_a_hung_point_is_recorded_and_the_sweep_resumes_in_a_fresh_process(tmp_path,
                                                                            monkeypatch):
    """A point that gives no result within --point-timeout (faked: it waits) is written as an
    error row from the watchdog's thread, and the same command goes on with --resume in a
    fresh process. Here the replacing exec is recorded instead, and the faked exit releases
    the hung call, whose late result is then not written a second time."""
    import threading

    import dmbench.runner as runner_module

    sweep = tmp_path / "hang.yaml"
    sweep.write_text(FAULT_SWEEP)
    out = tmp_path / "hang.csv"
    args = ["fwd", str(sweep), "--out", str(out), "--no-plot", "--no-progress", "--force",
            "--point-timeout", "5"]  # the other points finish well within it
    real_measure = runner_module.measure
    released = threading.Event()
    calls = []

    def measure(fn, timing, device):
        calls.append(1)
        if len(calls) == 3:  # the second case's triton point never returns on its own
            assert released.wait(60), "the watchdog did not fire"
        return real_measure(fn, timing, device)

    execs, exits = [], []
    monkeypatch.setattr(runner_module, "measure", measure)
    monkeypatch.setattr(sys, "argv", ["dmbench", *args])
    monkeypatch.setattr(os, "execv", lambda path, argv: execs.append(argv))
    monkeypatch.setattr(os, "_exit", lambda code: exits.append(code) or released.set())
    result = _invoke(*args)
    assert "no result after 5 s at" in result.output and "--resume" in result.output
    assert len(execs) == 1 and execs[0][-1] == "--resume" and "--force" not in execs[0]
    rows = read_rows(out)
    hung = [r for r in rows if r.status == "error"]
    assert len(hung) == 1 and (hung[0].backend, hung[0].seqlen_q) == ("triton", 16)
    assert hung[0].detail == "point timeout: no result after 5 s (--point-timeout)"
    assert len({r.key for r in rows}) == len(rows) == 6
    resumed = _invoke(*execs[0][3:])
    assert resumed.exit_code == ExitCode.OK and "nothing to run" in resumed.output


def test_point_timeout_must_not_be_negative(tmp_path):
    result = _invoke("fwd", "sweeps/smoke.yaml", "--out", str(tmp_path / "x.csv"),
                     "--point-timeout", "-1")
    assert result.exit_code == ExitCode.USAGE
    assert "--point-timeout must be >= 0 seconds" in result.output


ROUNDS_SWEEP = FAULT_SWEEP.replace("timing: {warmup: 0, repeats: 1, budget_s: 1.0}",
                                   "timing: {warmup: 0, repeats: 6, budget_s: 5.0, rounds: 3}"
                                   ).replace("seqlen: [8, 16, 24]", "seqlen: [8, 16]")


def _run_with_fake_clock(tmp_path, monkeypatch, fail_at: int | None = None):
    """Run ROUNDS_SWEEP's fwd with each measure returning its own call number as every sample
    (or raising at call ``fail_at``); returns (the (case, backend) order measured, the rows)."""
    import dmbench.runner as runner_module
    from dmbench.timing import Measurement

    assert "rounds: 3" in ROUNDS_SWEEP and "seqlen: [8, 16]" in ROUNDS_SWEEP
    sweep = tmp_path / "rounds.yaml"
    sweep.write_text(ROUNDS_SWEEP)
    out = tmp_path / "rounds.csv"
    order = []
    real_timed_call = runner_module._timed_call

    def timed_call(backend, problem, mode):
        order.append((problem.case.seqlen_q, backend.name))
        return real_timed_call(backend, problem, mode)

    def measure(fn, timing, device):
        call = len(order)
        if call == fail_at:
            raise RuntimeError("boom")
        assert timing.rounds == 1 and timing.repeats == 2 and timing.budget_s == 5.0 / 3
        return Measurement((float(call),) * timing.repeats, float(call))

    monkeypatch.setattr(runner_module, "_timed_call", timed_call)
    monkeypatch.setattr(runner_module, "measure", measure)
    result = _invoke("fwd", sweep, "--out", out, "--no-plot", "--no-progress")
    _no_traceback(result)
    return order, read_rows(out)


def test_rounds_time_a_cases_points_round_robin_and_pool_their_samples(tmp_path, monkeypatch):
    order, rows = _run_with_fake_clock(tmp_path, monkeypatch)
    both = [(8, "triton"), (8, "reference")] * 3 + [(16, "triton"), (16, "reference")] * 3
    assert order == both
    by_point = {(r.seqlen_q, r.backend): r for r in rows}
    assert len(rows) == 4 and all(r.status == "ok" and r.repeats == 6 for r in rows)
    # Samples of calls 1, 3, 5 (triton) and 2, 4, 6 (reference) of the first case, pooled.
    assert by_point[8, "triton"].ms_p50 == 3.0 and by_point[8, "reference"].ms_p50 == 4.0
    assert by_point[16, "triton"].ms_p50 == 9.0 and by_point[16, "reference"].peak_mib == 12.0


def test_a_point_that_fails_in_an_early_round_is_reported_once_and_not_timed_again(
        tmp_path, monkeypatch):
    order, rows = _run_with_fake_clock(tmp_path, monkeypatch, fail_at=3)  # triton, round 2
    assert order[:6] == [(8, "triton"), (8, "reference"), (8, "triton"), (8, "reference"),
                         (8, "reference"), (16, "triton")]
    statuses = [(r.seqlen_q, r.backend, r.status) for r in rows]
    assert statuses == [(8, "triton", "error"), (8, "reference", "ok"), (16, "triton", "ok"),
                        (16, "reference", "ok")]
    assert rows[0].detail == "RuntimeError: boom" and rows[1].repeats == 6
