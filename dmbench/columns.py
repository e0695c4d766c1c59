"""Columns the CSV rows share, and laying a row class out of groups of columns.

A row class's field order is its file's column order (``dmbench.results.Row``,
``dmbench.train_results.TrainRow``). A group of columns is a dataclass whose fields are the
columns, or a list of ``column`` specs; ``row_dataclass`` lays groups out one after another into
one dataclass, and a row class derives from it to add its methods. The environment columns are
declared here once (``environment_columns``) for every row that records them.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass, make_dataclass
from datetime import datetime, timezone
from typing import Any

Column = tuple[str, str, Field]  # (name, type as written, field): what make_dataclass takes


def column(name: str, type_: str, default: Any = MISSING, *, kw_only: bool = False) -> Column:
    """One column: required unless given a default (immutable, as every CSV cell is)."""
    return name, type_, field(default=default, kw_only=kw_only)


def group_columns(group: type) -> list[Column]:
    """A group dataclass's fields as columns, each with a field of its own."""
    return [column(f.name, f.type, f.default, kw_only=f.kw_only) for f in fields(group)]


def row_dataclass(name: str, module: str, *groups: type | list[Column]) -> type:
    """A dataclass holding the groups' columns, in order (a group: a dataclass or columns)."""
    specs = [c for g in groups for c in (group_columns(g) if is_dataclass(g) else g)]
    return make_dataclass(name, specs, namespace={"__module__": module})


@dataclass
class _Environment:
    """Where, with what and when a row was measured (``dmbench.envinfo.Environment``, and the
    UTC time the row was made)."""

    gpu: str = ""
    driver: str = ""
    torch: str = ""
    triton: str = ""
    # A row's further package versions (``environment_columns(*versions)``) stand here.
    git_sha: str = ""
    git_dirty: bool = False
    host: str = ""
    timestamp: str = ""


def environment_columns(*versions: str) -> list[Column]:
    """The environment columns: gpu, driver, torch, triton, then ``versions`` (more package
    versions the row records, such as transformers), git_sha, git_dirty, host, timestamp."""
    columns = group_columns(_Environment)
    at = [name for name, _, _ in columns].index("triton") + 1
    return columns[:at] + [column(name, "str", "") for name in versions] + columns[at:]


ENVIRONMENT_COLUMNS = tuple(name for name, _, _ in environment_columns())


def environment_values(env, **versions: str) -> dict[str, Any]:
    """The environment columns' values: ``env`` (a ``dmbench.envinfo.Environment``), the
    further ``versions`` and the time now."""
    values = {name: getattr(env, name) for name in ENVIRONMENT_COLUMNS if name != "timestamp"}
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {**values, **versions, "timestamp": stamp}
