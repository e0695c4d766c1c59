"""The regression gate: a baseline CSV against a new one.

For each (case, backend, mode) timed in both files, with r = new p50 / baseline p50:

- ``slower`` when r > threshold AND the new p20 is above the baseline p80: the slowdown is both
  larger than the allowed margin and outside the measured p20-p80 noise of the two runs;
- ``faster`` symmetrically (r < 1/threshold and new p80 below baseline p20);
- ``same`` otherwise (within the threshold, or inside the noise);
- ``broken`` when the baseline timed it and the new run got an error or OOM.

Accuracy: any new row with status ``accuracy``, or with a recorded error over its allowed error,
or an ``equiv`` row that errored, is an accuracy failure.

Completeness: a baseline row (any mode, any status) with no row of the same key in the new file
is ``missing``, and two files with no key in common compared nothing. Either makes the
comparison incomplete (exit 4) unless ``allow_missing`` is set: a gate that passes because the
new run lost rows would pass a run that crashed halfway.

Exit codes, the first that applies: 3 accuracy, 1 regression, 4 incomplete, 0 pass.
Timings from different GPUs are not comparable, nor eager times with CUDA graph replays (the
``timing`` column); either is a usage error (exit 2) naming both files.

CPU rows (the ``gpu`` column ``cpu (triton interpreter)``: Triton's interpreter) carry timings
that are not performance numbers. Two CPU files are compared for accuracy and completeness
only: a pair of CPU rows that were both timed gets the verdict ``untimed`` instead of a ratio,
one line says that the timings were not compared, and no timing ever makes the exit code 1 (a
``broken`` row, timed in the baseline and an error or OOM now, still does: that is not a
timing). A CPU file against a GPU file is refused (exit 2) like two different GPUs, naming the
CPU file's first CPU row: interpreter timings never compare with a GPU's.
"""

from __future__ import annotations

from dataclasses import dataclass

from .collected import is_interpreter_row
from .errors import ConfigError, ExitCode
from .results import TIMED_MODES, Row, accuracy_failures, row_line



@dataclass(frozen=True)
class Entry:
    key: tuple[str, str, str]
    verdict: str  # slower, faster, same, untimed (CPU), broken, missing, new
    ratio: float | None
    base_ms: float | None
    new_ms: float | None


MISSING_EXAMPLES = 3


@dataclass(frozen=True)
class Coverage:
    """How the two files' row keys overlap, over every mode."""

    base_rows: int
    new_rows: int
    in_common: int
    missing: tuple[tuple[str, str, str], ...]  # baseline keys absent from the new file, in order
    new_only: int

    @property
    def complete(self) -> bool:
        return not self.missing and self.in_common > 0


@dataclass(frozen=True)
class Report:
    entries: tuple[Entry, ...]
    accuracy_failures: tuple[str, ...]
    coverage: Coverage
    allow_missing: bool = False

    @property
    def regressions(self) -> tuple[Entry, ...]:
        return tuple(e for e in self.entries if e.verdict in ("slower", "broken"))

    @property
    def exit_code(self) -> ExitCode:
        if self.accuracy_failures:
            return ExitCode.ACCURACY
        if self.regressions:
            return ExitCode.PERF_REGRESSION
        if not self.coverage.complete and not self.allow_missing:
            return ExitCode.INCOMPLETE
        return ExitCode.OK


def _index(rows: list[Row], label: str) -> dict[tuple[str, str, str], Row]:
    out = {}
    for row in rows:
        if row.key in out:
            raise ConfigError(f"{label}: duplicate row for case {row.key[0]} backend {row.key[1]} "
                              f"mode {row.key[2]}; run `dmbench merge` to find duplicates")
        out[row.key] = row
    return out


def _timed(row: Row | None) -> bool:
    return row is not None and row.status in ("ok", "accuracy") and row.ms_p50 is not None


