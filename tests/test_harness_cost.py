"""The cost model, the CPU guard built on it, and the progress ETA. Estimates only: nothing here
runs a large sweep."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import dmbench.execute as execute_module
from dmbench import cost
from dmbench.backends import BACKEND_NAMES, make_backends
from dmbench.case import Case
from dmbench.cli import app
from dmbench.errors import ConfigError, ExitCode
from dmbench.execute import MODES, cpu_guard
from dmbench.progress import Eta, make_progress
from dmbench.runner import plan_units
from dmbench.sweep import Timing, load_sweep

REPO = Path(__file__).resolve().parents[1]
SWEEPS = REPO / "sweeps"
CPU = torch.device("cpu")
runner = CliRunner()


def _estimate(sweep_name: str, command: str) -> tuple[float, int]:
    sweep = load_sweep(SWEEPS / sweep_name, BACKEND_NAMES)
    backends = make_backends()
    cases = sweep.cases + tuple(s.case for s in sweep.skipped)
    units = plan_units(sweep, cases, MODES[command], backends, CPU)
    estimates = cost.estimate_points(units, backends, sweep.timing,
                                     sweep.check or command == "equiv", "cpu")
    assert set(estimates) == {u.key for u in units}
    return sum(estimates.values()), len(units)


@pytest.mark.parametrize("name", ["smoke.yaml", "formats.yaml"])
@pytest.mark.parametrize("command", ["fwd", "bwd", "equiv"])
def test_cpu_sized_sweeps_fit_the_cpu_limit(command, name):
    seconds, points = _estimate(name, command)
    assert 1.0 < seconds <= cost.CPU_LIMIT_S
    cpu_guard(load_sweep(SWEEPS / name, BACKEND_NAMES), seconds, points, allow_slow=False)


@pytest.mark.parametrize("name", ["window.yaml", "longctx.yaml", "varlen.yaml"])
@pytest.mark.parametrize("command", ["fwd", "bwd"])
def test_long_sweeps_are_over_the_cpu_limit(command, name):
    seconds, points = _estimate(name, command)
    assert seconds > 10 * cost.CPU_LIMIT_S
    sweep = load_sweep(SWEEPS / name, BACKEND_NAMES)
    with pytest.raises(ConfigError) as info:
        cpu_guard(sweep, seconds, points, allow_slow=False)
    message = str(info.value)
    assert "\n" not in message and "sweeps/smoke.yaml" in message and "--allow-slow" in message
    cpu_guard(sweep, seconds, points, allow_slow=True)


def test_cli_refuses_window_on_cpu_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(execute_module, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(execute_module.SweepRunner, "run",
                        lambda self, units: pytest.fail("the guard let window.yaml run"))
    result = runner.invoke(app, ["fwd", str(SWEEPS / "window.yaml"), "--device", "cpu"])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert "sweeps/smoke.yaml" in lines[0] and "--allow-slow" in lines[0] and "window.yaml" in lines[0]
    assert not (tmp_path / "results").exists()


def test_interpreter_fit_is_close_to_its_measurements():
    model = cost.fit_call_model()
    assert model == cost.INTERPRETER
    for mode, flops, ms in cost.INTERPRETER_SAMPLES:
        predicted = model.overhead_s[mode] + flops / model.flops_per_s
        assert 1 / 2.5 < ms / 1e3 / predicted < 2.5, (mode, flops, ms, predicted)


def test_fit_recovers_known_constants():
    overhead = {"fwd": 0.05, "bwd": 0.2, "fwd+bwd": 0.3}
    samples = [(m, f, 1e3 * (overhead[m] + f / 4e6)) for m in overhead for f in (1e5, 1e6, 3e6)]
    model = cost.fit_call_model(samples)
    assert model.flops_per_s == pytest.approx(4e6, rel=1e-6)
    for m in overhead:
        assert model.overhead_s[m] == pytest.approx(overhead[m], abs=1e-9)


def test_estimates_grow_with_the_work_and_the_repeats():
    small = Case(1, 2, 1, 64, 64, 32)
    large = replace(small, seqlen_q=4096, seqlen_k=4096)
    timing = Timing(warmup=1, repeats=3, budget_s=1e9)
    seconds = [cost.point_seconds(c, "fwd", cost.INTERPRETER, timing, False, "cpu") for c in (small, large)]
    assert seconds[1] > 100 * seconds[0]
    more = cost.point_seconds(small, "fwd", cost.INTERPRETER, replace(timing, repeats=30), False, "cpu")
    call = cost.INTERPRETER.seconds(small, "fwd")
    assert more - seconds[0] == pytest.approx(27 * call)
    checked = cost.point_seconds(small, "fwd", cost.INTERPRETER, timing, True, "cpu")
    assert checked > seconds[0]
    native = cost.point_seconds(small, "fwd", cost.NATIVE_CPU, timing, False, "cpu")
    assert native - cost.CPU_POINT_S < (seconds[0] - cost.CPU_POINT_S) / 10


def test_budget_caps_the_timed_calls():
    timing = Timing(warmup=2, repeats=30, budget_s=1.0)
    assert cost.timed_calls(0.001, timing) == 2 + 30
    assert cost.timed_calls(10.0, timing) == 2 + 3  # never fewer than the timer's minimum
    assert cost.timed_calls(0.25, timing) == 2 + 5


def test_format_seconds():
    assert [cost.format_seconds(s) for s in (0, 0.2, 45, 200, 7500, 3 * 86400 + 4 * 3600)] == \
        ["0s", "<1s", "45s", "3m20s", "2h05m", "3d04h"]


# -- ETA


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_eta_before_the_first_point_is_the_estimate():
    clock = FakeClock()
    eta = Eta(90.0, clock)
    clock.now += 5
    assert eta.seconds() == 90.0
    assert eta.text() == "eta 1m30s"


def test_eta_is_rescaled_by_measured_progress():
    clock = FakeClock()
    eta = Eta(100.0, clock)
    clock.now += 10  # a point estimated at 50 s took 10 s: the run goes 5x faster than estimated
    eta.advance(50.0)
    assert eta.seconds() == pytest.approx(10.0)
    clock.now += 40  # the next point, estimated at 25 s, took 40 s
    eta.advance(25.0)
    assert eta.seconds() == pytest.approx(25.0 * 50 / 75)
    eta.advance(25.0)
    assert eta.seconds() == 0.0


def test_plain_progress_prints_a_cost_model_eta(capsys):
    with make_progress(3600.0, 2, "label", enabled=True) as bar:
        bar.advance(0.0, "first point (estimated free)")
    line = capsys.readouterr().out.strip()
    assert line.startswith("[label 1/2 eta 1h00m]"), line


def test_the_documented_limit_is_the_one_applied():
    from dmbench.errors import EXIT_CODES_HELP

    assert cost.CPU_LIMIT_S == 300 and "estimated over 5 minutes" in EXIT_CODES_HELP
