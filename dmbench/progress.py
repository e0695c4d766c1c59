"""A progress bar with ETA, weighted by estimated cost so one huge point does not fool the ETA.

Uses rich when it is installed (typer normally brings it); otherwise prints a plain line per
finished point, which is also what non-terminal output gets.
"""

from __future__ import annotations

import sys
import time


class _Plain:
    def __init__(self, total_cost: float, points: int, label: str):
        self.total, self.points, self.label = total_cost, points, label
        self.done_cost, self.done, self.start = 0.0, 0, time.perf_counter()

    def advance(self, cost: float, message: str, important: bool = False) -> None:
        self.done += 1
        self.done_cost += cost
        elapsed = time.perf_counter() - self.start
        eta = elapsed * (self.total - self.done_cost) / self.done_cost if self.done_cost else 0.0
        print(f"[{self.label} {self.done}/{self.points} eta {eta:.0f}s] {message}", flush=True)

    def log(self, message: str) -> None:
        print(message, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Rich:
    def __init__(self, total_cost: float, points: int, label: str):
        from rich.progress import (BarColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.points = points
        self.done = 0
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                            TextColumn("{task.fields[count]}"), TimeElapsedColumn(),
                            TextColumn("eta"), TimeRemainingColumn(), transient=False)
        self.task = self.bar.add_task(label, total=max(total_cost, 1e-9), count=f"0/{points}")

    def advance(self, cost: float, message: str, important: bool = False) -> None:
        self.done += 1
        self.bar.update(self.task, advance=cost, count=f"{self.done}/{self.points}")
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
    def advance(self, cost: float, message: str, important: bool = False) -> None:
        pass


def make_progress(total_cost: float, points: int, label: str, enabled: bool = True):
    if not enabled:
        return _Silent(total_cost, points, label)
    if sys.stdout.isatty():
        try:
            return _Rich(total_cost, points, label)
        except ImportError:
            pass
    return _Plain(total_cost, points, label)
