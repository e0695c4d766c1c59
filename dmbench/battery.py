"""``dmbench battery``: every GPU sweep of ``sweeps/`` on one host's GPUs, one sweep process per
GPU at a time, into one results folder.

The battery is the published set: each GPU sweep's ``fwd`` (and ``bwd`` where it has a
backward), and the sweeps whose rows under a millisecond are host-bound timed again as CUDA
graph replays (``BATTERY``). Jobs run longest first: by the minutes their file took last time
where the results folder has one (the span of its rows' timestamps), the jobs without one
first, by their sweeps' estimated dense FLOPs (``flops.estimated_cost``). Each runs in its own
``python -m dmbench`` process pinned to a free GPU
by ``CUDA_VISIBLE_DEVICES``, writing ``<out_dir>/<sweep>-<command>[-cuda-graph].csv`` and
``<logs>/<same stem>.log``. A job whose CSV exists is resumed (``--resume``: its finished
points are kept, and a file of another commit or setup is refused by that command, exit 2),
so an interrupted battery is finished by running the same command again.

The exit code is the worst of the jobs' (3, then 1, then 2, then 4; 0 when all passed).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from . import flops
from .errors import ConfigError, ExitCode

SWEEPS_DIR = Path(__file__).resolve().parents[1] / "sweeps"
# Sweeps sized for the CPU: not part of the GPU battery.
CPU_SWEEPS = ("smoke", "formats")
# Each GPU sweep: the commands it is published under, and whether it is also published timed
# as CUDA graph replays (rows under a millisecond time the host as much as the GPU).
BATTERY = {
    "bias": (("fwd", "bwd"), True),
    "decode": (("fwd",), True),
    "dense": (("fwd", "bwd"), False),
    "gqa": (("fwd", "bwd"), False),
    "headdim": (("fwd", "bwd"), False),
    "intervals": (("fwd", "bwd"), True),
    "longctx": (("fwd", "bwd"), False),
    "models": (("fwd", "bwd"), True),
    "seqlen": (("fwd", "bwd"), True),
    "sparsity": (("fwd", "bwd"), False),
    "varlen": (("fwd", "bwd"), False),
    "window": (("fwd", "bwd"), False),
}
# The commands a sweep's CUDA-graph files are published for, where not all of its commands:
# models as CUDA graphs is its forward alone (its host-bound rows are the decode forwards).
GRAPH_COMMANDS = {"models": ("fwd",)}
# worst first: the battery's exit code is the first of these any job returned
SEVERITY = (ExitCode.ACCURACY, ExitCode.PERF_REGRESSION, ExitCode.USAGE, ExitCode.INCOMPLETE)


@dataclass(frozen=True)
class Job:
    sweep: str
    command: str  # fwd or bwd
    cuda_graph: bool
    cost: float  # the estimated dense FLOPs of its points (relative)
    minutes: float | None = None  # what its file took last time, where known

    @property
    def order(self) -> tuple:
        """Sort key, first job first: jobs without a past run (by cost), then by minutes."""
        if self.minutes is None:
            return (0, -self.cost, self.stem)
        return (1, -self.minutes, self.stem)

    @property
    def stem(self) -> str:
        return f"{self.sweep}-{self.command}" + ("-cuda-graph" if self.cuda_graph else "")

    def argv(self, out_dir: Path, sweeps_dir: Path) -> list[str]:
        """The job's own command line; ``--resume`` where its CSV exists."""
        out = out_dir / f"{self.stem}.csv"
        args = [sys.executable, "-m", "dmbench", self.command,
                str(sweeps_dir / f"{self.sweep}.yaml"), "--out", str(out), "--no-plot",
                "--no-progress"]
        if self.cuda_graph:
            args.append("--cuda-graph")
        if out.exists():
            args.append("--resume")
        return args


def past_minutes(path: Path) -> float | None:
    """The minutes between the first and the last row of a results CSV, or None (no file, fewer
    than two timestamps, or not a results file)."""
    from datetime import datetime

    try:
        with open(path, newline="") as f:
            stamps = sorted(row["timestamp"] for row in csv.DictReader(f) if row.get("timestamp"))
        if len(stamps) < 2:
            return None
        first, last = (datetime.fromisoformat(s.replace("Z", "+00:00")) for s in (stamps[0],
                                                                                 stamps[-1]))
    except (OSError, KeyError, csv.Error, UnicodeDecodeError, ValueError):
        return None
    return (last - first).total_seconds() / 60


