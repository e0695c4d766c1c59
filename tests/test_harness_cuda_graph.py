"""CUDA-graph timing (``--cuda-graph``, ``timing.cuda_graph``): the flag, the refusals, a point
whose call cannot be captured, merging rows of both timings; on a GPU
(``pytest --device cuda``) the capture itself for our kernels, sdpa and flex.

The sweep file's key, the CSV column, the report, compare and plot have their tests beside
those of the rest of each (test_harness_sweeps, test_harness_results, test_report,
test_cli_compare, test_harness_plot); the timing loop's, with stand-ins for CUDA, in
test_harness_timing.
"""

from __future__ import annotations

import gc
import os
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dmbench import execute, runner
from dmbench.backends import Backend, Bound, make_backends
from dmbench.case import Case
from dmbench.cli import app
from dmbench.device import context_alive
from dmbench.envinfo import Environment
from dmbench.errors import ExitCode
from dmbench.merge import merge_files
from dmbench.problem import make_problem
from dmbench.results import Row, new_row, read_rows, rewrite
from dmbench.sweep import Timing, sweep_from_mapping
from dmbench.timing import CaptureError, capture, point_stream

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "sweeps" / "smoke.yaml"
ENV = Environment("Test GPU", "1.0", "2.13", "3.9", "abc123", False, "host")
cli = CliRunner()



@pytest.fixture(autouse=True)
def _interpreter_setting_restored(monkeypatch):
    """A CLI run on the CPU turns Triton's interpreter on for the process (TRITON_INTERPRET);
    in a GPU session the later tests must not inherit it."""
    original = os.environ.get("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_INTERPRET", original or "")  # undone at teardown
    if original is None:
        monkeypatch.delenv("TRITON_INTERPRET")

def _invoke(*args):
    return cli.invoke(app, [str(a) for a in args])


def _one_error_line(result) -> str:
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    return errors[0]


# -- the flag and the refusals (CPU)


@pytest.mark.parametrize("command", ["fwd", "bwd"])
@pytest.mark.parametrize("flag", [True, False])
def test_the_flag_turns_cuda_graph_timing_on_over_the_sweeps(monkeypatch, command, flag):
    seen = []
    monkeypatch.setattr(execute, "execute", lambda sweep, opts, echo: seen.append(sweep) or 0)
    result = _invoke(command, SMOKE, *(["--cuda-graph"] if flag else []))
    assert result.exit_code == ExitCode.OK, result.output
    (sweep,) = seen
    assert sweep.timing.cuda_graph is flag
    assert sweep.timing.kind == ("cuda_graph" if flag else "eager")


def test_equiv_times_nothing_and_takes_no_cuda_graph_flag(tmp_path):
    result = _invoke("equiv", SMOKE, "--cuda-graph", "--out", tmp_path / "e.csv")
    assert result.exit_code == ExitCode.USAGE
    assert not (tmp_path / "e.csv").exists()


def test_cuda_graph_on_the_cpu_is_a_config_error_naming_the_flag_and_the_key(tmp_path):
    out = tmp_path / "x.csv"
    result = _invoke("fwd", SMOKE, "--cuda-graph", "--device", "cpu", "--out", out,
                     "--no-plot", "--no-progress")
    assert result.exit_code == ExitCode.USAGE == 2
    line = _one_error_line(result)
    assert "--cuda-graph" in line and "timing.cuda_graph" in line and "CUDA device" in line
    assert not out.exists()


def test_a_sweep_asking_for_cuda_graphs_is_refused_on_the_cpu(tmp_path):
    sweep = tmp_path / "graph.yaml"
    sweep.write_text("timing: {cuda_graph: true}\n"
                     "cases: [{batch: 1, heads: 2, seqlen: 8, head_dim: 16}]\n")
    result = _invoke("bwd", sweep, "--device", "cpu", "--out", tmp_path / "x.csv", "--no-plot",
                     "--no-progress")
    assert result.exit_code == ExitCode.USAGE
    assert str(sweep) in _one_error_line(result)


def test_a_file_of_cuda_graph_rows_is_not_resumed_by_an_eager_run(tmp_path):
    out = tmp_path / "s.csv"
    row = new_row("smoke", Case(1, 2, 1, 48, 48, 32), "triton", "fwd", "ok", ENV,
                  timing="cuda_graph")
    row.ms_p20 = row.ms_p50 = row.ms_p80 = 1.0
    rewrite(out, [row])
    result = _invoke("fwd", SMOKE, "--device", "cpu", "--out", out, "--resume",
                     "--backends", "reference", "--no-plot", "--no-progress")
    assert result.exit_code == ExitCode.USAGE
    line = _one_error_line(result)
    assert str(out) in line and "cuda_graph" in line and "eager" in line
    assert [r.key for r in read_rows(out)] == [row.key]  # left as it was