def _verdict(base: Row, new: Row, threshold: float) -> Entry:
    ratio = new.ms_p50 / base.ms_p50 if base.ms_p50 > 0 else float("inf")
    verdict = "same"
    if ratio > threshold and new.ms_p20 > base.ms_p80:
        verdict = "slower"
    elif ratio < 1.0 / threshold and new.ms_p80 < base.ms_p20:
        verdict = "faster"
    return Entry(base.key, verdict, ratio, base.ms_p50, new.ms_p50)


def _accuracy_problems(new_rows: list[Row]) -> list[str]:
    problems = []
    for row in new_rows:
        bad = accuracy_failures(row)
        name = f"{row.case_id} {row.backend} {row.mode}"
        if row.status == "accuracy" or bad:
            problems.append(f"{name}: {row.detail or 'over allowed error: ' + ', '.join(bad)}")
        elif row.mode == "equiv" and row.status in ("error", "oom"):
            problems.append(f"{name}: not verified ({row.detail})")
    return problems


def _first_line(rows: list[Row], wanted) -> tuple[int, Row]:
    """The line (``row_line``) and row of the first row for which ``wanted(row)`` holds."""
    return next((row_line(i), row) for i, row in enumerate(rows) if wanted(row))


def check_environments(base_rows: list[Row], new_rows: list[Row], base_label: str,
                       new_label: str) -> None:
    """Different GPUs make every ratio meaningless; refuse rather than gate on noise. A CPU
    file against a GPU file is refused with its own reason, naming the first CPU row."""
    base_gpus = {r.gpu for r in base_rows}
    new_gpus = {r.gpu for r in new_rows}
    if not (base_gpus and new_gpus and base_gpus != new_gpus):
        return
    base_cpu = any(map(is_interpreter_row, base_rows))
    new_cpu = any(map(is_interpreter_row, new_rows))
    if base_cpu != new_cpu:
        cpu_label, cpu_rows, gpu_label, gpu_devices = (
            (base_label, base_rows, new_label, new_gpus) if base_cpu
            else (new_label, new_rows, base_label, base_gpus))
        line, row = _first_line(cpu_rows, is_interpreter_row)
        raise ConfigError(
            f"{cpu_label}: line {line}: measured on {row.gpu} but {gpu_label} on "
            f"{', '.join(sorted(gpu_devices))}; interpreter timings are not performance numbers "
            "and never compare with a GPU's: compare runs from one GPU model, or two CPU runs "
            "(accuracy and completeness only)")
    label, rows, other_label, other = (
        (new_label, new_rows, base_label, base_gpus) if new_gpus - base_gpus
        else (base_label, base_rows, new_label, new_gpus))
    line, row = _first_line(rows, lambda r: r.gpu not in other)
    raise ConfigError(f"{label}: line {line}: measured on {row.gpu} but {other_label} on "
                      f"{', '.join(sorted(other))}; compare runs from the same GPU model")


def _timings(rows: list[Row]) -> set[str]:
    return {r.timing for r in rows if r.mode in TIMED_MODES}


def check_timings(base_rows: list[Row], new_rows: list[Row], base_label: str,
                  new_label: str) -> None:
    """Eager times against CUDA graph replays would gate on the host's time per call."""
    base, new = _timings(base_rows), _timings(new_rows)
    if base and new and base != new:
        raise ConfigError(f"{new_label}: timed {', '.join(sorted(new))} but {base_label} "
                          f"{', '.join(sorted(base))}; compare runs of the same timing "
                          "(--cuda-graph on both or on neither)")


def _same_timing(base: Row, new: Row, base_label: str, new_label: str) -> None:
    """A row pair of different timings (files that mix both) is refused like whole files."""
    if base.timing != new.timing:
        raise ConfigError(f"{new_label}: {' '.join(new.key)} timed {new.timing} but in "
                          f"{base_label} {base.timing}; compare rows of the same timing")


def _same_device(base: Row, new: Row, base_label: str, new_label: str) -> None:
    """A row pair of different devices (files that mix devices) is refused like whole files."""
    if base.gpu != new.gpu:
        raise ConfigError(f"{new_label}: {' '.join(new.key)} measured on {new.gpu} but in "
                          f"{base_label} on {base.gpu}; compare rows from the same device")


