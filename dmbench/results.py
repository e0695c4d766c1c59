"""Result rows and CSV files.

One ``Row`` per (case, backend, mode); its field order is the CSV column order. Rows are appended
and flushed one at a time, so a killed run loses nothing it finished. Reading goes through
``read_rows``, which checks the header and every row, so ``compare``, ``report``, ``plot`` and
``merge`` reject a file that is not a dmbench CSV with a one-line error naming the file and the
line. A file re-saved by pandas reads back too: integral floats (``32.0``) are read as ints, and a
leading unnamed index column is dropped. A file written before a column in ``ADDED_COLUMNS``
existed reads with that column's default.

Statuses: ``ok``; ``accuracy`` (a checked tensor over its allowed error); ``error`` (the backend
raised; ``detail`` says what); ``oom``; ``skipped`` (the backend cannot run this case or is not
available here; ``detail`` says why). A row of another status, or of a mode not in ``MODES``, is
refused.

Times (``ms_p20``, ``ms_p50``, ``ms_p80``) are milliseconds, finite and not negative wherever
present; an ``ok`` row of a timed mode (fwd, bwd, fwd+bwd) has all three. ``equiv`` rows and rows
that failed before they were timed have none.
"""

from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .case import Case, documents_from_text
from .columns import (ENVIRONMENT_COLUMNS, Column, column, environment_columns,
                      environment_values, row_dataclass)
from .errors import ConfigError

STATUSES = ("ok", "accuracy", "error", "oom", "skipped")
# How a row's times were taken (``Row.timing``): eager calls, or CUDA graph replays.
TIMINGS = ("eager", "cuda_graph")
MODES = ("fwd", "bwd", "fwd+bwd", "equiv")
TIMED_MODES = ("fwd", "bwd", "fwd+bwd")
TIME_COLUMNS = ("ms_p20", "ms_p50", "ms_p80")
# Columns appended after files were already being written; older files lack them.
ADDED_COLUMNS = ("sweep_hash", "mask_format", "documents", "timing")


# The case columns are Case's fields (dmbench.case), so a case key added there is a column here.
# Each holds the case's value, but documents its text ("0,1,5"; empty when drawn). Case keeps
# its fields in the order of its positional constructor; the CSV has mask_format and documents,
# the last two Case gained, right after mask_shape.
_AFTER_MASK_SHAPE = ("mask_format", "documents")
_CELL_TYPES = {"documents": ("str", "")}  # (type, default) of a column that differs from Case


def _case_columns() -> list[Column]:
    """Case's fields in the CSV's order. A column older files lack (``ADDED_COLUMNS``) reads
    with its default and is keyword-only, so that it may stand among required columns."""
    case_fields = {f.name: f for f in fields(Case)}
    names = [name for name in case_fields if name not in _AFTER_MASK_SHAPE]
    at = names.index("mask_shape") + 1
    names[at:at] = _AFTER_MASK_SHAPE
    columns = []
    for name in names:
        f = case_fields[name]
        type_, default = _CELL_TYPES.get(name, (f.type, f.default))
        columns.append(column(name, type_, default, kw_only=True) if name in ADDED_COLUMNS
                       else column(name, type_))
    return columns


_CASE_COLUMN_SPECS = _case_columns()


@dataclass
class _Measurement:
    """What one (case, backend, mode) point measured."""

    backend: str
    mode: str
    status: str
    detail: str = ""
    ms_p20: float | None = None
    ms_p50: float | None = None
    ms_p80: float | None = None
    repeats: int | None = None
    timing: str = "eager"  # how the times were taken: eager calls, or cuda_graph replays
    build_ms: float | None = None
    tflops_dense: float | None = None
    tflops_active: float | None = None
    active_fraction: float | None = None
    peak_mib: float | None = None
    err_out: float | None = None
    eager_out: float | None = None
    allowed_out: float | None = None
    err_lse: float | None = None
    eager_lse: float | None = None
    allowed_lse: float | None = None
    err_dq: float | None = None
    eager_dq: float | None = None
    allowed_dq: float | None = None
    err_dk: float | None = None
    eager_dk: float | None = None
    allowed_dk: float | None = None
    err_dv: float | None = None
    eager_dv: float | None = None
    allowed_dv: float | None = None
    err_dbias: float | None = None
    eager_dbias: float | None = None
    allowed_dbias: float | None = None


