"""``dmbench train`` and ``dmbench generate``: training and generation throughput of a Doge
model per attention implementation.

One row per (context, implementation, mode). Each point builds the model afresh from the same
seed, draws one batch of random tokens and times optimizer steps: forward, next-token loss,
backward, AdamW step. The model is a ``DogeConfig`` of about 100M parameters (``--tiny``: a
two-layer one for tests); its keep window is 2048 keys, so contexts above that take Doge's
top-W dynamic mask.

Implementations: ``dmattn`` (``kernels.integrations.transformers``) and transformers' own
``eager``, ``flex`` (``flex_attention``) and ``sdpa`` attention of the same model. Only eager
computes what dmattn computes. transformers 5.17's Doge under flex is not causal (the dynamic
mask reaches flex as a score tensor with no block mask, its top-W taken over all keys) and adds
head 0's bias to every head; its rows say so in ``detail`` and are timed as transformers runs
them. sdpa runs only where it is causal: before the first sdpa point a two-layer Doge on the
CPU checks whether a change of the last token changes earlier logits (in transformers 5.17 it
does: the float mask turns off sdpa's causal flag), and if so its rows are ``skipped``.

Modes: ``eager`` (plain PyTorch) and ``compiled`` (``torch.compile`` of the model). A compiled
point that fails is an ``error`` row whose detail starts with the stage ("compile: ...").

``generate`` times the mode ``decode``: inference (no autograd) of a prompt of ``context``
tokens through the model with its cache (the prefill, untimed), then one token per step, each
the argmax of the step before, through that cache: warm-up steps, then the timed ones. Its
tokens/s is batch / step time, its peak the prefill's or the steps' (the cache included). With
dmattn each step takes Doge's top-W of its per-key bias over the cache (``topk_intervals``,
one query row) and reads only those keys where they are at most 1/8 of the cache (the
forward's gather route); eager and sdpa attend to every cached key under the same top-W mask.

Statuses: ``ok``; ``oom`` (out of memory; the run goes on, and the same implementation and
mode are ``skipped`` at longer contexts); ``error`` (detail says what raised); ``skipped``
(detail says why). None of them changes the exit code.

Timing and memory on a GPU: the model is bf16 throughout (weights, gradients, AdamW state; no
autocast), each step is timed by CUDA events around it, and the peak is
``torch.cuda.max_memory_allocated`` since the point began, after the previous point's model,
optimizer, compiled graphs (``torch._dynamo.reset``) and cached blocks were released;
``start_mib`` is what was still allocated then (near 0: the kernels' kept plans hold a few
MiB of scratch at most; more means a point, failed or not, leaked).

``--resume`` keeps the rows of an existing CSV made by the same model, sizes, environment and
commit, and runs only the missing points (a run cut short, or one split over several
invocations by ``--contexts`` or ``--modes``); the plots are drawn from the whole file.

Plots, drawn from the CSV: tokens/s, tokens/s over eager attention, and (on a GPU) peak
memory, against context.

On CPU (Triton under its interpreter) only ``--tiny`` runs, within ``CPU_MAX_WORK`` a point,
and neither compiled mode nor flex runs (both compile with inductor: minutes).
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import outfile
from .columns import environment_values
from .device import CPU_NOTE, select_device
from .envinfo import REPO_ROOT, Environment, collect, gpu_slug
from .errors import ConfigError, ExitCode
from .problem import TORCH_DTYPES
from .train_results import (TrainRow, TrainWriter, describe, plot_train, read_train_rows,
                            resumable_rows)

IMPLEMENTATIONS = {"dmattn": "dmattn", "eager": "eager", "flex": "flex_attention", "sdpa": "sdpa"}
MODES = ("eager", "compiled")
DECODE = "decode"  # the mode of ``dmbench generate``
DIFFERS_FROM_EAGER = {
    "flex": "transformers' Doge flex path: not causal (top-W over all keys, no block mask), "
            "head 0's bias for every head",
}
# Implementations that run only where the causality probe passes (``_causal_probe``).
NEEDS_CAUSAL = ("sdpa",)
DEFAULT_CONTEXTS = (2048, 8192, 32768, 65536)
TINY_CONTEXTS = (32, 64)  # at and above the tiny model's keep window
# Under the interpreter a tiny-model step at context 1024 took 125 s (2 cores): attention
# dominates, so a CPU point may do at most this much batch * (warmup + steps) * context**2.
CPU_MAX_WORK = 2**19
SEED = 0
LEARNING_RATE = 1e-4
COMPILE_BACKEND = "inductor"  # torch.compile's default; tests use dynamo's "eager" backend


@dataclass(frozen=True)
class ModelSize:
    name: str
    vocab: int
    hidden: int
    layers: int
    heads_q: int
    heads_kv: int
    intermediate: int
    keep_window: int


FULL = ModelSize("doge-100m", vocab=32768, hidden=768, layers=12, heads_q=12, heads_kv=4,
                 intermediate=2048, keep_window=2048)
TINY = ModelSize("doge-tiny", vocab=256, hidden=64, layers=2, heads_q=4, heads_kv=2,
                 intermediate=128, keep_window=32)


@dataclass(frozen=True)
class TrainOptions:
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    batch: int = 1
    steps: int = 5
    warmup: int = 2
    implementations: tuple[str, ...] = tuple(IMPLEMENTATIONS)
    modes: tuple[str, ...] = MODES
    tiny: bool = False
    dtype: str = "auto"
    device: str = "auto"
    out: Path | None = None
    resume: bool = False
    force: bool = False
    plot: bool = True


_DTYPES = TORCH_DTYPES


# -- options ----------------------------------------------------------------------------------

def parse_list(flag: str, text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in allowed]
    if not names or unknown:
        raise ConfigError(f"{flag}: expected a comma-separated subset of {', '.join(allowed)}, "
                          f"got {text!r}")
    return names


def default_contexts(tiny: bool) -> tuple[int, ...]:
    return TINY_CONTEXTS if tiny else DEFAULT_CONTEXTS


def parse_contexts(text: str) -> tuple[int, ...]:
    try:
        contexts = tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        contexts = ()
    if not contexts or min(contexts) < 2:
        raise ConfigError(f"--contexts: expected comma-separated token counts of at least 2, "
                          f"got {text!r}")
    return contexts


def check_options(opts: TrainOptions, device: torch.device) -> None:
    for flag, value, least in (("--batch", opts.batch, 1), ("--steps", opts.steps, 1),
                               ("--warmup", opts.warmup, 0)):
        if value < least:
            raise ConfigError(f"{flag}: expected an integer of at least {least}, got {value}")
    if opts.dtype != "auto" and opts.dtype not in _DTYPES:
        raise ConfigError(f"--dtype: expected auto, {', '.join(_DTYPES)}, got {opts.dtype!r}")
    if device.type != "cpu":
        if "compiled" in opts.modes and opts.warmup < 1:
            raise ConfigError("--warmup: compiled mode needs at least 1 (its first step "
                              "compiles), got 0")
        return
    if not opts.tiny:
        raise ConfigError(f"{command_name(opts)}: on CPU only --tiny runs (the ~100M model "
                          f"would take hours per step under the Triton interpreter); pass --tiny "
                          f"or use a GPU")
    longest = max(opts.contexts)
    if DECODE in opts.modes:  # one prefill, then steps of one query row each
        work = opts.batch * (longest ** 2 + (opts.warmup + opts.steps) * longest)
        formula = "batch x (context^2 + (warmup + steps) x context)"
    else:
        work = opts.batch * (opts.warmup + opts.steps) * longest ** 2
        formula = "batch x (warmup + steps) x context^2"
    if work > CPU_MAX_WORK:
        raise ConfigError(f"--contexts/--batch/--steps/--warmup: on CPU a point may do at most "
                          f"{formula} = {CPU_MAX_WORK}, got {work}: "
                          f"the interpreter would take more than a minute or two")


def model_dtype(opts: TrainOptions, device: torch.device) -> torch.dtype:
    if opts.dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[opts.dtype]


# -- one point --------------------------------------------------------------------------------

def doge_config(size: ModelSize, context: int, implementation: str):
    from transformers import DogeConfig

    return DogeConfig(vocab_size=size.vocab, hidden_size=size.hidden,
                      num_hidden_layers=size.layers, num_attention_heads=size.heads_q,
                      num_key_value_heads=size.heads_kv, intermediate_size=size.intermediate,
                      keep_window_size=size.keep_window, max_position_embeddings=context,
                      tie_word_embeddings=True, attn_implementation=implementation)


def build_model(size: ModelSize, context: int, implementation: str, dtype: torch.dtype,
                device: torch.device) -> torch.nn.Module:
    """The same weights for every implementation. Doge starts A at zero, which makes every
    key's bias equal; a seeded normal A makes the top-W choice depend on the data, as in a
    trained model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    config = doge_config(size, context, IMPLEMENTATIONS[implementation])
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "A", None), torch.nn.Parameter):
                module.A.normal_()
    return model.to(device=device, dtype=dtype).train()


