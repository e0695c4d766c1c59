"""Which results file a run writes, and whether it resumes it.

- An explicit ``--out`` that exists needs ``--resume`` (keep its rows, run the rest) or
  ``--force`` (start over); without either the run stops with exit 2 before doing anything.
- The default file (``results/<gpu>/<sweep>-<command>.csv``) never stops a run. When it exists,
  the run resumes it if every row in it came from the same sweep content (``sweep_hash``), the
  same device and torch/triton versions, and the same commit (sha and dirty flag); a finished
  file then has nothing left to run. Otherwise the run goes to the next numbered file beside it
  (``<sweep>-<command>.2.csv``, ``.3``, ...), resuming the first numbered file that matches.
  ``--resume`` and ``--force`` act on the default file itself, as on an explicit one.
- ``--resume`` continues a file, explicit or default, only when its rows pass the same test:
  the same sweep content, command (its modes), environment and commit; otherwise the run stops
  with exit 2 naming what differs (``check_resumable``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .results import Row, read_rows


@dataclass(frozen=True)
class Target:
    path: Path
    resume: bool  # keep the rows already in ``path`` and run only the missing points
    note: str | None = None  # one line saying which file was chosen and why


@dataclass(frozen=True)
class Provenance:
    """What must match for rows to be continued in the same file."""

    sweep: str  # the sweep's name
    sweep_hash: str
    command: str
    modes: tuple[str, ...]  # the modes of the rows ``command`` writes
    gpu: str
    torch: str
    triton: str
    git_sha: str
    git_dirty: bool

    @classmethod
    def of(cls, sweep: str, sweep_hash: str, command: str, modes: tuple[str, ...],
           env) -> "Provenance":
        return cls(sweep, sweep_hash, command, modes, env.gpu, env.torch, env.triton,
                   env.git_sha, env.git_dirty)

    def mismatch(self, rows: list[Row]) -> str | None:
        """Why ``rows`` did not come from this run's sweep, command, environment and commit, or
        None."""
        for row in rows:
            if row.mode not in self.modes:
                return f"{row.mode} rows, this run dmbench {self.command}"
            for name in ("sweep", "sweep_hash", "gpu", "torch", "triton", "git_sha", "git_dirty"):
                theirs, ours = getattr(row, name), getattr(self, name)
                if theirs != ours:
                    label = "sweep content" if name == "sweep_hash" else name
                    return f"{label} {theirs or 'unrecorded'}, this run {ours}"
        return None


def numbered(path: Path, number: int) -> Path:
    """``smoke-fwd.csv`` -> ``smoke-fwd.2.csv``; number 1 is the path itself."""
    return path if number == 1 else path.with_name(f"{path.stem}.{number}{path.suffix}")


def explicit(path: Path, resume: bool, force: bool) -> Target:
    if path.exists() and not (resume or force):
        raise ConfigError(f"--out {path}: results file exists; pass --resume to finish it or "
                          "--force to start over")
    return Target(path, resume and path.exists())


def check_resumable(rows: list[Row], provenance: Provenance, path: Path, name: str) -> None:
    """``--resume`` keeps the rows of ``path`` only when they come from this run's sweep,
    command, environment and commit: the test a default file passes to be resumed. ``name``
    is the flag that named the file (empty for the default file)."""
    reason = provenance.mismatch(rows)
    if reason is None:
        return
    where = f"{name} {path}" if name else str(path)
    raise ConfigError(f"{where}: --resume: it holds another run's rows ({reason}); resume it "
                      "with the same sweep, command and environment, or start over with --force "
                      "or another --out")


def _rows_or_reason(path: Path) -> tuple[list[Row] | None, str | None]:
    try:
        return read_rows(path, tolerate_partial_last_line=True), None
    except ConfigError as exc:
        return None, str(exc).removeprefix(f"{path}: ")


def default(path: Path, resume: bool, force: bool, provenance: Provenance) -> Target:
    if not path.exists() or resume or force:
        return Target(path, resume and path.exists())
    first_reason = None
    number = 1
    while numbered(path, number).exists():
        candidate = numbered(path, number)
        rows, reason = _rows_or_reason(candidate)
        reason = reason or provenance.mismatch(rows)
        if reason is None:
            return Target(candidate, True, f"results: resuming {candidate} (its rows come from "
                                           "the same sweep, environment and commit)")
        first_reason = first_reason or reason
        number += 1
    fresh = numbered(path, number)
    return Target(fresh, False, f"results: writing {fresh}; {path} holds another run's rows "
                                f"({first_reason})")
