"""Going on after a device fault.

An illegal memory access or a device-side assert kills the process's CUDA context: no later
kernel can run in it, not even ours. The runner records the faulting point and raises
``DeviceFault``; here the command starts again in a fresh process with ``--resume``, which skips
every row already in the CSV (the faulting one included), so a crashing peer costs one row, not
the sweep. Each fault writes at least one row, so the restarts end; ``MAX_RESTARTS`` is a guard
against a device that faults on every kernel.
"""

from __future__ import annotations

import os
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


def restart_after_fault(fault: Exception, warn: Callable[[str], None]) -> ExitCode:
    """Replace this process with a resuming one; returns only when that is not possible."""
    done = int(os.environ.get(RESTARTS_ENV, "0") or 0)
    argv = sys.argv[1:]
    if "--distributed" in argv or done >= MAX_RESTARTS:
        why = ("under torchrun the other ranks stop with this one" if "--distributed" in argv
               else f"{done} restarts already")
        warn(f"device fault at {fault}. Rows so far are in the CSV ({why}); run the same command "
             "with --resume to finish the rest.")
        return ExitCode.ACCURACY
    warn(f"device fault at {fault}. That row is recorded; this process's CUDA context is lost, so "
         f"the remaining points go on in a fresh process with --resume (restart {done + 1}).")
    os.environ[RESTARTS_ENV] = str(done + 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "dmbench",
                              *resume_argv(argv, getattr(fault, "out", None))])
    return ExitCode.ACCURACY  # only reached when a test replaces os.execv