def plan_jobs(only: tuple[str, ...] = (), sweeps_dir: Path = SWEEPS_DIR,
              history: Path | None = None) -> list[Job]:
    """The battery's jobs (``only``: these sweeps alone), longest first, timed by the files in
    ``history`` (a results folder) where it has them. Every sweep file in ``sweeps_dir`` must
    be a CPU sweep or in ``BATTERY``, so that a new sweep is never left out silently."""
    from .backends import BACKEND_NAMES
    from .sweep import load_sweep

    files = sorted(p.stem for p in sweeps_dir.glob("*.yaml"))
    unknown = [s for s in files if s not in BATTERY and s not in CPU_SWEEPS]
    if unknown:
        raise ConfigError(f"{sweeps_dir}: {', '.join(unknown)}: not in the battery "
                          "(dmbench/battery.py BATTERY) nor a CPU sweep")
    wanted = only or tuple(s for s in BATTERY if s in files)
    missing = [s for s in wanted if s not in BATTERY]
    if missing:
        raise ConfigError(f"--only: expected sweeps of the battery ({', '.join(BATTERY)}), "
                          f"got {', '.join(missing)}")
    jobs = []
    for name in wanted:
        sweep = load_sweep(sweeps_dir / f"{name}.yaml", BACKEND_NAMES)
        commands, with_graphs = BATTERY[name]
        for command in commands:
            modes = ("fwd",) if command == "fwd" else ("bwd", "fwd+bwd")
            cost = sum(flops.estimated_cost(c, modes, len(sweep.backends)) for c in sweep.cases)
            graphs = (False, True) if (with_graphs and command in
                                       GRAPH_COMMANDS.get(name, commands)) else (False,)
            for graph in graphs:
                job = Job(name, command, graph, cost)
                if history is not None:
                    job = replace(job, minutes=past_minutes(history / f"{job.stem}.csv"))
                jobs.append(job)
    return sorted(jobs, key=lambda j: j.order)


@dataclass(frozen=True)
class Finished:
    job: Job
    gpu: str
    code: int
    seconds: float


def run_jobs(jobs: list[Job], gpus: list[str], out_dir: Path, logs: Path,
             echo: Callable[[str], None], sweeps_dir: Path = SWEEPS_DIR,
             start: Callable[..., int] | None = None) -> list[Finished]:
    """Run ``jobs`` in order, one at a time on each of ``gpus`` (``CUDA_VISIBLE_DEVICES``
    values), each job's output in ``logs/<stem>.log``. ``start(argv, env, log)`` runs one job
    and returns its exit code (default: a subprocess)."""
    start = start or _subprocess
    out_dir.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    pending = list(jobs)
    done: list[Finished] = []
    lock = threading.Lock()

    def worker(gpu: str) -> None:
        while True:
            with lock:
                if not pending:
                    return
                job = pending.pop(0)
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu, PYTHONUNBUFFERED="1")
            began = time.monotonic()
            with open(logs / f"{job.stem}.log", "a") as log:
                code = start(job.argv(out_dir, sweeps_dir), env, log)
            finished = Finished(job, gpu, code, time.monotonic() - began)
            with lock:
                done.append(finished)
                echo(f"{job.stem}: exit {code} on GPU {gpu} after {finished.seconds / 60:.1f} min "
                     f"({len(done)} of {len(jobs)} done)")

    threads = [threading.Thread(target=worker, args=(gpu,)) for gpu in gpus]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return done


def _subprocess(argv: list[str], env: dict, log) -> int:
    return subprocess.call(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def battery_code(done: list[Finished]) -> ExitCode:
    """The worst of the jobs' exit codes (``SEVERITY``); a code outside it counts as 3."""
    codes = {d.code for d in done}
    if codes <= {0}:
        return ExitCode.OK
    for code in SEVERITY:
        if int(code) in codes:
            return code
    return ExitCode.ACCURACY


def gpu_list(count: int | None) -> list[str]:
    """The GPUs to use: the first ``count`` of this host's (all of them without one)."""
    import torch

    available = torch.cuda.device_count()
    if available == 0:
        raise ConfigError("battery: no CUDA device here; the battery times GPU sweeps")
    if count is not None and not 1 <= count <= available:
        raise ConfigError(f"--gpus: expected 1 to {available} (this host's GPUs), got {count}")
    return [str(i) for i in range(count or available)]