# -- a point whose capture fails: its row, and the points after it (CPU, a stand-in failure)


def _sweep(backends: tuple[str, ...], cases: list[dict], **timing) -> object:
    raw = {"name": "graph", "backends": list(backends), "cases": cases,
           "timing": {"warmup": 1, "repeats": 3, "budget_s": 1.0, "cuda_graph": True, **timing}}
    return sweep_from_mapping(raw, "graph.yaml", backends)


def _run(sweep, backends: dict, modes: tuple[str, ...], device: torch.device) -> list[Row]:
    rows: list[Row] = []
    units = runner.plan_units(sweep, sweep.cases, modes, backends, device)
    runner.SweepRunner(sweep, backends, device, ENV, False,
                       lambda row, unit: rows.append(row)).run(units)
    return rows


def test_a_capture_error_is_the_points_error_row_and_the_sweep_goes_on(monkeypatch):
    measured = []

    def measure(fn, timing, device):
        measured.append(timing.cuda_graph)
        if len(measured) == 1:
            raise CaptureError("cuda graph capture: RuntimeError: operation not permitted")
        return real_measure(fn, timing, device)

    real_measure = runner.measure
    monkeypatch.setattr(runner, "measure", measure)
    cases = [{"batch": 1, "heads": 2, "seqlen": 8 * (i + 1), "head_dim": 16} for i in range(2)]
    backends = make_backends()
    sweep = _sweep(("reference", "sdpa-dense"), cases)
    rows = _run(sweep, backends, ("fwd",), torch.device("cpu"))
    assert [(r.backend, r.status) for r in rows] == [("reference", "error"), ("sdpa-dense", "ok"),
                                                     ("reference", "ok"), ("sdpa-dense", "ok")]
    assert rows[0].detail == "cuda graph capture: RuntimeError: operation not permitted"
    assert rows[0].ms_p50 is None and all(r.ms_p50 for r in rows[1:])
    assert {r.timing for r in rows} == {"cuda_graph"} and measured == [True] * 4


def test_a_capture_out_of_memory_is_an_oom_row(monkeypatch):
    def measure(fn, timing, device):
        raise CaptureError("cuda graph capture: OutOfMemoryError: CUDA out of memory", oom=True)

    monkeypatch.setattr(runner, "measure", measure)
    sweep = _sweep(("reference",), [{"batch": 1, "heads": 2, "seqlen": 8, "head_dim": 16}])
    (row,) = _run(sweep, make_backends(), ("fwd",), torch.device("cpu"))
    assert (row.status, row.detail) == ("oom", "cuda graph capture: OutOfMemoryError: CUDA out "
                                               "of memory")


def test_equiv_rows_of_a_cuda_graph_sweep_say_eager_they_time_nothing():
    sweep = _sweep(("reference",), [{"batch": 1, "heads": 2, "seqlen": 8, "head_dim": 16}])
    (row,) = _run(sweep, make_backends(), ("equiv",), torch.device("cpu"))
    assert (row.status, row.timing) == ("ok", "eager")


def test_merge_reports_parts_of_different_timings(tmp_path):
    case = Case(1, 2, 1, 48, 48, 32)
    paths = []
    for i, timing in enumerate(("eager", "cuda_graph")):
        row = new_row("smoke", case, ("triton", "sdpa")[i], "fwd", "ok", ENV, timing=timing)
        row.ms_p20 = row.ms_p50 = row.ms_p80 = 1.0
        paths.append(tmp_path / f"part-{i}.csv")
        rewrite(paths[-1], [row])
    problems = merge_files(paths).problems
    assert problems == (f"mismatched timing: {paths[0]}: eager | {paths[1]}: cuda_graph",)
    assert not merge_files(paths[:1]).problems


# -- on a GPU (pytest --device cuda): the capture itself

GPU_SWEEP = """\
    name: graph
    backends: [triton, sdpa, flex]
    timing: {warmup: 2, repeats: 5, budget_s: 1.0}
    defaults: {batch: 1, heads: "4/2", seqlen: 256, head_dim: 64, causal: true}
    cases:
      - {mask: topk, window: 64, bias: kv_row}
      - {mask: sliding, window: 64, mask_format: intervals, bias: kv_row}
      - {mask: none, bias: none}
"""


def _graph_pools() -> set[tuple[int, int]]:
    """The private memory pools (of CUDA graph captures) that hold device memory."""
    return {tuple(s["segment_pool_id"]) for s in torch.cuda.memory_snapshot()
            if tuple(s["segment_pool_id"]) != (0, 0)}


