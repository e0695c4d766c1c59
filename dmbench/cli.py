"""The ``dmbench`` command line. Thin: parse flags, load the sweep, call a module, print.

Every user mistake surfaces as one line on stderr and exit code 2, never as a traceback. Paths
are checked first (``dmbench.paths``), before any work starts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from . import paths
from .errors import EXIT_CODES_HELP, ConfigError, ExitCode
from .watchdog import DEFAULT_POINT_TIMEOUT_S

# rich_markup_mode=None: click's plain help for every command. Typer's Rich help (0.29) puts a
# type label such as ``<bool>`` beside every flag, --help included, although flags take no value.
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Benchmark, verify and gate flash dynamic-mask attention kernels.\n\n" + EXIT_CODES_HELP,
)


def _echo(message: str) -> None:
    typer.echo(message)


def _fail(message: str, code: ExitCode = ExitCode.USAGE) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(int(code))


def _guarded(work):
    """Run ``work()``; ConfigError becomes a one-line message and exit 2, and a device fault
    continues the sweep in a fresh process (see ``dmbench.restart``)."""
    from .device import DeviceFault

    try:
        code = work()
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    except DeviceFault as fault:
        from .restart import restart_after_fault

        code = restart_after_fault(fault, lambda m: typer.echo(m, err=True))
    raise typer.Exit(int(code or ExitCode.OK))


def _backend_names(text: Optional[str]) -> Optional[tuple[str, ...]]:
    from .backends import BACKEND_NAMES
    from .sweep import parse_backends

    return None if text is None else parse_backends("--backends", text, BACKEND_NAMES)


OutOpt = Annotated[Optional[Path], typer.Option("--out", help="CSV to write (default: results/<gpu>/<sweep>-<command>.csv).")]
BackendsOpt = Annotated[Optional[str], typer.Option("--backends", help="Comma-separated backends, overriding the sweep's list.")]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Keep rows already in the CSV (they must come from the same sweep or setup, command and environment) and run only the missing ones; not with --force.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Overwrite an existing CSV.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cuda or cpu (cpu runs Triton under its interpreter).")]
ShardOpt = Annotated[Optional[str], typer.Option("--shard", help="Run share I of N (0-based, e.g. 0/4), balanced by estimated cost; join with `dmbench merge`.")]
DistOpt = Annotated[bool, typer.Option("--distributed", help="Under torchrun: each rank runs a balanced share and rank 0 writes one CSV.")]
PlotOpt = Annotated[bool, typer.Option("--plot/--no-plot", help="Draw PNG charts next to the CSV when done.")]
# The Doge model's commands (train, generate).
BatchOpt = Annotated[int, typer.Option("--batch", help="Sequences per step.")]
ImplementationsOpt = Annotated[Optional[str], typer.Option("--implementations", help="Comma-separated subset of dmattn, eager, flex, sdpa (default: all; sdpa runs only where transformers' Doge sdpa attention is causal).")]
TinyOpt = Annotated[bool, typer.Option("--tiny", help="A two-layer model (tests, CPU).")]
ModelDtypeOpt = Annotated[str, typer.Option("--dtype", help="auto (bf16 on GPU, fp32 on CPU), bf16, fp16 or fp32.")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Show the progress bar.")]
SlowOpt = Annotated[bool, typer.Option("--allow-slow", help="On the CPU, run a sweep the cost model estimates above 5 minutes (refused otherwise, exit 2).")]
TimeoutOpt = Annotated[float, typer.Option("--point-timeout", help="Seconds a point may run; past it the point is recorded as an error (hung) and the sweep goes on in a fresh process with --resume. 0: no limit.")]
GraphOpt = Annotated[bool, typer.Option("--cuda-graph", help="Time replays of a CUDA graph of each point's call, for every backend (timing.cuda_graph; CUDA only); rows say so in their timing column.")]

SWEEP_FILE = "a sweep YAML file"
RESULTS_CSV = "a dmbench results CSV file"


def _point_timeout(seconds: float) -> float | None:
    if not seconds >= 0:  # NaN too
        raise ConfigError(f"--point-timeout must be >= 0 seconds (0: no limit), got {seconds}")
    return seconds or None


def _resume_or_force(resume: bool, force: bool) -> None:
    if resume and force:
        raise ConfigError("--resume and --force: choose one (--resume keeps the CSV's rows and "
                          "runs the rest, --force starts it over)")


def _check_run_paths(sweep: Optional[Path], out: Optional[Path]) -> None:
    if sweep is not None:
        paths.input_file(sweep, "SWEEP", SWEEP_FILE)
    if out is not None:
        paths.output_file(out, "--out")


def _timed_command(command: str, sweep_path: Path, out, backends, resume, force, device, shard,
                   distributed, plot, progress, allow_slow, cuda_graph, point_timeout):
    from .backends import BACKEND_NAMES
    from .execute import RunOptions, execute, with_backends, with_cuda_graph
    from .sweep import load_sweep

    def work():
        _resume_or_force(resume, force)
        _check_run_paths(sweep_path, out)
        sweep = with_backends(load_sweep(sweep_path, BACKEND_NAMES), _backend_names(backends))
        sweep = with_cuda_graph(sweep, cuda_graph)
        opts = RunOptions(command, out, resume, force, device, shard, distributed, plot, progress,
                          allow_slow, _point_timeout(point_timeout))
        return execute(sweep, opts, _echo)

    _guarded(work)


def _timing_command(command: str, summary: str):
    """``fwd`` and ``bwd`` take the same flags and differ only in what they time."""

    def timed(sweep: Annotated[Path, typer.Argument(help="Sweep YAML file.")], out: OutOpt = None,
              backends: BackendsOpt = None, resume: ResumeOpt = False, force: ForceOpt = False,
              device: DeviceOpt = "auto", shard: ShardOpt = None, distributed: DistOpt = False,
              plot: PlotOpt = True, progress: ProgressOpt = True, allow_slow: SlowOpt = False,
              cuda_graph: GraphOpt = False, point_timeout: TimeoutOpt = DEFAULT_POINT_TIMEOUT_S):
        _timed_command(command, sweep, out, backends, resume, force, device, shard, distributed,
                       plot, progress, allow_slow, cuda_graph, point_timeout)

    timed.__doc__ = summary
    return app.command(command, epilog=EXIT_CODES_HELP)(timed)


fwd = _timing_command("fwd", "Time the forward pass of every backend on every sweep point.")
bwd = _timing_command(
    "bwd", "Time the backward pass alone and fwd+bwd of every backend on every sweep point.")


@app.command(epilog=EXIT_CODES_HELP)
def equiv(sweep: Annotated[Optional[Path], typer.Argument(help="Sweep YAML file (or use --irregular).")] = None,
          irregular: Annotated[bool, typer.Option("--irregular", help="Run the built-in suite of hard shapes.")] = False,
          random_count: Annotated[Optional[int], typer.Option("--random", help="Run N random cases drawn from every axis (a fuzz; sized for the device).")] = None,
          seed: Annotated[int, typer.Option("--seed", help="Seed of the --random draw: the same N and seed give the same cases.")] = 0,
          out: OutOpt = None, backends: BackendsOpt = None, resume: ResumeOpt = False,
          force: ForceOpt = False, device: DeviceOpt = "auto", shard: ShardOpt = None,
          distributed: DistOpt = False, progress: ProgressOpt = True, allow_slow: SlowOpt = False,
          point_timeout: TimeoutOpt = DEFAULT_POINT_TIMEOUT_S):
    """Check out, lse, dq, dk, dv and dbias against the fp64 reference.

    A tensor passes when its max abs error is at most 2x that of an eager run in the input dtype
    (both against fp64), plus a small floor per dtype (the rule in kernels.tolerance).

    Backends: the sweep's list, or only `triton` for --irregular and --random; --backends
    overrides them.
    Exits 3 if any checked tensor is over its allowed error or a backend errors.
    """
    from .backends import BACKEND_NAMES
    from .execute import RunOptions, execute, with_backends
    from .irregular import irregular_sweep
    from .random_suite import random_sweep
    from .sweep import load_sweep

    def work():
        _resume_or_force(resume, force)
        if (sweep is not None) + irregular + (random_count is not None) != 1:
            raise ConfigError("equiv: give a SWEEP file, --irregular or --random N (exactly one)")
        if random_count is not None and random_count < 1:
            raise ConfigError(f"--random must be at least 1 (cases to draw), got {random_count}")
        if seed < 0:
            raise ConfigError(f"--seed must be a non-negative integer, got {seed}")
        _check_run_paths(sweep, out)
        if irregular or random_count is not None:
            import torch

            large = device == "cuda" or (device == "auto" and torch.cuda.is_available())
            suite = (irregular_sweep(large, ("triton",)) if irregular
                     else random_sweep(random_count, seed, large, ("triton",)))
        else:
            suite = load_sweep(sweep, BACKEND_NAMES)
        suite = with_backends(suite, _backend_names(backends))
        opts = RunOptions("equiv", out, resume, force, device, shard, distributed, False, progress,
                          allow_slow, _point_timeout(point_timeout))
        return execute(suite, opts, _echo)

    _guarded(work)


@app.command(epilog=EXIT_CODES_HELP)
def plot(csv: Annotated[Path, typer.Argument(help="Results CSV from fwd, bwd or merge.")],
         out_dir: Annotated[Optional[Path], typer.Option("--out-dir", help="Folder for the PNGs (default: next to the CSV).")] = None,
         baseline: Annotated[Optional[str], typer.Option("--baseline", help="Backend to compute speedups against (default: the first with rows of fdma, sdpa, flex, fa4, reference).")] = None,
         metrics: Annotated[str, typer.Option("--metrics", help="Charts to draw, a comma-separated subset of speedup, tflops, memory, build.")] = "speedup,tflops,memory,build"):
    """Draw speedup and TFLOP/s charts (PNG) against each swept axis, from the CSV only."""
    from .plot import plot_rows
    from .results import read_rows

    def work():
        paths.input_file(csv, "CSV", RESULTS_CSV)
        paths.output_dir(out_dir or csv.parent, "--out-dir" if out_dir else "plot folder")
        rows = read_rows(csv)
        chosen = tuple(m.strip() for m in metrics.split(",") if m.strip())
        for path in plot_rows(rows, out_dir or csv.parent, csv.stem, baseline, chosen):
            _echo(f"plot: {path}")
        return ExitCode.OK

    _guarded(work)


@app.command(epilog=EXIT_CODES_HELP)
def compare(baseline: Annotated[Path, typer.Argument(help="Baseline results CSV.")],
            new: Annotated[Path, typer.Argument(help="New results CSV.")],
            threshold: Annotated[float, typer.Option("--threshold", help="Median-time ratio above which a slowdown outside the p20-p80 noise fails.")] = 1.10,
            allow_missing: Annotated[bool, typer.Option("--allow-missing", help="Pass even when baseline rows are missing from NEW or the files have no rows in common (exit 4 otherwise).")] = False):
    """The regression gate: exit 1 on a slowdown beyond threshold and noise, 3 on accuracy
    failures, 4 when NEW lacks baseline rows or shares none with it."""
    from .compare import compare_rows, format_report
    from .results import read_rows

    def work():
        paths.input_file(baseline, "BASELINE", RESULTS_CSV)
        paths.input_file(new, "NEW", RESULTS_CSV)
        report = compare_rows(read_rows(baseline), read_rows(new), threshold, str(baseline),
                              str(new), allow_missing)
        for line in format_report(report, str(baseline), str(new)):
            _echo(line)
        return report.exit_code

    _guarded(work)


@app.command(epilog=EXIT_CODES_HELP)
def merge(parts: Annotated[List[Path], typer.Argument(help="Shard CSVs to join.")],
          out: Annotated[Path, typer.Option("--out", help="Merged CSV to write.")],
          sweep: Annotated[Optional[Path], typer.Option("--sweep", help="The sweep the shards came from, to find cases with no rows.")] = None,
          force: Annotated[bool, typer.Option("--force", help="Write the merged CSV even when problems were found (still exits 2).")] = False):
    """Join shard CSVs; report duplicate or missing cases and mismatched environments (exit 2)."""
    from .backends import BACKEND_NAMES
    from .merge import merge_files
    from .results import rewrite
    from .sweep import load_sweep

    def work():
        for part in parts:
            paths.input_file(part, "PARTS", RESULTS_CSV)
        if sweep is not None:
            paths.input_file(sweep, "--sweep", SWEEP_FILE)
        paths.output_file(out, "--out")
        expected = None
        if sweep is not None:
            loaded = load_sweep(sweep, BACKEND_NAMES)
            expected = loaded.cases + tuple(s.case for s in loaded.skipped)
        result = merge_files(list(parts), expected)
        for problem in result.problems:
            typer.echo(f"problem: {problem}", err=True)
        if result.problems and not force:
            raise ConfigError(f"merge: {len(result.problems)} problem(s) found; nothing written (--force writes anyway)")
        rewrite(out, list(result.rows))
        _echo(f"merged {len(result.rows)} rows from {len(parts)} file(s) into {out}")
        return ExitCode.USAGE if result.problems else ExitCode.OK

    _guarded(work)


@app.command("env", epilog=EXIT_CODES_HELP)
def env_command(device: DeviceOpt = "auto"):
    """Show the GPU, driver, torch and triton versions, and which backends are available here."""
    from .backends import make_backends
    from .device import select_device
    from .envinfo import collect

    def work():
        dev = select_device(device)
        info = collect(dev)
        for name in ("gpu", "driver", "torch", "triton", "git_sha", "git_dirty", "host"):
            _echo(f"{name:10s} {getattr(info, name)}")
        _echo(f"{'device':10s} {dev}")
        _echo("backends:")
        for name, backend in make_backends().items():
            reason = backend.unavailable_reason(dev)
            state = "available" if reason is None else f"unavailable: {reason}"
            _echo(f"  {name:11s} {state}")
        return ExitCode.OK

    _guarded(work)


@app.command("backends", epilog=EXIT_CODES_HELP)
def backends_command(device: DeviceOpt = "auto"):
    """List the backends, what each one runs, and whether it is available here (and why not)."""
    from .backends import make_backends
    from .device import select_device

    def work():
        dev = select_device(device)
        for name, backend in make_backends().items():
            reason = backend.unavailable_reason(dev)
            _echo(f"{name:11s} {'yes' if reason is None else 'no '} {backend.description}")
            if reason:
                _echo(f"{'':15s} why not: {reason}")
        return ExitCode.OK

    _guarded(work)


@app.command("fetch-peer", epilog=EXIT_CODES_HELP)
def fetch_peer_command(dest: Annotated[Path, typer.Option("--dest", help="Git-ignored folder for the peer's sdist.")] = Path(".peer")):
    """Download and unpack the flash-dmattn 1.2.2 sdist (pure Python Triton kernel) for the fdma backend."""
    from .peer import fetch_peer

    def work():
        paths.output_dir(dest, "--dest")
        path = fetch_peer(dest)
        _echo(f"unpacked: {path}")
        _echo(f"use it with: PYTHONPATH={path.resolve()}${{PYTHONPATH:+:$PYTHONPATH}}")
        return ExitCode.OK

    _guarded(work)


@app.command("report", epilog=EXIT_CODES_HELP)
def report(csvs: Annotated[List[Path], typer.Argument(help="Result CSVs of one device (e.g. results/<gpu>/*.csv).")],
           readme: Annotated[Optional[Path], typer.Option("--readme", help="README whose headline section (between its markers) to rewrite (default: README.md here; left alone for CPU rows).")] = None,
           tables: Annotated[Optional[Path], typer.Option("--tables", help="Markdown file for the full tables (default: README.md in the CSVs' folder, created if absent).")] = None,
           print_only: Annotated[bool, typer.Option("--print", help="Print the headline and the tables; write nothing.")] = False):
    """Generate the README headline and the full per-case tables from result CSVs."""
    from .collected import collect
    from .report import headline_markdown, tables_markdown, write_reports

    def work():
        for csv in csvs:
            paths.input_file(csv, "CSVS", RESULTS_CSV)
        if readme is not None:
            paths.writable_file(readme, "--readme", "a README file with the headline markers")
        if tables is not None:
            paths.output_file(tables, "--tables", "a markdown file for the full tables")
        if print_only:
            collected = collect(list(csvs))
            _echo(headline_markdown(collected))
            _echo(tables_markdown(collected))
        else:
            for line in write_reports(list(csvs), readme, tables):
                _echo(line)
        return ExitCode.OK

    _guarded(work)


@app.command("train", epilog=EXIT_CODES_HELP)
def train_command(
        contexts: Annotated[Optional[str], typer.Option("--contexts", help="Comma-separated context lengths in tokens (default: 2048,8192,32768,65536, or 32,64 with --tiny; after running out of memory, longer ones are skipped).")] = None,
        batch: BatchOpt = 1,
        steps: Annotated[int, typer.Option("--steps", help="Timed optimizer steps per point.")] = 5,
        warmup: Annotated[int, typer.Option("--warmup", help="Untimed steps first (in compiled mode the first step compiles).")] = 2,
        implementations: ImplementationsOpt = None,
        modes: Annotated[Optional[str], typer.Option("--modes", help="Comma-separated subset of eager, compiled (default: both).")] = None,
        tiny: TinyOpt = False,
        dtype: ModelDtypeOpt = "auto",
        device: DeviceOpt = "auto",
        out: Annotated[Optional[Path], typer.Option("--out", help="CSV to write (default: results/<gpu>/train.csv).")] = None,
        resume: ResumeOpt = False,
        force: ForceOpt = False,
        plot: PlotOpt = True):
    """Training steps of a ~100M-parameter Doge model per attention implementation and mode:
    tokens/s and peak memory per context. Out of memory and errors are row statuses."""
    from .train import MODES, parse_list

    _run_doge(lambda: MODES if modes is None else parse_list("--modes", modes, MODES), contexts,
              batch, steps, warmup, implementations, tiny, dtype, device, out, resume, force,
              plot)


@app.command("generate", epilog=EXIT_CODES_HELP)
def generate_command(
        contexts: Annotated[Optional[str], typer.Option("--contexts", help="Comma-separated prompt lengths in tokens, the cache the steps decode against (default: 2048,8192,32768,65536, or 32,64 with --tiny; after running out of memory, longer ones are skipped).")] = None,
        batch: BatchOpt = 1,
        steps: Annotated[int, typer.Option("--steps", help="Timed decode steps per point, one token each.")] = 32,
        warmup: Annotated[int, typer.Option("--warmup", help="Untimed decode steps first, after the prefill.")] = 4,
        implementations: ImplementationsOpt = None,
        tiny: TinyOpt = False,
        dtype: ModelDtypeOpt = "auto",
        device: DeviceOpt = "auto",
        out: Annotated[Optional[Path], typer.Option("--out", help="CSV to write (default: results/<gpu>/generate.csv).")] = None,
        resume: ResumeOpt = False,
        force: ForceOpt = False,
        plot: PlotOpt = True):
    """Generation with a ~100M-parameter Doge model per attention implementation: after a
    prefill of each context, tokens/s of one-token decode steps through the cache, and peak
    memory. Out of memory and errors are row statuses."""
    from .train import DECODE

    _run_doge(lambda: (DECODE,), contexts, batch, steps, warmup, implementations, tiny, dtype,
              device, out, resume, force, plot)


def _run_doge(modes, contexts, batch, steps, warmup, implementations, tiny, dtype, device, out,
              resume, force, plot):
    """``train`` and ``generate``: the options checked (``modes()`` gives the modes or raises
    the usage error), then every point."""
    from .train import (IMPLEMENTATIONS, TrainOptions, default_contexts, parse_contexts,
                        parse_list, run_train)

    def work():
        _resume_or_force(resume, force)
        names = tuple(IMPLEMENTATIONS)
        opts = TrainOptions(
            contexts=default_contexts(tiny) if contexts is None else parse_contexts(contexts),
            batch=batch, steps=steps, warmup=warmup,
            implementations=names if implementations is None else parse_list("--implementations", implementations, names),
            modes=modes(), tiny=tiny, dtype=dtype, device=device, out=out, resume=resume,
            force=force, plot=plot)
        return run_train(opts, _echo)

    _guarded(work)


@app.command("battery", epilog=EXIT_CODES_HELP)
def battery_command(
        gpus: Annotated[Optional[int], typer.Option("--gpus", help="How many of this host's GPUs to use, one sweep process on each (default: all).")] = None,
        only: Annotated[Optional[str], typer.Option("--only", help="Comma-separated sweeps of the battery to run (default: all of them).")] = None,
        out_dir: Annotated[Optional[Path], typer.Option("--out-dir", help="Folder for the CSVs (default: results/<gpu>/).")] = None,
        logs: Annotated[Path, typer.Option("--logs", help="Folder for each job's output.")] = Path("battery-logs"),
        history: Annotated[Optional[Path], typer.Option("--history", help="Results folder whose files' timestamps order the jobs, longest first (default: the --out-dir).")] = None,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the jobs in the order they start, with their command lines; run nothing.")] = False):
    """Every GPU sweep (fwd, bwd, and the CUDA-graph files the results publish) on this host's
    GPUs, one sweep process per GPU, longest first; run it again to finish an interrupted one."""
    from .battery import battery_code, gpu_list, plan_jobs, run_jobs

    def work():
        names = tuple(n.strip() for n in only.split(",") if n.strip()) if only else ()
        if dry_run:
            folder = out_dir or Path("results/<gpu>")
            for job in plan_jobs(names, history=history or out_dir):
                _echo(" ".join(job.argv(folder, Path("sweeps"))[1:]))
            return ExitCode.OK
        devices = gpu_list(gpus)
        import torch

        from .envinfo import gpu_slug

        folder = out_dir or Path("results") / gpu_slug(torch.cuda.get_device_name(0))
        jobs = plan_jobs(names, history=history or folder)
        paths.output_dir(folder, "--out-dir" if out_dir else "results folder")
        paths.output_dir(logs, "--logs")
        _echo(f"battery: {len(jobs)} jobs on {len(devices)} GPUs -> {folder}/ (logs in {logs}/)")
        return battery_code(run_jobs(jobs, devices, folder, logs, _echo))

    _guarded(work)


@app.command("compile-cost", epilog=EXIT_CODES_HELP)
def compile_cost_command(
        lengths: Annotated[Optional[str], typer.Option("--lengths", help="Comma-separated sequence lengths, called in this order (default: 20 lengths from 1000 to 8000, multiples of 16 and not).")] = None,
        masks: Annotated[str, typer.Option("--masks", help="Comma-separated mask forms: none, bool, intervals, documents (dmattn_varlen_func, two calls per length with the same offsets).")] = "bool,intervals",
        bias: Annotated[str, typer.Option("--bias", help="none or kv_row (a per-key bias with its gradient).")] = "kv_row",
        heads: Annotated[str, typer.Option("--heads", help="Query/kv heads, e.g. 16/4.")] = "16/4",
        head_dim: Annotated[int, typer.Option("--head-dim", help="Head dimension.")] = 128,
        batch: Annotated[int, typer.Option("--batch", help="Batch size.")] = 1,
        dtype: Annotated[str, typer.Option("--dtype", help="bf16, fp16 or fp32.")] = "bf16",
        causal: Annotated[bool, typer.Option("--causal/--no-causal", help="Bottom-right causal calls.")] = True,
        warmup: Annotated[bool, typer.Option("--warmup", help="Run kernels.warmup at the shortest and longest length first.")] = False,
        warmup_workers: Annotated[Optional[int], typer.Option("--warmup-workers", help="Threads the warm-up compiles with on a GPU (default: the CPU count, at most 32; 1 = one kernel at a time).")] = None,
        require_zero: Annotated[bool, typer.Option("--require-zero", help="Exit 1 if a call after the warm-up (or after the first call) compiled a kernel.")] = False,
        window: Annotated[Optional[int], typer.Option("--window", help="The intervals form as a top-W model's (Doge's): topk_intervals of a random per-key bias with this window, key-ordered from max(256, 4W) causal (2W not); the warm-up gets the window too. Rows' mask: topk<W>.")] = None,
        query_rows: Annotated[Optional[int], typer.Option("--query-rows", help="Decode: calls of this many query rows (1-16) against caches of the --lengths, forward only, as a model generates; the warm-up makes the same calls.")] = None,
        device: DeviceOpt = "auto",
        out: Annotated[Optional[Path], typer.Option("--out", help="CSV to write (default: results/<gpu>/compile-cost.csv).")] = None,
        force: ForceOpt = False):
    """First-call latency and kernels compiled at each new sequence length, per mask form."""
    from .case import heads_problem, parse_pair
    from .compile_cost import (BIASES, MASKS, MAX_QUERY_ROWS, CostOptions, parse_lengths,
                               run_compile_cost)
    from .problem import TORCH_DTYPES
    from .train import parse_list

    def work():
        if dtype not in TORCH_DTYPES:
            raise ConfigError(f"--dtype: expected {', '.join(TORCH_DTYPES)}, got {dtype!r}")
        pair = parse_pair(heads)
        if pair is None:
            raise ConfigError(f"--heads: expected query/kv heads such as 16/4, got {heads!r}")
        heads_q, heads_kv = pair
        if heads_q < 1 or heads_kv < 1:
            raise ConfigError(f"--heads: expected positive query/kv heads, got {heads!r}")
        problem = heads_problem(heads_q, heads_kv)
        if problem:
            raise ConfigError(f"--heads: {heads!r}: {problem}")
        if bias not in BIASES:
            raise ConfigError(f"--bias: expected one of {', '.join(BIASES)}, got {bias!r}")
        if warmup_workers is not None and warmup_workers < 1:
            raise ConfigError(f"--warmup-workers: expected a positive number of threads, got {warmup_workers}")
        mask_forms = parse_list("--masks", masks, MASKS)
        if window is not None and window < 1:
            raise ConfigError(f"--window: expected a positive number of keys, got {window}")
        if window is not None and "intervals" not in mask_forms:
            raise ConfigError(f"--window: applies to the intervals mask form, which --masks {masks!r} leaves out")
        if query_rows is not None and not 1 <= query_rows <= MAX_QUERY_ROWS:
            raise ConfigError(f"--query-rows: expected a decode step's query rows, 1 to {MAX_QUERY_ROWS}, got {query_rows}")
        if query_rows is not None and "documents" in mask_forms:
            raise ConfigError("--query-rows: decode steps have no packed documents form; leave documents out of --masks")
        opts = CostOptions(
            lengths=parse_lengths(lengths) if lengths is not None else CostOptions.lengths,
            masks=mask_forms, bias=bias, window=window, query_rows=query_rows,
            batch=batch, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype,
            causal=causal, warmup=warmup, warmup_workers=warmup_workers,
            require_zero=require_zero, device=device, out=out, force=force)
        return run_compile_cost(opts, _echo)

    _guarded(work)


def main() -> None:
    app(prog_name="dmbench")


if __name__ == "__main__":
    sys.exit(main())
