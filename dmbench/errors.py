"""Exit codes and the one exception type for user mistakes.

A ``ConfigError`` carries a complete one-line message (file, key, what was expected); the CLI
prints it and exits with ``ExitCode.USAGE``. It is never shown as a traceback.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    PERF_REGRESSION = 1
    USAGE = 2
    ACCURACY = 3
    INCOMPLETE = 4


EXIT_CODES_HELP = (
    "Exit codes: 0 pass; 1 performance regression (compare; never from CPU timings), or a "
    "call that compiled at a new length (compile-cost --require-zero); 2 usage or config error "
    "(bad flag, bad sweep file, unreadable CSV or a row of it with an unknown status or a bad "
    "time, a (sweep, case, backend, mode, timing) twice in report's CSVs, CPU against GPU "
    "timings in compare, a path missing or of the wrong kind, an existing "
    "--out without --resume or --force, --resume with --force or of another run's file, a "
    "CPU run estimated over 5 minutes without --allow-slow, "
    "--cuda-graph off a CUDA device); 3 accuracy failure (a checked tensor over its "
    "allowed error, a backend error during equiv, or a device fault that stopped a run); "
    "4 incomplete comparison (compare: baseline rows missing from the new CSV, or no rows in "
    "common; --allow-missing accepts it); 130 interrupted (Ctrl-C; a sweep prints the command "
    "that finishes it). When several apply, compare exits 3, then 1, then 4."
)


class ConfigError(Exception):
    """A user mistake in a flag, a sweep file or an input CSV. The message is one line."""