@pytest.mark.parametrize("command,modes", [("fwd", {"fwd"}), ("bwd", {"bwd", "fwd+bwd"})])
def test_every_point_is_timed_as_graph_replays_on_the_gpu(device, tmp_path, command, modes):
    if device.type != "cuda":
        return
    sweep = tmp_path / "graph.yaml"
    sweep.write_text(textwrap.dedent(GPU_SWEEP))
    out = tmp_path / f"graph-{command}.csv"
    result = _invoke(command, sweep, "--cuda-graph", "--device", "cuda", "--out", out,
                     "--no-plot", "--no-progress")
    assert result.exit_code == ExitCode.OK, result.output
    rows = read_rows(out)
    assert {(r.backend, r.mode) for r in rows} == {(b, m) for b in ("triton", "sdpa", "flex")
                                                   for m in modes}
    assert len(rows) == 3 * len(modes) * 3
    bad = [(r.case_id, r.backend, r.mode, r.status, r.detail) for r in rows if r.status != "ok"]
    assert not bad
    for row in rows:
        assert row.timing == "cuda_graph"
        assert 0 < row.ms_p20 <= row.ms_p50 <= row.ms_p80 and row.repeats >= 3
        assert row.peak_mib is not None
    gc.collect()
    torch.cuda.empty_cache()


REPLAYED_CASES = (Case(1, 4, 2, 256, 256, 64, 64, True, "bf16", "topk", bias="kv_row"),
                  Case(1, 4, 2, 256, 256, 64, 64, True, "bf16", "sliding", bias="kv_row",
                       mask_format="intervals"),
                  Case(2, 4, 2, 256, 256, 64, 64, True, "bf16", "document", bias="kv_row",
                       mask_format="varlen"))


@pytest.mark.parametrize("case", REPLAYED_CASES, ids=("bool", "intervals", "varlen"))
@pytest.mark.parametrize("backend", ["triton", "sdpa", "flex"])
@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd+bwd"])
def test_a_replay_redoes_the_points_work(device, case, backend, mode):
    """What a replay writes equals what the eager call returns: the capture holds the whole
    call (had part of it run on another stream, the replay would leave it out)."""
    if device.type != "cuda":
        return
    if case.mask_format == "varlen" and backend == "sdpa":
        return  # sdpa takes the documents as a dense mask: the bool case covers it
    problem = make_problem(case, device, time_build=True)
    with point_stream(device, Timing(cuda_graph=True)):
        fn, _ = runner._timed_call(make_backends()[backend], problem, mode)
        want = [t.clone() for t in fn() if t is not None]
        written = [torch.zeros_like(t) for t in want]

        def into_written():
            for target, got in zip(written, [t for t in fn() if t is not None]):
                target.copy_(got)

        graph = capture(into_written, device)
        graph.replay()
        torch.cuda.current_stream(device).synchronize()
    assert written and all(t.abs().amax() > 0 for t in want)
    for got, expected in zip(written, want):  # atomics may reorder sums: not bitwise
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-3)


class _ReadsBack(torch.autograd.Function):
    """Doubles its input; forward and backward read a value back to the host, which a CUDA
    graph capture forbids."""

    @staticmethod
    def forward(ctx, x):
        assert x.abs().sum().item() >= 0
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        assert grad.abs().sum().item() >= 0
        return grad * 2


class _ReadsBackBackend(Backend):
    name = "reads-back"
    description = "q doubled through _ReadsBack, k and v added times 0: a call no capture takes"
    exact = False
    takes_mask = False

    def bind(self, adapted, case, want_lse):
        q, k, v = adapted["q"], adapted["k"], adapted["v"]

        def call():
            return _ReadsBack.apply(q) + 0 * (k.sum() + v.sum()), None

        return Bound(call)


def test_a_call_that_cannot_be_captured_is_an_error_row_and_the_next_point_runs(device):
    if device.type != "cuda":
        return
    gc.collect()
    torch.cuda.empty_cache()
    pools_before = _graph_pools()
    backends = {"reads-back": _ReadsBackBackend(), "sdpa": make_backends()["sdpa"]}
    cases = [{"batch": 1, "heads": "4/2", "seqlen": 128 * (i + 1), "head_dim": 64}
             for i in range(2)]
    sweep = _sweep(("reads-back", "sdpa"), cases, warmup=2, repeats=5)
    rows = _run(sweep, backends, ("fwd", "bwd", "fwd+bwd"), device)
    assert [(r.backend, r.mode) for r in rows] == [
        (b, m) for b in ("reads-back", "sdpa") for m in ("fwd", "bwd", "fwd+bwd")] * 2
    for row in rows:
        assert row.timing == "cuda_graph"
        if row.backend == "reads-back":
            assert row.status == "error", row.detail
            assert row.detail.startswith("cuda graph capture: ") and "\n" not in row.detail
        else:  # each sdpa capture came after a failed one
            assert row.status == "ok", row.detail
            assert row.ms_p50 > 0
    assert context_alive(device)
    gc.collect()
    torch.cuda.empty_cache()  # fails an internal assert while a failed capture is registered
    assert _graph_pools() <= pools_before  # no failed capture's pool left holding memory