class _StepTimer:
    """Wall time of each step: CUDA events on a GPU, the host clock (after the step) on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.samples_ms: list[float] = []
        self._events: list = []

    def time(self, step: Callable[[], float]) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            end.record()
            self._events.append((start, end))
            return loss
        began = time.perf_counter()
        loss = step()
        self.samples_ms.append((time.perf_counter() - began) * 1e3)
        return loss

    def finish(self) -> list[float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.samples_ms = [s.elapsed_time(e) for s, e in self._events]
        return self.samples_ms


def _quantile(data: list[float], q: float) -> float:
    data = sorted(data)
    pos = q * (len(data) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def _graph_breaks():
    # Imported here, not at the top: torch._dynamo imports triton, which must not happen
    # before select_device has set TRITON_INTERPRET for a CPU run.
    from torch._dynamo.utils import counters

    return counters["graph_break"]


def _out_of_memory(exc: BaseException | None) -> bool:
    """An OOM, also when a compiler or the Triton launcher re-raised it as another type."""
    while exc is not None:
        if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__
    return False


def _ok_detail(implementation: str, mode: str) -> str:
    notes = [DIFFERS_FROM_EAGER.get(implementation, "")]
    if mode == "compiled":
        notes.append(f"graph breaks: {sum(_graph_breaks().values())}")
    return "; ".join(n for n in notes if n)


def _decode_steps(model, tokens: torch.Tensor, opts: TrainOptions, stage: list) -> list[float]:
    """Step times in ms of ``dmbench generate``'s point: the prefill
    of ``tokens`` (untimed), then ``opts.warmup`` and ``opts.steps`` timed one-token steps
    through the cache. ``stage[0]`` names the stage running, for a failure's detail."""
    model.eval()
    with torch.no_grad():
        stage[0] = "prefill"
        result = model(input_ids=tokens, use_cache=True)
        cache, token = result.past_key_values, result.logits[:, -1:].argmax(-1)
        result = None
        stage[0] = "step"

        def step() -> torch.Tensor:
            nonlocal cache, token
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            return token

        for _ in range(opts.warmup):
            step()
        timer = _StepTimer(tokens.device)
        for _ in range(opts.steps):
            timer.time(step)
        return timer.finish()


