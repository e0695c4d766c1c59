"""``dmbench train`` on the CPU with the tiny Doge model and one step per point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from dmbench import train  # noqa: E402
from dmbench.cli import app  # noqa: E402
from dmbench.errors import ConfigError, ExitCode  # noqa: E402

pytestmark = pytest.mark.interpreter  # kernels on CPU tensors (see conftest)

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
CONTEXT = 40  # above the tiny model's keep window (32): Doge's top-W mask is in play


def _train(out: Path, *extra):
    return runner.invoke(app, ["train", "--tiny", "--device", "cpu", "--out", str(out),
                               *map(str, extra)])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """The command as users run it: a fresh process with TRITON_INTERPRET unset, so the CLI
    itself must set it before anything imports triton."""
    out = tmp_path_factory.mktemp("train") / "train.csv"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "dmbench", "train", "--tiny", "--device", "cpu", "--out", str(out),
         "--contexts", str(CONTEXT), "--steps", "1", "--warmup", "0",
         "--implementations", "dmattn,eager,sdpa,flex"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == ExitCode.OK, done.stdout + done.stderr
    assert "NOT performance numbers" in done.stdout
    return out


def _rows(path: Path) -> dict[tuple[str, str], train.TrainRow]:
    return {(r.implementation, r.mode): r for r in train.read_train_rows(path)}


def test_tiny_run_times_one_step_per_implementation(tiny_run):
    import transformers

    rows = _rows(tiny_run)
    assert set(rows) == {(i, m) for i in ("dmattn", "eager", "sdpa", "flex")
                         for m in train.MODES}
    for name in ("dmattn", "eager"):
        row = rows[name, "eager"]
        assert row.status == "ok", row.detail
        assert row.context == CONTEXT and row.steps == 1 and row.params > 0
        assert row.tokens_per_s > 0 and row.ms_p50 > 0
        assert row.gpu.startswith("cpu") and row.torch == torch.__version__
        assert row.transformers == transformers.__version__ and row.git_sha
    for key, row in rows.items():
        if key[1] == "compiled" or key[0] in ("flex", "sdpa"):
            assert row.status == "skipped" and row.detail
    # transformers 5.17's Doge under sdpa is not causal (see test_causal_probe).
    assert "not causal" in rows["sdpa", "eager"].detail


def test_tiny_run_dmattn_loss_equals_eager(tiny_run):
    """Same weights and tokens: the first step's loss is the same function on both paths."""
    rows = _rows(tiny_run)
    ours, eager = rows["dmattn", "eager"].first_loss, rows["eager", "eager"].first_loss
    assert ours == pytest.approx(eager, rel=1e-5)


def test_tiny_run_plots_throughput_and_speedup(tiny_run):
    for chart in ("throughput", "speedup"):
        assert (tiny_run.parent / f"train-{chart}.png").stat().st_size > 0
    assert not (tiny_run.parent / "train-memory.png").exists()  # no peak memory on CPU


def test_existing_csv_needs_force(tiny_run):
    result = _train(tiny_run, "--contexts", CONTEXT, "--steps", 1, "--warmup", 0)
    assert result.exit_code == ExitCode.USAGE
    assert "--force" in result.output


@pytest.mark.parametrize("args, message", [
    (("--contexts", "1024"), "at most"),
    (("--contexts", "two"), "--contexts"),
    (("--implementations", "eager,fa2"), "--implementations"),
    (("--modes", "jit"), "--modes"),
    (("--steps", "0"), "--steps"),
    (("--dtype", "int8"), "--dtype"),
])
def test_bad_flags_are_one_line_errors(tmp_path, args, message):
    result = _train(tmp_path / "t.csv", *args)
    assert result.exit_code == ExitCode.USAGE, result.output
    assert message in result.output and "Traceback" not in result.output


def test_cpu_refuses_the_full_model(tmp_path):
    result = runner.invoke(app, ["train", "--device", "cpu", "--out", str(tmp_path / "t.csv")])
    assert result.exit_code == ExitCode.USAGE
    assert "--tiny" in result.output


def _failing_build(monkeypatch):
    """eager runs out of memory at 16; dmattn raises an error at 16 and, at 24, an
    out-of-memory error that a compiler re-raised under another type."""
    real_build = train.build_model

    def build(size, context, implementation, dtype, device):
        if implementation == "eager" and context == 16:
            raise torch.OutOfMemoryError("CUDA out of memory")
        if implementation == "dmattn" and context == 16:
            raise RuntimeError("no kernel\nsecond line")
        if implementation == "dmattn" and context == 24:
            wrapped = RuntimeError("backend compiler failed")
            raise wrapped from RuntimeError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return real_build(size, context, implementation, dtype, device)

    monkeypatch.setattr(train, "build_model", build)


