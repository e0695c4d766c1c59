"""A progress bar whose ETA comes from the cost model (``dmbench.cost``).

Before the first point finishes the ETA is the model's estimate of the whole run; after that it
is the estimate of the points still to run, rescaled by how fast the finished points went
against their own estimates. One huge point therefore does not fool it, and it never shows a
zero ETA for a run that has not started.

Uses rich when it is installed (typer normally brings it) and the output is a terminal;
otherwise prints a plain line per finished point.
"""

from __future__ import annotations

import sys
import time

from .cost import format_seconds


class Eta:
    """Remaining seconds from estimated costs (seconds) and measured progress."""

    def __init__(self, total_estimate_s: float, clock=time.perf_counter):
        self.total = total_estimate_s
        self.done = 0.0
        self.clock = clock
        self.start = clock()

    def advance(self, estimate_s: float) -> None:
        self.done += estimate_s

    def seconds(self) -> float:
        remaining = max(self.total - self.done, 0.0)
        if self.done <= 0.0:
            return remaining
        return remaining * (self.clock() - self.start) / self.done

    def text(self) -> str:
        return f"eta {format_seconds(self.seconds())}"


class _Plain:
    def __init__(self, total_estimate_s: float, points: int, label: str):
        self.eta = Eta(total_estimate_s)
        self.points, self.label, self.done = points, label, 0

    def advance(self, estimate_s: float, message: str, important: bool = False) -> None:
        self.done += 1
        self.eta.advance(estimate_s)
        print(f"[{self.label} {self.done}/{self.points} {self.eta.text()}] {message}", flush=True)

    def log(self, message: str) -> None:
        print(message, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Rich:
    def __init__(self, total_estimate_s: float, points: int, label: str):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.eta = Eta(total_estimate_s)
        self.points, self.done = points, 0
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                            TextColumn("{task.fields[count]}"), TimeElapsedColumn(),
                            TextColumn("{task.fields[eta]}"), transient=False)
        self.task = self.bar.add_task(label, total=max(total_estimate_s, 1e-9),
                                      count=f"0/{points}", eta=self.eta.text())

    def advance(self, estimate_s: float, message: str, important: bool = False) -> None:
        self.done += 1
        self.eta.advance(estimate_s)
        self.bar.update(self.task, advance=estimate_s, count=f"{self.done}/{self.points}",
                        eta=self.eta.text())
        if important:
            self.log(message)

    def log(self, message: str) -> None:
        self.bar.console.print(message, markup=False, highlight=False)

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)


class _Silent(_Plain):
    def advance(self, estimate_s: float, message: str, important: bool = False) -> None:
        self.eta.advance(estimate_s)


def make_progress(total_estimate_s: float, points: int, label: str, enabled: bool = True):
    """``total_estimate_s``: the cost model's seconds for every point to run; each ``advance``
    passes the finished point's own estimate."""
    if not enabled:
        return _Silent(total_estimate_s, points, label)
    if sys.stdout.isatty():
        try:
            return _Rich(total_estimate_s, points, label)
        except ImportError:
            pass
    return _Plain(total_estimate_s, points, label)