def run_point(size: ModelSize, context: int, implementation: str, mode: str, opts: TrainOptions,
              dtype: torch.dtype, device: torch.device) -> dict:
    """Measured fields of one row, or its status and detail when it did not finish. The peak
    is all memory allocated during the point: weights, optimizer state and activations; the
    start is what was still allocated when the point began (0 unless an earlier point left
    tensors behind)."""
    stage = "build"
    model = optimizer = forward = tokens = None
    start = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        start["start_mib"] = torch.cuda.memory_allocated(device) / 2**20
    try:
        if mode == DECODE:
            positions = context + opts.warmup + opts.steps
            model = build_model(size, positions, implementation, dtype, device)
            generator = torch.Generator().manual_seed(SEED)
            tokens = torch.randint(0, size.vocab, (opts.batch, context),
                                   generator=generator).to(device)
            where = [stage]
            try:
                samples = _decode_steps(model, tokens, opts, where)
            finally:
                stage = where[0]
            p50 = _quantile(samples, 0.5)
            measured = {"params": sum(p.numel() for p in model.parameters()),
                        "ms_p20": _quantile(samples, 0.2), "ms_p50": p50,
                        "ms_p80": _quantile(samples, 0.8),
                        "tokens_per_s": opts.batch / (p50 / 1e3), "status": "ok",
                        "detail": _ok_detail(implementation, mode)}
            if device.type == "cuda":
                measured["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
            return {**measured, **start}
        model = build_model(size, context, implementation, dtype, device)
        measured = {"params": sum(p.numel() for p in model.parameters())}
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
        if mode == "compiled":
            torch._dynamo.reset()
            _graph_breaks().clear()
        forward = torch.compile(model, backend=COMPILE_BACKEND) if mode == "compiled" else model
        generator = torch.Generator().manual_seed(SEED)
        tokens = torch.randint(0, size.vocab, (opts.batch, context), generator=generator).to(device)
        calls = 0

        def step() -> torch.Tensor:
            nonlocal stage, calls
            stage = "compile" if mode == "compiled" and calls == 0 else "step"
            calls += 1
            loss = forward(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        losses = [step() for _ in range(opts.warmup)]
        timer = _StepTimer(device)
        losses += [timer.time(step) for _ in range(opts.steps)]
        samples = timer.finish()
        p50 = _quantile(samples, 0.5)
        measured.update(ms_p20=_quantile(samples, 0.2), ms_p50=p50, ms_p80=_quantile(samples, 0.8),
                        tokens_per_s=opts.batch * context / (p50 / 1e3),
                        first_loss=float(losses[0]), last_loss=float(losses[-1]),
                        status="ok", detail=_ok_detail(implementation, mode))
        if device.type == "cuda":
            measured["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        return {**measured, **start}
    except Exception as exc:  # a failing point is a row; the run goes on
        if _out_of_memory(exc):
            return {"status": "oom", "detail": f"{stage}: out of memory", **start}
        lines = str(exc).strip().splitlines()
        message = f"{stage}: {type(exc).__name__}: {lines[0] if lines else ''}"
        return {"status": "error", "detail": message[:300], **start}
    finally:
        model = optimizer = forward = tokens = None  # step's closure holds them too
        if mode == "compiled":
            torch._dynamo.reset()  # compiled graphs hold the model's tensors
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


PROBE_CONTEXT = 16  # at most the tiny model's keep window: every visible key is kept


def _causal_probe(implementation: str) -> bool:
    """Whether transformers' Doge under ``implementation`` is causal: a two-layer model on the
    CPU, in fp32, whose logits before the last position must not change with the last token."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    config = doge_config(TINY, PROBE_CONTEXT, IMPLEMENTATIONS[implementation])
    model = AutoModelForCausalLM.from_config(config).eval()
    tokens = torch.randint(0, TINY.vocab, (1, PROBE_CONTEXT))
    changed = tokens.clone()
    changed[0, -1] = (tokens[0, -1] + 1) % TINY.vocab
    with torch.no_grad():
        before, after = (model(input_ids=t).logits[0, :-1] for t in (tokens, changed))
    return torch.equal(before, after)


# -- the run ----------------------------------------------------------------------------------

def command_name(opts: TrainOptions) -> str:
    """The command a run belongs to: ``generate`` times the decode mode, ``train`` the others."""
    return "generate" if DECODE in opts.modes else "train"


def default_out(gpu: str, command: str = "train") -> Path:
    return REPO_ROOT / "results" / gpu_slug(gpu) / f"{command}.csv"


class _SkipRules:
    """Why a point is not run, or None: the device, the causality probe (run once per
    implementation, when first needed) and earlier out-of-memory rows."""

    def __init__(self, device: torch.device):
        self.device = device
        self.oom_at: dict[tuple[str, str], int] = {}
        self._causal: dict[str, bool] = {}

    def reason(self, context: int, implementation: str, mode: str) -> str | None:
        if self.device.type == "cpu" and mode == "compiled":
            return "compiled mode is not run on CPU (inductor builds take minutes)"
        if self.device.type == "cpu" and implementation == "flex":
            return "flex is not run on CPU (it compiles its kernel with inductor: minutes)"
        if implementation in NEEDS_CAUSAL:
            if implementation not in self._causal:
                self._causal[implementation] = _causal_probe(implementation)
            if not self._causal[implementation]:
                return (f"transformers' Doge {implementation} attention is not causal here "
                        f"(the last token changed earlier logits)")
        failed_at = self.oom_at.get((implementation, mode))
        if failed_at is not None and context >= failed_at:
            return f"out of memory at context {failed_at}"
        return None

    def record(self, row: "TrainRow") -> None:
        key = (row.implementation, row.mode)
        if row.status == "oom":
            self.oom_at[key] = min(row.context, self.oom_at.get(key, row.context))


def run_train(opts: TrainOptions, echo: Callable[[str], None]) -> ExitCode:
    """Every (context, implementation, mode) point in order, one CSV row each, then the plots."""
    device = select_device(opts.device)
    check_options(opts, device)
    command = command_name(opts)
    try:
        from kernels.integrations.transformers import register
    except ImportError as exc:
        raise ConfigError(f"{command}: needs transformers (pip install -e '.[hf]'): "
                          f"{exc}") from None
    register()
    env = collect(device)
    target = outfile.explicit(opts.out or default_out(env.gpu, command), opts.resume,
                              opts.force)
    out = target.path
    size = TINY if opts.tiny else FULL
    dtype = model_dtype(opts, device)
    provenance = new_train_row(size, 0, "", "", opts, dtype, env, {"status": ""})
    kept = resumable_rows(out, provenance) if target.resume else []
    if device.type == "cpu":
        echo(CPU_NOTE)
    if kept:
        echo(f"resuming {out}: {len(kept)} rows kept")
    rules = _SkipRules(device)
    done = {(r.context, r.implementation, r.mode) for r in kept}
    for row in kept:
        rules.record(row)
    with TrainWriter(out, kept) as writer:
        for context in opts.contexts:
            for implementation in opts.implementations:
                for mode in opts.modes:
                    if (context, implementation, mode) in done:
                        continue
                    reason = rules.reason(context, implementation, mode)
                    measured = ({"status": "skipped", "detail": reason} if reason else
                                run_point(size, context, implementation, mode, opts, dtype, device))
                    row = new_train_row(size, context, implementation, mode, opts, dtype, env,
                                        measured)
                    rules.record(row)
                    writer.write(row)
                    echo(describe(row))
    echo(f"wrote {out}")
    if opts.plot and any(r.status == "ok" for r in read_train_rows(out)):
        for path in plot_train(out):
            echo(f"plot: {path}")
    return ExitCode.OK


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def new_train_row(size: ModelSize, context: int, implementation: str, mode: str,
                  opts: TrainOptions, dtype: torch.dtype, env: Environment,
                  measured: dict) -> TrainRow:
    dtype_name = next(name for name, value in _DTYPES.items() if value == dtype)
    values = {"params": None, **measured}
    return TrainRow(model=size.name, context=context, batch=opts.batch,
                    keep_window=size.keep_window, dtype=dtype_name, implementation=implementation,
                    mode=mode, warmup=opts.warmup, steps=opts.steps,
                    **environment_values(env, transformers=_transformers_version()), **values)