def _options(out: Path, contexts, **changes) -> train.TrainOptions:
    values = dict(contexts=contexts, steps=1, warmup=0, tiny=True, device="cpu",
                  implementations=("eager", "dmattn"), modes=("eager",), out=out, plot=False)
    return train.TrainOptions(**{**values, **changes})


def _by_point(path: Path) -> dict[tuple[int, str], train.TrainRow]:
    return {(r.context, r.implementation): r for r in train.read_train_rows(path)}


def test_out_of_memory_is_a_row_and_the_run_goes_on(tmp_path, monkeypatch):
    _failing_build(monkeypatch)
    opts = _options(tmp_path / "t.csv", (16, 24, 32))
    assert train.run_train(opts, lambda _: None) == ExitCode.OK
    rows = _by_point(opts.out)
    assert rows[16, "eager"].status == "oom"
    assert rows[24, "eager"].status == rows[32, "eager"].status == "skipped"
    assert rows[24, "eager"].detail == "out of memory at context 16"
    assert rows[16, "dmattn"].status == "error"
    assert rows[16, "dmattn"].detail == "build: RuntimeError: no kernel"
    assert rows[24, "dmattn"].status == "oom"  # an error skips nothing later; a wrapped OOM
    assert rows[32, "dmattn"].status == "skipped"


def test_resume_runs_only_the_missing_points(tmp_path, monkeypatch):
    _failing_build(monkeypatch)
    out = tmp_path / "t.csv"
    assert train.run_train(_options(out, (16,)), lambda _: None) == ExitCode.OK
    first = _by_point(out)
    with open(out, "a") as f:
        f.write("doge-tiny,123,40")  # a line cut short by a killed run
    lines = []
    opts = _options(out, (16, 24), resume=True)
    assert train.run_train(opts, lines.append) == ExitCode.OK
    rows = _by_point(out)
    assert set(rows) == {(c, i) for c in (16, 24) for i in ("eager", "dmattn")}
    assert rows[16, "eager"].timestamp == first[16, "eager"].timestamp  # kept, not rerun
    assert rows[24, "eager"].detail == "out of memory at context 16"  # from the kept row
    assert rows[24, "dmattn"].status == "oom"
    assert f"resuming {out}: 2 rows kept" in lines


def test_resume_refuses_rows_of_another_setup(tmp_path):
    out = tmp_path / "t.csv"
    assert train.run_train(_options(out, (16,), implementations=("eager",)),
                           lambda _: None) == ExitCode.OK
    with pytest.raises(ConfigError, match="steps 1, this run has 2"):
        train.run_train(_options(out, (24,), steps=2, resume=True), lambda _: None)
    with pytest.raises(ConfigError, match="--resume to finish it or --force"):
        train.run_train(_options(out, (24,)), lambda _: None)


def test_causal_probe():
    """Our implementation and eager are causal; transformers 5.17's Doge under sdpa is not
    (its float mask turns off sdpa's causal flag), so dmbench train skips it."""
    from kernels.integrations.transformers import register

    register()
    assert train._causal_probe("eager") and train._causal_probe("dmattn")
    assert not train._causal_probe("sdpa")


def test_other_csvs_are_rejected(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ConfigError, match="not a dmbench train CSV"):
        train.read_train_rows(path)


def test_compiled_mode_records_graph_breaks(monkeypatch):
    # Dynamo's "eager" backend traces the model as inductor would, without code generation.
    monkeypatch.setattr(train, "COMPILE_BACKEND", "eager")
    opts = train.TrainOptions(contexts=(CONTEXT,), steps=1, warmup=0, tiny=True, device="cpu")
    measured = train.run_point(train.TINY, CONTEXT, "eager", "compiled", opts, torch.float32,
                               torch.device("cpu"))
    assert measured["status"] == "ok", measured["detail"]
    assert measured["detail"].startswith("graph breaks: ")


