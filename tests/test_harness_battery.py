"""``dmbench battery``: the jobs it plans from ``sweeps/``, how it spreads them over GPUs, its
exit code, and its refusals (CPU only: the jobs themselves are stand-ins here)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dmbench import battery
from dmbench.cli import app
from dmbench.errors import ConfigError, ExitCode

runner = CliRunner()


def test_every_sweep_file_is_in_the_battery_or_sized_for_the_cpu():
    jobs = battery.plan_jobs()
    planned = {(j.sweep, j.command, j.cuda_graph) for j in jobs}
    for sweep, (commands, graphs) in battery.BATTERY.items():
        for command in commands:
            assert (sweep, command, False) in planned
            graph_commands = battery.GRAPH_COMMANDS.get(sweep, commands)
            assert ((sweep, command, True) in planned) == (graphs and command in graph_commands)
    assert len(jobs) == len(planned)
    assert [j.cost for j in jobs] == sorted((j.cost for j in jobs), reverse=True)  # no history


def test_a_sweep_file_outside_the_battery_is_named(tmp_path):
    for name in ("smoke", "dense", "mine"):
        (tmp_path / f"{name}.yaml").write_text("name: x\n")
    with pytest.raises(ConfigError, match="mine: not in the battery"):
        battery.plan_jobs(sweeps_dir=tmp_path)


def test_only_takes_sweeps_of_the_battery():
    assert {j.sweep for j in battery.plan_jobs(("dense",))} == {"dense"}
    with pytest.raises(ConfigError, match="--only: .*got smoke"):
        battery.plan_jobs(("smoke",))


def _timed_csv(path: Path, first: str, last: str) -> None:
    path.write_text(f"sweep,timestamp\nx,{first}\nx,{last}\n")


def test_past_runs_order_the_jobs_and_unknown_ones_go_first(tmp_path):
    _timed_csv(tmp_path / "dense-fwd.csv", "2026-11-28T20:00:00Z", "2026-11-28T20:09:00Z")
    _timed_csv(tmp_path / "dense-bwd.csv", "2026-11-28T20:00:00Z", "2026-11-28T20:03:30Z")
    jobs = battery.plan_jobs(("dense", "gqa"), history=tmp_path)
    assert [j.stem for j in jobs][-2:] == ["dense-fwd", "dense-bwd"]
    assert [j.minutes for j in jobs][-2:] == [9.0, 3.5]
    assert {j.stem for j in jobs[:2]} == {"gqa-fwd", "gqa-bwd"}
    assert all(j.minutes is None for j in jobs[:2])


@pytest.mark.parametrize("text", ["", "sweep,timestamp\nx,2026-11-28T20:00:00Z\n",
                                  "not,a\nresults,file\n", "sweep,timestamp\nx,yesterday\nx,now\n"])
def test_a_file_without_two_timestamps_tells_no_minutes(tmp_path, text):
    (tmp_path / "f.csv").write_text(text)
    assert battery.past_minutes(tmp_path / "f.csv") is None
    assert battery.past_minutes(tmp_path / "missing.csv") is None


def test_a_job_resumes_its_csv_where_one_exists(tmp_path):
    job = battery.Job("bias", "bwd", True, 1.0)
    argv = job.argv(tmp_path, Path("sweeps"))
    assert argv[1:] == ["-m", "dmbench", "bwd", "sweeps/bias.yaml", "--out",
                        str(tmp_path / "bias-bwd-cuda-graph.csv"), "--no-plot", "--no-progress",
                        "--cuda-graph"]
    (tmp_path / "bias-bwd-cuda-graph.csv").write_text("")
    assert job.argv(tmp_path, Path("sweeps"))[-1] == "--resume"


def test_jobs_spread_over_the_gpus_one_at_a_time_each(tmp_path):
    jobs = [battery.Job(f"s{i}", "fwd", False, 10.0 - i) for i in range(7)]
    running: dict[str, int] = {}
    seen = []
    lock = threading.Lock()

    def start(argv, env, log):
        gpu = env["CUDA_VISIBLE_DEVICES"]
        with lock:
            running[gpu] = running.get(gpu, 0) + 1
            assert running[gpu] == 1  # never two jobs on one GPU
            seen.append((argv[4], gpu))
        log.write("ran\n")
        with lock:
            running[gpu] -= 1
        return 0

    done = battery.run_jobs(jobs, ["0", "1", "2"], tmp_path / "out", tmp_path / "logs",
                            lambda line: None, start=start)
    assert sorted(d.job.stem for d in done) == sorted(j.stem for j in jobs)
    assert {gpu for _, gpu in seen} <= {"0", "1", "2"}
    assert all((tmp_path / "logs" / f"{j.stem}.log").read_text() == "ran\n" for j in jobs)
    assert battery.battery_code(done) == ExitCode.OK


@pytest.mark.parametrize("codes, worst", [((0, 4, 1), ExitCode.PERF_REGRESSION),
                                          ((2, 3, 1), ExitCode.ACCURACY),
                                          ((0, 4), ExitCode.INCOMPLETE),
                                          ((0, -9), ExitCode.ACCURACY)])
def test_the_battery_exits_with_its_worst_job(codes, worst):
    job = battery.Job("s", "fwd", False, 1.0)
    done = [battery.Finished(job, "0", code, 1.0) for code in codes]
    assert battery.battery_code(done) == worst


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without a GPU")
def test_the_cli_prints_the_plan_and_refuses_a_host_without_gpus():
    result = runner.invoke(app, ["battery", "--dry-run", "--only", "dense"])
    assert result.exit_code == ExitCode.OK, result.output
    assert result.output.splitlines() == [
        "-m dmbench bwd sweeps/dense.yaml --out results/<gpu>/dense-bwd.csv --no-plot "
        "--no-progress",
        "-m dmbench fwd sweeps/dense.yaml --out results/<gpu>/dense-fwd.csv --no-plot "
        "--no-progress"]
    result = runner.invoke(app, ["battery"])
    assert result.exit_code == ExitCode.USAGE
    assert result.output.strip() == ("error: battery: no CUDA device here; the battery times "
                                     "GPU sweeps")
