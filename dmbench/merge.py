"""Joining shard CSVs (``--shard i/n``, SLURM array jobs, several hosts) into one results file.

Problems found, each reported on its own line:

- duplicates: a (case, backend, mode) row in more than one place (overlapping shards);
- missing: a case that has rows for some (backend, mode) pairs seen in the files but not for
  others, and, given the sweep, a case of the sweep with no rows at all;
- mismatched environments: rows measured on different GPUs, drivers, torch or triton versions,
  or commits. Timings from mixed environments do not belong in one table;
- mismatched timing: timed rows taken as eager calls in one file and as CUDA graph replays in
  another (the ``timing`` column).

A file that ``read_rows`` refuses (a bad header, status or time) stops the merge with its one-line
error before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .case import Case
from .results import ENV_COLUMNS, Row, read_rows


@dataclass(frozen=True)
class MergeResult:
    rows: tuple[Row, ...]
    problems: tuple[str, ...]


def _environment(row: Row) -> tuple:
    return tuple(getattr(row, c) for c in ENV_COLUMNS)


def merge_files(paths: list[Path], expected_cases: tuple[Case, ...] | None = None) -> MergeResult:
    problems = []
    rows: list[Row] = []
    seen: dict[tuple, Path] = {}
    envs: dict[tuple, Path] = {}
    timings: dict[str, Path] = {}
    for path in paths:
        for row in read_rows(path):
            if row.key in seen:
                problems.append(f"duplicate: {row.case_id} {row.backend} {row.mode} in {seen[row.key]} and {path}")
                continue
            seen[row.key] = path
            envs.setdefault(_environment(row), path)
            if row.mode != "equiv":
                timings.setdefault(row.timing, path)
            rows.append(row)
    if len(envs) > 1:
        described = [f"{p}: " + ", ".join(f"{c}={v}" for c, v in zip(ENV_COLUMNS, env))
                     for env, p in envs.items()]
        problems.append("mismatched environments: " + " | ".join(described))
    if len(timings) > 1:
        problems.append("mismatched timing: " + " | ".join(f"{p}: {t}" for t, p in timings.items()))

    pairs = sorted({(r.backend, r.mode) for r in rows})
    by_case: dict[str, set] = {}
    for r in rows:
        by_case.setdefault(r.case_id, set()).add((r.backend, r.mode))
    for case_id, have in by_case.items():
        for backend, mode in pairs:
            if (backend, mode) not in have:
                problems.append(f"missing: {case_id} {backend} {mode}")
    if expected_cases is not None:
        for case in expected_cases:
            if case.case_id not in by_case:
                problems.append(f"missing: {case.case_id} (no rows at all)")
    return MergeResult(tuple(rows), tuple(problems))
