"""One ``fwd``/``bwd``/``equiv`` run from options to a finished CSV: device, output file, resume,
sharding or torchrun, the CPU guard, the progress bar, the summary and the exit code.

The CPU guard: on the CPU every Triton kernel runs under the interpreter, thousands of times
slower than on a GPU. Before running, the cost model (``dmbench.cost``) estimates the points to
run; above ``cost.CPU_LIMIT_S`` the run is refused (exit 2) unless ``allow_slow`` is set.
CUDA-graph timing (``--cuda-graph``, ``timing.cuda_graph``) is refused off a CUDA device, and a
file is never resumed by a run that times the other way, nor by one of another sweep, command,
environment or commit (``outfile.check_resumable``). Ctrl-C prints how many points the CSV holds
and the command that finishes it (``interrupted_line``), then exits 130 through the CLI.

The CLI parses flags and calls :func:`execute`; the measuring itself is in :mod:`dmbench.runner`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from . import cost
from . import distributed as dist
from . import outfile, paths
from .backends import make_backends
from .device import CPU_NOTE, DeviceFault, select_device
from .envinfo import REPO_ROOT, collect, gpu_slug
from .errors import ConfigError, ExitCode
from .results import TIMED_MODES, Row, RowWriter, accuracy_failures, read_rows, rewrite
from .progress import make_progress
from .runner import SweepRunner, Unit, plan_units
from .watchdog import DEFAULT_POINT_TIMEOUT_S
from .sweep import Sweep, sweep_digest

MODES = {"fwd": ("fwd",), "bwd": ("bwd", "fwd+bwd"), "equiv": ("equiv",)}
MAX_LISTED_PROBLEMS = 25


@dataclass(frozen=True)
class RunOptions:
    command: str
    out: Path | None = None
    resume: bool = False
    force: bool = False
    device: str = "auto"
    shard: str | None = None
    distributed: bool = False
    plot: bool = True
    progress: bool = True
    allow_slow: bool = False
    # Seconds a point may run before it is recorded as hung and the sweep goes on in a fresh
    # process (``dmbench.watchdog``); None: no limit.
    point_timeout_s: float | None = DEFAULT_POINT_TIMEOUT_S


RESULTS_DIR = REPO_ROOT / "results"


def default_out(sweep: Sweep, command: str, gpu: str, share: dist.Share | None) -> Path:
    shard = f".shard{share.index}of{share.count}" if share else ""
    return RESULTS_DIR / gpu_slug(gpu) / f"{sweep.name}-{command}{shard}.csv"


def _previous_rows(target: outfile.Target) -> list[Row]:
    """Rows already in the file when resuming it (none otherwise)."""
    if not target.resume:
        return []
    return read_rows(target.path, tolerate_partial_last_line=True)


def cpu_guard(sweep: Sweep, estimate_s: float, points: int, allow_slow: bool) -> None:
    """Refuse a CPU run the cost model puts above the limit, unless ``allow_slow``."""
    if estimate_s <= cost.CPU_LIMIT_S or allow_slow:
        return
    raise ConfigError(
        f"{sweep.path}: {points} points estimated at {cost.format_seconds(estimate_s)} on the CPU "
        f"(Triton interpreter; limit {cost.format_seconds(cost.CPU_LIMIT_S)}), and CPU timings are "
        "not performance numbers: run sweeps/smoke.yaml on the CPU, or pass --allow-slow to run "
        "this anyway")


def graph_guard(sweep: Sweep, device, command: str) -> None:
    """CUDA-graph timing needs a CUDA device; ``equiv`` times nothing, so it is not asked."""
    if sweep.timing.cuda_graph and command != "equiv" and device.type != "cuda":
        raise ConfigError(f"{sweep.path}: --cuda-graph (timing.cuda_graph) needs a CUDA device; "
                          f"this run is on {device.type}")


def check_resumed(rows: list[Row], sweep: Sweep, provenance: outfile.Provenance, path: Path,
                  name: str) -> None:
    """``--resume`` continues ``path`` only with rows of this run's timing, then of its sweep,
    command, environment and commit (``outfile.check_resumable``)."""
    check_resumed_timing(rows, sweep, path)
    outfile.check_resumable(rows, provenance, path, name)


def check_resumed_timing(rows: list[Row], sweep: Sweep, path: Path) -> None:
    """Rows timed one way are never continued by a run timed the other way."""
    kinds = sorted({r.timing for r in rows if r.mode in TIMED_MODES} - {sweep.timing.kind})
    if kinds:
        raise ConfigError(f"{path}: its rows were timed {', '.join(kinds)}, this run times "
                          f"{sweep.timing.kind} (--cuda-graph or timing.cuda_graph); resume it "
                          "with the same timing, or write another --out")


def interrupted_line(done: int, total: int, path: Path, info) -> str:
    """What a Ctrl-C during a sweep says: the points in ``path`` and how to finish them."""
    from .restart import resume_command

    if info is not None:
        return (f"interrupted (rank {info.rank}/{info.world_size}): {done} of {total} points "
                f"written to {path}; run the same torchrun command with --resume to finish")
    return (f"interrupted: {done} of {total} points written to {path}; finish with: "
            f"{resume_command(path)}")


def _in_plan_order(rows: list[Row], plan: list[Unit]) -> list[Row]:
    """Latest row per key, ordered as a single process would have written them."""
    latest = {r.key: r for r in rows}
    ordered = [latest.pop(u.key) for u in plan if u.key in latest]
    return ordered + list(latest.values())


def exit_code(rows: list[Row], command: str) -> ExitCode:
    for row in rows:
        if row.status == "accuracy" or accuracy_failures(row):
            return ExitCode.ACCURACY
        if command == "equiv" and row.status in ("error", "oom"):
            return ExitCode.ACCURACY
    return ExitCode.OK


def summarize(rows: list[Row], echo: Callable[[str], None]) -> None:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.status] = counts.get(row.status, 0) + 1
    echo("rows: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    problems = [r for r in rows if r.status in ("accuracy", "error", "oom")]
    for row in problems[:MAX_LISTED_PROBLEMS]:
        echo(f"  {row.status.upper()} {row.case_id} {row.backend} {row.mode}: {row.detail}")
    if len(problems) > MAX_LISTED_PROBLEMS:
        echo(f"  ... and {len(problems) - MAX_LISTED_PROBLEMS} more (see the CSV)")


def _row_message(row: Row) -> str:
    timing = f" p50 {row.ms_p50:.4g} ms" if row.ms_p50 is not None else ""
    errors = [f"{n} {getattr(row, 'err_' + n):.2e}/{getattr(row, 'allowed_' + n):.2e}"
              for n in ("out", "lse", "dq", "dk", "dv", "dbias") if getattr(row, "err_" + n) is not None]
    accuracy = f" err/allowed {' '.join(errors)}" if errors else ""
    detail = f" ({row.detail})" if row.detail and row.status != "ok" else ""
    return f"{row.case_id} {row.backend} {row.mode}: {row.status}{timing}{accuracy}{detail}"


def execute(sweep: Sweep, opts: RunOptions, echo: Callable[[str], None]) -> ExitCode:
    if opts.distributed and opts.shard:
        raise ConfigError("--shard and --distributed: choose one (torchrun assigns shares itself)")
    info = dist.torchrun_rank() if opts.distributed else None
    share = dist.Share(info.rank, info.world_size) if info else (
        dist.parse_shard(opts.shard) if opts.shard else None)
    device = select_device(opts.device, info.local_rank if info else None)
    graph_guard(sweep, device, opts.command)
    is_main = info is None or info.rank == 0
    env = collect(device)
    digest = sweep_digest(sweep)
    modes = MODES[opts.command]
    provenance = outfile.Provenance.of(sweep.name, digest, opts.command, modes, env)
    all_cases = sweep.cases + tuple(s.case for s in sweep.skipped)
    cases = all_cases
    if share:
        cases = tuple(dist.assign(all_cases, share.count, modes, len(sweep.backends))[share.index])
    if opts.out is not None:
        target = outfile.explicit(dist.part_path(opts.out, info.rank) if info else opts.out,
                                  opts.resume, opts.force)
        out = opts.out
    else:
        out = default_out(sweep, opts.command, env.gpu, None if info else share)
        paths.output_file(out, "default output")
        target = (outfile.explicit(dist.part_path(out, info.rank), opts.resume, opts.force) if info
                  else outfile.default(out, opts.resume, opts.force, provenance))
        out = out if info else target.path
    if info and is_main and out.exists() and not (opts.resume or opts.force):
        raise ConfigError(f"{out}: results file exists; pass --resume to finish it or --force to start over")
    write_path = target.path
    previous = _previous_rows(target)
    final_previous = (read_rows(out, tolerate_partial_last_line=True)
                      if info and is_main and opts.resume and out.exists() else [])
    name = "--out" if opts.out is not None else ""
    check_resumed(previous, sweep, provenance, write_path, name)
    check_resumed(final_previous, sweep, provenance, out, name)
    done = {r.key for r in previous + final_previous}

    backends = make_backends()
    units = plan_units(sweep, cases, modes, backends, device)
    todo = [u for u in units if u.key not in done]
    check = sweep.check or opts.command == "equiv"
    estimates = cost.estimate_points(todo, backends, sweep.timing, check, device.type)
    total_s = sum(estimates.values())
    if device.type == "cpu":
        cpu_guard(sweep, total_s, len(todo), opts.allow_slow)
        if is_main:
            echo(CPU_NOTE)
    if target.note and is_main:
        echo(target.note)
    where = f" (rank {info.rank}/{info.world_size}, {len(cases)} cases)" if info else (
        f" (shard {share.label}, {len(cases)} cases)" if share else "")
    if is_main or info is None:
        if todo:
            echo(f"{sweep.name} {opts.command}: {len(todo)} points to run, {len(units) - len(todo)} "
                 f"already done{where}, estimated {cost.format_seconds(total_s)} -> {out}")
        else:
            echo(f"{sweep.name} {opts.command}: nothing to run, all {len(units)} points already "
                 f"done{where} -> {out}")
    if previous:
        rewrite(write_path, previous)  # drops a line a killed process left half-written
    if info:
        dist.init_group(info)
    written: list[Row] = []
    label = sweep.name if info is None else f"{sweep.name} rank {info.rank}"
    show = opts.progress and is_main
    try:
        with RowWriter(write_path, append=bool(previous)) as writer, \
                make_progress(total_s, len(todo), label, show) as bar:
            def report(row: Row, unit: Unit) -> None:
                writer.write(row)
                written.append(row)
                bar.advance(estimates[unit.key], _row_message(row),
                            important=row.status not in ("ok", "skipped"))

            def on_hang(point: str, seconds: float) -> None:
                from .restart import restart_after_hang

                restart_after_hang(point, seconds, write_path,
                                   lambda message: print(message, file=sys.stderr))

            try:
                SweepRunner(sweep, backends, device, env, check, report, digest,
                            point_timeout_s=opts.point_timeout_s, on_hang=on_hang).run(todo)
            except DeviceFault as fault:
                fault.out = write_path  # the restart resumes this file, numbered or not
                raise
    except KeyboardInterrupt:
        already = len(units) - len(todo)
        print(interrupted_line(already + len(written), len(units), write_path, info),
              file=sys.stderr, flush=True)
        raise  # the CLI exits 130
    rows = previous + written
    if info:
        gathered = dist.gather_to_rank0([r.__dict__ for r in rows], info)
        dist.finish_group()
        if not is_main:
            echo(f"rank {info.rank}: {len(written)} rows written to {write_path}")
            return exit_code(rows, opts.command)
        full_plan = plan_units(sweep, all_cases, modes, backends, device)
        merged = final_previous + [Row(**d) for part in gathered for d in part]
        rows = _in_plan_order(merged, full_plan)
        rewrite(out, rows)
    summarize(rows, echo)
    echo(f"results: {out}")
    if opts.plot and opts.command != "equiv" and is_main:
        from .plot import plot_rows

        try:
            for path in plot_rows(rows, out.parent, out.stem, None):
                echo(f"plot: {path}")
        except ConfigError as exc:
            echo(f"no plot: {exc}")
    return exit_code(rows, opts.command)


def with_backends(sweep: Sweep, names: tuple[str, ...] | None) -> Sweep:
    return sweep if names is None else replace(sweep, backends=names)


def with_cuda_graph(sweep: Sweep, on: bool) -> Sweep:
    """``--cuda-graph`` turns CUDA-graph timing on over the sweep's ``timing``; without the flag
    the sweep's own setting stands."""
    return replace(sweep, timing=replace(sweep.timing, cuda_graph=True)) if on else sweep