class Row(row_dataclass(
        "_RowColumns", __name__,
        [column("sweep", "str"), column("case_id", "str")],
        _CASE_COLUMN_SPECS,
        _Measurement,
        environment_columns(),
        # dmbench.sweep.sweep_digest of the sweep the row was run from
        [column("sweep_hash", "str", "")])):
    """One CSV line: the sweep and case, the measurement, the environment, the sweep's digest.
    Its fields (``COLUMNS``) are the columns in order."""

    @property
    def key(self) -> tuple[str, str, str]:
        """What identifies a row across runs, resumes, shards and merges."""
        return (self.case_id, self.backend, self.mode)


COLUMNS = tuple(f.name for f in fields(Row))
CASE_COLUMNS = tuple(name for name, _, _ in _CASE_COLUMN_SPECS)
# What rows merged into one file must share: the environment but for the host and the time.
ENV_COLUMNS = tuple(c for c in ENVIRONMENT_COLUMNS if c not in ("host", "timestamp"))
ACCURACY_TENSORS = ("out", "lse", "dq", "dk", "dv", "dbias")
_TYPES = {f.name: f.type for f in fields(Row)}


def new_row(sweep: str, case: Case, backend: str, mode: str, status: str, env, detail: str = "",
            sweep_hash: str = "", timing: str = "eager") -> Row:
    case_values = {name: getattr(case, name) for name in CASE_COLUMNS}
    case_values["documents"] = case.documents_text
    return Row(sweep=sweep, case_id=case.case_id, backend=backend, mode=mode, status=status,
               detail=detail, sweep_hash=sweep_hash, timing=timing, **environment_values(env),
               **case_values)


def row_case(row: Row) -> Case:
    """The case a row was measured on (the inverse of ``new_row``'s case columns)."""
    values = {name: getattr(row, name) for name in CASE_COLUMNS}
    values["documents"] = documents_from_text(row.documents)
    return Case(**values)


def csv_cell(value) -> str:
    """A CSV cell: empty for None, floats to 6 significant digits."""
    if value is None:
        return ""
    if isinstance(value, float):
        return "inf" if math.isinf(value) else "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def _integer(text: str) -> int:
    """'32' or an integral float such as '32.0' (pandas writes an int column holding blanks as
    floats); '32.5' is rejected."""
    try:
        return int(text)
    except ValueError:
        value = float(text)
        if not value.is_integer():
            raise
        return int(value)


def parse_cell(kind: str, name: str, text: str, where: str, integer=_integer):
    """The value of a cell of column ``name``, annotated ``kind`` ("int | None", "bool", ...):
    None for an empty cell where the column takes None; ``integer`` reads ints."""
    if text == "":
        return None if "None" in kind else text
    try:
        if kind.startswith("int"):
            return integer(text)
        if kind.startswith("float"):
            return float(text)
        if kind == "bool":
            if text not in ("True", "False"):
                raise ValueError(text)
            return text == "True"
    except ValueError:
        raise ConfigError(f"{where}: column {name}: expected {kind.split(' ')[0]}, got {text!r}") from None
    return text


def _header_columns(path: Path, header: tuple[str, ...]) -> tuple[tuple[str, ...], bool]:
    """(the columns the file holds, whether its first column is a pandas index to drop)."""
    index = len(header) > 0 and header[0] in ("", "Unnamed: 0") and header[1:2] == COLUMNS[:1]
    named = header[1:] if index else header
    legacy = tuple(c for c in COLUMNS if c not in ADDED_COLUMNS)
    # A file has every column but possibly some of ADDED_COLUMNS, all in COLUMNS' order.
    if set(legacy) <= set(named) <= set(COLUMNS) and named == tuple(c for c in COLUMNS if c in named):
        return named, index
    missing = [c for c in legacy if c not in named]
    detail = f"missing column {missing[0]!r}" if missing else "columns in a different order"
    raise ConfigError(f"{path}: not a dmbench results CSV of this version ({detail})")