def test_compiled_dmattn_has_no_graph_break(monkeypatch):
    """The whole Doge step, top-W intervals and kernels' custom ops included, is captured;
    AOT autograd's "aot_eager" backend also runs the custom ops' fake implementations."""
    from kernels.integrations.transformers import register

    register()
    monkeypatch.setattr(train, "COMPILE_BACKEND", "aot_eager")
    opts = train.TrainOptions(contexts=(CONTEXT,), steps=1, warmup=1, tiny=True, device="cpu")
    compiled, plain = (train.run_point(train.TINY, CONTEXT, "dmattn", mode, opts, torch.float32,
                                       torch.device("cpu")) for mode in ("compiled", "eager"))
    assert compiled["status"] == "ok", compiled["detail"]
    assert compiled["detail"] == "graph breaks: 0"
    assert compiled["first_loss"] == pytest.approx(plain["first_loss"], rel=1e-5)


@pytest.mark.parametrize("implementation", list(train.IMPLEMENTATIONS))
def test_each_implementation_builds_its_own_model(implementation):
    """Same weights, each with the attention it names (else the loss check above is void)."""
    from kernels.integrations.transformers import register

    register()  # as run_train does
    model = train.build_model(train.TINY, CONTEXT, implementation, torch.float32,
                              torch.device("cpu"))
    assert model.config._attn_implementation == train.IMPLEMENTATIONS[implementation]
    reference = train.build_model(train.TINY, CONTEXT, "eager", torch.float32, torch.device("cpu"))
    for (name, ours), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(ours, theirs), name


# -- dmbench generate: the decode mode


def test_generate_times_decode_steps_per_implementation(tmp_path):
    out = tmp_path / "generate.csv"
    result = runner.invoke(app, ["generate", "--tiny", "--device", "cpu", "--out", str(out),
                                 "--contexts", str(CONTEXT), "--steps", "2", "--warmup", "1",
                                 "--implementations", "dmattn,eager,sdpa", "--no-plot"])
    assert result.exit_code == ExitCode.OK, result.output
    rows = _rows(out)
    assert set(rows) == {(i, train.DECODE) for i in ("dmattn", "eager", "sdpa")}
    for name in ("dmattn", "eager"):
        row = rows[name, train.DECODE]
        assert row.status == "ok", row.detail
        assert row.steps == 2 and row.warmup == 1 and row.context == CONTEXT
        assert row.tokens_per_s == pytest.approx(1e3 / row.ms_p50, rel=1e-4)  # one token a step
    assert "not causal" in rows["sdpa", train.DECODE].detail


def _decoded(implementation: str, context: int, steps: int, monkeypatch) -> list:
    """The tokens the tiny model decodes after a prompt of ``context`` tokens."""
    from kernels.integrations.transformers import register

    register()
    tokens = []
    original = train._StepTimer.time
    monkeypatch.setattr(train._StepTimer, "time",
                        lambda self, step: tokens.append(original(self, step).clone()))
    opts = train.TrainOptions(contexts=(context,), steps=steps, warmup=0, tiny=True,
                              device="cpu", modes=(train.DECODE,))
    model = train.build_model(train.TINY, context + steps, implementation, torch.float32,
                              torch.device("cpu"))
    prompt = torch.randint(0, train.TINY.vocab, (1, context),
                           generator=torch.Generator().manual_seed(3))
    train._decode_steps(model, prompt, opts, ["prefill"])
    return tokens


def test_dmattn_decodes_the_tokens_eager_attention_decodes(monkeypatch):
    """Past the keep window (32 keys) each step takes Doge's top-W of the per-key bias over
    the cache; at a cache of 300 (> 8 x 32 keys) our steps read only those keys (the gather
    route), and decode what eager attention decodes."""
    from kernels.planning.gather_decode import GatherDecodePlan

    runs = []
    original = GatherDecodePlan.run
    monkeypatch.setattr(GatherDecodePlan, "run",
                        lambda self, *a, **kw: runs.append(1) or original(self, *a, **kw))
    ours = _decoded("dmattn", 300, 3, monkeypatch)
    assert len(runs) == 3 * train.TINY.layers, "the decode steps did not read only kept keys"
    monkeypatch.undo()
    eager = _decoded("eager", 300, 3, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(ours, eager))


def test_generate_on_cpu_bounds_the_work(tmp_path):
    result = runner.invoke(app, ["generate", "--tiny", "--device", "cpu", "--out",
                                 str(tmp_path / "g.csv"), "--contexts", "2000"])
    assert result.exit_code == ExitCode.USAGE
    assert "context^2 + (warmup + steps) x context" in result.output
    assert "Traceback" not in result.output