def coverage(base: dict, new: dict) -> Coverage:
    missing = tuple(k for k in base if k not in new)
    return Coverage(len(base), len(new), sum(1 for k in base if k in new), missing,
                    sum(1 for k in new if k not in base))


def compare_rows(base_rows: list[Row], new_rows: list[Row], threshold: float,
                 base_label: str = "baseline", new_label: str = "new",
                 allow_missing: bool = False) -> Report:
    if not threshold > 1.0:
        raise ConfigError(f"--threshold: expected a ratio above 1.0 (e.g. 1.10), got {threshold}")
    check_environments(base_rows, new_rows, base_label, new_label)
    check_timings(base_rows, new_rows, base_label, new_label)
    base = _index(base_rows, base_label)
    new = _index(new_rows, new_label)
    entries = []
    for key, brow in base.items():
        if brow.mode not in TIMED_MODES:
            continue
        nrow = new.get(key)
        if nrow is None:
            entries.append(Entry(key, "missing", None, brow.ms_p50, None))
            continue
        _same_timing(brow, nrow, base_label, new_label)
        _same_device(brow, nrow, base_label, new_label)
        if _timed(brow) and _timed(nrow):
            entries.append(Entry(key, "untimed", None, brow.ms_p50, nrow.ms_p50)
                           if is_interpreter_row(brow) else _verdict(brow, nrow, threshold))
        elif _timed(brow) and nrow.status in ("error", "oom"):
            entries.append(Entry(key, "broken", None, brow.ms_p50, None))
    for key, nrow in new.items():
        if key not in base and nrow.mode in TIMED_MODES:
            entries.append(Entry(key, "new", None, None, nrow.ms_p50))
    return Report(tuple(entries), tuple(_accuracy_problems(new_rows)), coverage(base, new),
                  allow_missing)


def coverage_line(report: Report, base_label: str, new_label: str) -> str | None:
    """One line saying what the new file lacks, or None when the comparison is complete."""
    cov = report.coverage
    if cov.complete:
        return None
    verdict = "accepted (--allow-missing)" if report.allow_missing else \
        f"exit {int(ExitCode.INCOMPLETE)}; pass --allow-missing to accept"
    if cov.in_common == 0:
        return (f"INCOMPLETE no rows in common: {base_label} has {cov.base_rows}, {new_label} has "
                f"{cov.new_rows}; {verdict}")
    examples = ", ".join(" ".join(k) for k in cov.missing[:MISSING_EXAMPLES])
    more = f", ... {len(cov.missing) - MISSING_EXAMPLES} more" if len(cov.missing) > MISSING_EXAMPLES else ""
    return (f"INCOMPLETE {len(cov.missing)} of {cov.base_rows} {base_label} rows missing from "
            f"{new_label} (e.g. {examples}{more}); {verdict}")


def format_report(report: Report, base_label: str = "baseline", new_label: str = "new") -> list[str]:
    lines = []
    counts = {}
    for e in report.entries:
        counts[e.verdict] = counts.get(e.verdict, 0) + 1
    for e in report.entries:
        if e.verdict in ("slower", "broken", "faster"):
            ratio = "" if e.ratio is None else f" x{e.ratio:.2f}"
            base = "" if e.base_ms is None else f" {e.base_ms:.4g} ms"
            new = "" if e.new_ms is None else f" -> {e.new_ms:.4g} ms"
            lines.append(f"{e.verdict.upper():7s} {e.key[0]} {e.key[1]} {e.key[2]}:{base}{new}{ratio}")
    for problem in report.accuracy_failures:
        lines.append(f"ACCURACY {problem}")
    if counts.get("untimed"):
        lines.append(f"timings not compared: {counts['untimed']} row pair(s) ran on the CPU under "
                     "Triton's interpreter, whose timings are not performance numbers; accuracy "
                     "and completeness only")
    summary = ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))
    lines.append(f"compared: {summary or 'nothing in common'}; "
                 f"{len(report.accuracy_failures)} accuracy failure(s)")
    incomplete = coverage_line(report, base_label, new_label)
    if incomplete:
        lines.append(incomplete)
    return lines