class RowWriter:
    """Appends rows to a CSV, writing the header when the file is new or empty."""

    def __init__(self, path: Path, append: bool):
        path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not append or not path.exists() or path.stat().st_size == 0
        self._file = open(path, "w" if fresh else "a", newline="")
        self._writer = csv.writer(self._file)
        if fresh:
            self._writer.writerow(COLUMNS)
            self._file.flush()

    def write(self, row: Row) -> None:
        values = asdict(row)
        self._writer.writerow([csv_cell(values[c]) for c in COLUMNS])
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_row(row: Row, where: str) -> None:
    """A documented status, mode and timing, and times that are times (see the module
    docstring)."""
    if row.status not in STATUSES:
        raise ConfigError(f"{where}: column status: expected one of {', '.join(STATUSES)}, "
                          f"got {row.status!r}")
    if row.mode not in MODES:
        raise ConfigError(f"{where}: column mode: expected one of {', '.join(MODES)}, "
                          f"got {row.mode!r}")
    if row.timing not in TIMINGS:
        raise ConfigError(f"{where}: column timing: expected one of {', '.join(TIMINGS)}, "
                          f"got {row.timing!r}")
    for name in TIME_COLUMNS:
        value = getattr(row, name)
        if value is None:
            if row.status == "ok" and row.mode in TIMED_MODES:
                raise ConfigError(f"{where}: column {name}: expected a time in ms (finite, >= 0) "
                                  f"in an ok {row.mode} row, got an empty cell")
        elif not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{where}: column {name}: expected a time in ms (finite, >= 0), "
                              f"got {csv_cell(value)!r}")


def row_line(index: int) -> int:
    """The line of ``read_rows(path)[index]`` in its file, as read_rows' errors count lines:
    CSV records, the header being line 1 (the file's own line unless a quoted cell spans
    lines)."""
    return index + 2


def read_rows(path: str | Path, tolerate_partial_last_line: bool = False) -> list[Row]:
    """All rows of a dmbench CSV, in file order (``row_line`` gives each one's line). Raises
    ConfigError naming the file, the line and what was expected: a missing or foreign header,
    a line of the wrong width, a value of the wrong type, an unknown status, a time that is
    negative, NaN or infinite, or an ok timed row without its times.

    ``tolerate_partial_last_line`` is for resuming: a process killed mid-write can leave a
    truncated last line (fewer fields), which is dropped rather than rejected.
    """
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "not found"
        raise ConfigError(f"{path}: {what}; expected a dmbench results CSV file")
    try:
        with open(path, newline="") as f:
            lines = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(f"{path}: cannot read as CSV: {exc}") from None
    if not lines:
        raise ConfigError(f"{path}: empty file, expected a dmbench results CSV")
    columns, index = _header_columns(path, tuple(lines[0]))
    width = len(columns) + index
    rows = []
    for number, values in enumerate(lines[1:], start=2):
        if len(values) != width:
            if tolerate_partial_last_line and number == len(lines):
                break
            raise ConfigError(f"{path}: line {number}: expected {width} fields, got {len(values)}")
        where = f"{path}: line {number}"
        row = Row(**{c: parse_cell(_TYPES[c], c, v, where)
                     for c, v in zip(columns, values[index:])})
        _check_row(row, where)
        rows.append(row)
    return rows


def rewrite(path: Path, rows: list[Row]) -> None:
    """Write ``rows`` as a complete file (used to drop a truncated line before resuming)."""
    with RowWriter(path, append=False) as writer:
        for row in rows:
            writer.write(row)


def set_accuracy(row: Row, checks: dict) -> None:
    """Copy ErrorCheck numbers (error, eager baseline, allowed) into the row."""
    for name, check in checks.items():
        setattr(row, f"err_{name}", check.error)
        setattr(row, f"eager_{name}", check.baseline_error)
        setattr(row, f"allowed_{name}", check.allowed)


def accuracy_failures(row: Row) -> list[str]:
    """Tensors whose recorded error is over the allowed error (NaN counts as over)."""
    bad = []
    for name in ACCURACY_TENSORS:
        err, allowed = getattr(row, f"err_{name}"), getattr(row, f"allowed_{name}")
        if err is None or allowed is None:
            continue
        if not (math.isfinite(err) and err <= allowed):
            bad.append(name)
    return bad
