"""Going on after a device fault or a point that hangs.

An illegal memory access or a device-side assert kills the process's CUDA context: no later
kernel can run in it, not even ours. The runner records the faulting point and raises
``DeviceFault``; here the command starts again in a fresh process with ``--resume``, which skips
every row already in the CSV (the faulting one included), so a crashing peer costs one row, not
the sweep. A point that gives no result within ``--point-timeout`` seconds is recorded and the
sweep goes on the same way (``dmbench.watchdog``). Each fault or hang writes at least one row,
so the restarts end; ``MAX_RESTARTS`` is a guard against a device that faults on every kernel.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Callable

from .errors import ExitCode

RESTARTS_ENV = "DMBENCH_FAULT_RESTARTS"
MAX_RESTARTS = 20


def resume_argv(argv: list[str], out: Path | None = None) -> list[str]:
    """The same command line, resuming its CSV instead of overwriting it. ``out`` is the file
    the run was writing; it is named explicitly when the command line did not name one (a
    default output may have been a numbered file)."""
    args = [a for a in argv if a != "--force"]
    if out is not None and not any(a == "--out" or a.startswith("--out=") for a in args):
        args = [*args, "--out", str(out)]
    return args if "--resume" in args else [*args, "--resume"]


def resume_command(out: Path) -> str:
    """The shell command that finishes this process's run in ``out``: its own command line with
    ``--resume`` (see ``resume_argv``)."""
    return shlex.join(["dmbench", *resume_argv(sys.argv[1:], out)])


def _restart(event: str, why_fresh: str, out: Path | None,
             warn: Callable[[str], None]) -> ExitCode:
    """Replace this process with a resuming one; returns only when that is not possible."""
    done = int(os.environ.get(RESTARTS_ENV, "0") or 0)
    argv = sys.argv[1:]
    if "--distributed" in argv or done >= MAX_RESTARTS:
        why = ("under torchrun the other ranks stop with this one" if "--distributed" in argv
               else f"{done} restarts already")
        warn(f"{event}. Rows so far are in the CSV ({why}); run the same command with --resume "
             "to finish the rest.")
        return ExitCode.ACCURACY
    warn(f"{event}. That row is recorded; {why_fresh}, so the remaining points go on in a fresh "
         f"process with --resume (restart {done + 1}).")
    os.environ[RESTARTS_ENV] = str(done + 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "dmbench", *resume_argv(argv, out)])
    return ExitCode.ACCURACY  # only reached when a test replaces os.execv


def restart_after_fault(fault: Exception, warn: Callable[[str], None]) -> ExitCode:
    """After a device fault: a fresh process resumes the sweep (see the module docstring)."""
    return _restart(f"device fault at {fault}", "this process's CUDA context is lost",
                    getattr(fault, "out", None), warn)


def restart_after_hang(point: str, seconds: float, out: Path | None,
                       warn: Callable[[str], None]) -> None:
    """After a point gave no result in ``seconds`` (``dmbench.watchdog``), called on the
    watchdog's thread: a fresh process resumes the sweep. When that is not possible the
    process exits 3 at once: its main thread is still inside the hung call."""
    code = _restart(f"no result after {seconds:g} s at {point}", "the call cannot be stopped "
                    "from Python", out, warn)
    os._exit(int(code))
