"""The rows ``dmbench train`` writes: the CSV columns, writing, reading and resuming a file, and
the plots drawn from one (tokens/s, tokens/s over eager attention, peak memory per context)."""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .columns import environment_columns, row_dataclass
from .errors import ConfigError
from .results import csv_cell, parse_cell


@dataclass
class _TrainMeasurement:
    """What one (context, implementation, mode) point of ``dmbench train`` measured."""

    model: str
    params: int | None
    context: int
    batch: int
    keep_window: int
    dtype: str
    implementation: str
    mode: str
    status: str
    detail: str = ""
    warmup: int = 0
    steps: int = 0
    ms_p20: float | None = None
    ms_p50: float | None = None
    ms_p80: float | None = None
    tokens_per_s: float | None = None
    peak_mib: float | None = None
    start_mib: float | None = None
    first_loss: float | None = None
    last_loss: float | None = None


class TrainRow(row_dataclass("_TrainRowColumns", __name__, _TrainMeasurement,
                             environment_columns("transformers"))):
    """One train CSV line: the measurement, then the environment with the transformers
    version. Its fields (``TRAIN_COLUMNS``) are the columns in order."""


TRAIN_COLUMNS = tuple(f.name for f in fields(TrainRow))


# What rows of one file must share: the measured model and sizes, the environment, the commit.
PROVENANCE = ("model", "batch", "keep_window", "dtype", "warmup", "steps", "gpu", "driver",
              "torch", "triton", "transformers", "git_sha", "git_dirty")


def resumable_rows(path: Path, provenance: TrainRow) -> list[TrainRow]:
    """The rows of ``path`` to keep, after checking they came from a run like this one."""
    rows = read_train_rows(path, tolerate_partial_last_line=True)
    for row in rows:
        for name in PROVENANCE:
            theirs, ours = getattr(row, name), getattr(provenance, name)
            if theirs != ours:
                raise ConfigError(f"--resume: {path} holds rows with {name} {theirs!r}, this "
                                  f"run has {ours!r}; pass --force to start over or another "
                                  f"--out")
    return rows


def describe(row: TrainRow) -> str:
    head = f"context {row.context:>6} {row.implementation:>6} {row.mode:>8}: {row.status}"
    if row.status != "ok":
        return f"{head} ({row.detail})"
    peak = "" if row.peak_mib is None else f", peak {row.peak_mib:.0f} MiB"
    return f"{head}, {row.tokens_per_s:.0f} tokens/s, {row.ms_p50:.1f} ms/step{peak}"


# -- files ------------------------------------------------------------------------------------

class TrainWriter:
    """Writes the header and the ``kept`` rows, then one flushed line per row: a killed run
    keeps its finished rows."""

    def __init__(self, path: Path, kept: list[TrainRow] = ()):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "w", newline="")
        self._writer = csv.writer(self._file)
        self._writer.writerow(TRAIN_COLUMNS)
        for row in kept:
            self.write(row)
        self._file.flush()

    def write(self, row: TrainRow) -> None:
        values = asdict(row)
        self._writer.writerow([csv_cell(values[c]) for c in TRAIN_COLUMNS])
        self._file.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


_TYPES = {f.name: f.type for f in fields(TrainRow)}


def read_train_rows(path: Path, tolerate_partial_last_line: bool = False) -> list[TrainRow]:
    """The rows of a train CSV, after checking its header. ``tolerate_partial_last_line``:
    drop a last line with too few fields (a run killed while writing it)."""
    try:
        with open(path, newline="") as f:
            lines = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(f"{path}: cannot read as CSV: {exc}") from None
    if not lines or tuple(lines[0]) != TRAIN_COLUMNS:
        raise ConfigError(f"{path}: not a dmbench train CSV of this version")
    if tolerate_partial_last_line and len(lines) > 1 and len(lines[-1]) < len(TRAIN_COLUMNS):
        lines.pop()
    rows = []
    for number, values in enumerate(lines[1:], start=2):
        where = f"{path}: line {number}"
        if len(values) != len(TRAIN_COLUMNS):
            raise ConfigError(f"{where}: expected {len(TRAIN_COLUMNS)} fields, got {len(values)}")
        rows.append(TrainRow(**{c: parse_cell(_TYPES[c], c, v, where, integer=int)
                                for c, v in zip(TRAIN_COLUMNS, values)}))
    return rows


def _speedups(done: list[TrainRow]) -> dict[tuple[int, str, str], float]:
    """Tokens/s over transformers' eager attention at the same context and mode."""
    eager = {(r.context, r.mode): r.tokens_per_s for r in done if r.implementation == "eager"}
    return {(r.context, r.implementation, r.mode): r.tokens_per_s / eager[r.context, r.mode]
            for r in done if (r.context, r.mode) in eager and r.implementation != "eager"}


def _context_label(context: int) -> str:
    return f"{context // 1024}k" if context >= 1024 and context % 1024 == 0 else str(context)


def train_title(stem: str, first: TrainRow) -> str:
    """A train chart's title: the run (the CSV's stem), what a step times (fwd+bwd and the
    optimizer step), the model, batch, dtype and GPU."""
    return (f"{stem}: {first.model} training steps (fwd+bwd+AdamW), batch {first.batch}, "
            f"{first.dtype}, on {first.gpu}")


def plot_train(csv_path: Path) -> list[Path]:
    """Tokens/s, speedup over eager attention and peak memory against context, one line per
    implementation and mode, as PNGs next to the CSV; drawn from the CSV alone."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    done = [r for r in read_train_rows(csv_path) if r.status == "ok"]
    if not done:
        raise ConfigError(f"{csv_path}: no rows with status ok to plot")
    values = {"throughput": {(r.context, r.implementation, r.mode): r.tokens_per_s for r in done},
              "speedup": _speedups(done),
              "memory": {(r.context, r.implementation, r.mode): r.peak_mib for r in done
                         if r.peak_mib is not None}}
    labels = {"throughput": "tokens/s", "speedup": "tokens/s over eager attention (same mode)",
              "memory": "peak memory (MiB)"}
    first = done[0]
    written = []
    for tag, points in values.items():
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for implementation, mode in sorted({key[1:] for key in points}):
            line = sorted((c, y) for (c, i, m), y in points.items()
                          if (i, m) == (implementation, mode))
            ax.plot([c for c, _ in line], [y for _, y in line], marker="o",
                    label=f"{implementation} ({mode})")
        contexts = sorted({key[0] for key in points})
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [_context_label(c) for c in contexts])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(labels[tag])
        if tag != "speedup":  # tokens/s and memory span orders of magnitude over the contexts
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title(train_title(csv_path.stem, first), fontsize=8)
        fig.tight_layout()
        path = csv_path.parent / f"{csv_path.stem}-{tag}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
