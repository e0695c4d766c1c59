"""Checking the paths a command was given, before it does any work.

Each check raises ``ConfigError`` with one line naming the flag or argument, the path, and what
was expected there, so a typo costs an instant exit 2 rather than a traceback after a long run.
Output folders that do not exist yet are fine when they can be created: the nearest existing
ancestor must be a writable folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError


def _label(name: str, path: Path) -> str:
    return f"{name} {path}" if name else str(path)


def input_file(path: Path, name: str, expected: str) -> None:
    """``path`` is an existing, readable file. ``name`` is the flag or argument (may be empty)."""
    where = _label(name, path)
    if not path.exists():
        raise ConfigError(f"{where}: not found; expected {expected}")
    if path.is_dir():
        raise ConfigError(f"{where}: is a directory; expected {expected}")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{where}: not readable (permission denied); expected {expected}")


def writable_file(path: Path, name: str, expected: str) -> None:
    """``path`` is an existing file that can be rewritten in place."""
    input_file(path, name, expected)
    if not os.access(path, os.W_OK):
        raise ConfigError(f"{_label(name, path)}: not writable (permission denied); expected {expected}")


def output_dir(path: Path, name: str) -> None:
    """``path`` is a writable folder, or one that can be created."""
    where = _label(name, path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{where}: is a file; expected a folder (existing or to be created)")
    _creatable(path, where)


def _creatable(path: Path, where: str) -> None:
    """The folder ``path`` exists and is writable, or its nearest existing ancestor is."""
    ancestor = path
    while not ancestor.exists():
        if ancestor.parent == ancestor:
            break
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{where}: cannot create the folder, {ancestor} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        what = "write in" if ancestor == path else "create it in"
        raise ConfigError(f"{where}: cannot {what} {ancestor} (permission denied)")


def output_file(path: Path, name: str, expected: str = "a CSV file path") -> None:
    """``path`` can be written: not a folder, and its folder exists or can be created."""
    where = _label(name, path)
    if path.is_dir():
        raise ConfigError(f"{where}: is a directory; expected {expected}")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"{where}: not writable (permission denied); expected {expected}")
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise ConfigError(f"{where}: {parent} is a file, not a folder; expected {expected}")
    _creatable(parent, where)
