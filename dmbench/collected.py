"""Result rows gathered from sweep CSVs, grouped per (sweep, mode) and case, and the labels
the reports give them: the sweep (marked for rows timed as CUDA graph replays), the shape, the
case, and our ratio to the best peer.

Files that another command wrote (``compile-cost``, ``train``) are known by their columns and
left out.

Each (sweep, case, backend, mode, timing) has one row in all the files together: a second one,
in another file (two runs of a sweep) or in the same one, is refused naming both places, since
a table shows one time per cell. The same case in two sweeps (``seqlen`` and ``headdim`` share
one) and a sweep's eager and CUDA graph rows are different keys.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError
from .results import TIMED_MODES, Row, read_rows, row_line

# The backends we are compared against; sdpa-dense computes a different (dense) function, and
# triton-base, triton-select and triton-per-call run our own kernels, so none of them is a peer.
PEERS = ("sdpa", "flex", "fdma", "fa4")
# ... except in a case with no mask and no bias, where sdpa-dense makes the sdpa peer's own call
# and computes the same function: there it is a peer too, so that a slow spell of one of the
# two identical calls is not read as a lead (H200, decode's dense rows: sdpa 0.291 ms against
# sdpa-dense 0.257, both cuDNN, in one run).
DENSE_PEER = "sdpa-dense"


@dataclass(frozen=True)
class Collected:
    """The timed rows of a set of CSVs, grouped for the tables."""

    rows: list[Row]
    # (sweep, mode) -> case label -> backend -> median ms, cases in file order
    tables: dict[tuple[str, str], dict[str, dict[str, float]]]
    interpreted: bool  # CPU rows (Triton's interpreter): no targets
    # (sweep, mode) -> case label -> the backends whose row spread more than ``WIDE_SPREAD``
    # between its p20 and p80 times
    wide: dict[tuple[str, str], dict[str, set[str]]] = field(default_factory=dict)
    # The labels of cases with no mask and no bias (``DENSE_PEER`` is a peer there)
    dense_cases: frozenset[str] = frozenset()

    def best_peer(self, label: str, times: dict[str, float]) -> tuple[float, str] | None:
        """``ratio_to_best_peer`` of one case's times, its label telling whether
        ``DENSE_PEER`` is a peer there."""
        return ratio_to_best_peer(times, dense_case=label in self.dense_cases)

    @property
    def gpu(self) -> str:
        return self.rows[0].gpu


TIMING_SUFFIX = {"eager": "", "cuda_graph": " (CUDA graphs)"}


def timing_suffix(timing: str) -> str:
    """What follows a sweep's name or a target's line for rows of this ``timing``."""
    return TIMING_SUFFIX.get(timing, f" ({timing})")


def sweep_label(row: Row) -> str:
    """The sweep as the report names it: its name, marked when its rows were timed as CUDA
    graph replays, so that they are grouped apart from the same sweep's eager rows."""
    return row.sweep + timing_suffix(row.timing)


def is_interpreter_row(row: Row) -> bool:
    """Rows timed on the CPU: their gpu column says so (``cpu (triton interpreter)``)."""
    return row.gpu.lower().startswith("cpu")


# Columns that only one other command's CSV has: a file is that command's when its header holds
# them, so files written before or after a column was added (compile-cost's warmup_workers)
# are still recognized and left alone.
OTHER_COMMAND_COLUMNS = {"compile-cost": {"step", "first_ms", "compiled"},
                         "train": {"implementation", "tokens_per_s"}}


def other_command(path: Path) -> str | None:
    """The command that wrote ``path`` when it is not a sweep's (``compile-cost``, ``train``):
    a glob such as ``results/<gpu>/*.csv`` takes those files too, and the report leaves them."""
    try:
        with open(path, newline="") as handle:
            header = set(next(csv.reader(handle), ()))
    except OSError:
        return None  # read_rows names the problem
    if "case_id" in header:
        return None  # a sweep's
    return next((command for command, columns in OTHER_COMMAND_COLUMNS.items()
                 if columns <= header), None)


def sweep_csvs(csv_paths: list[Path]) -> list[Path]:
    return [path for path in csv_paths if other_command(path) is None]


def row_key(row: Row) -> tuple[str, str, str, str, str]:
    """What a report shows one time for: (sweep, case, backend, mode, timing)."""
    return (row.sweep, row.case_id, row.backend, row.mode, row.timing)


def _refuse_duplicates(numbered: list[tuple[Path, int, Row]]) -> None:
    """ConfigError at the first timed row whose ``row_key`` an earlier row has."""
    first: dict[tuple, tuple[Path, int]] = {}
    for path, line, row in numbered:
        if row.mode not in TIMED_MODES:
            continue
        key = row_key(row)
        if key in first:
            seen_path, seen_line = first[key]
            raise ConfigError(
                f"{path}: line {line}: sweep {row.sweep} case {row.case_id} backend "
                f"{row.backend} mode {row.mode} timing {row.timing} is also at {seen_path} line "
                f"{seen_line}; expected one row per (sweep, case, backend, mode, timing): report "
                "one run of each sweep")
        first[key] = (path, line)


def collect(csv_paths: list[Path]) -> Collected:
    """The ok timed rows of the sweep CSVs among ``csv_paths``; they must come from one
    device and hold each (sweep, case, backend, mode, timing) once."""
    numbered = [(path, row_line(i), row) for path in sweep_csvs(csv_paths)
                for i, row in enumerate(read_rows(path))]
    _refuse_duplicates(numbered)
    rows = [r for _, _, r in numbered
            if r.status == "ok" and r.ms_p50 is not None and r.mode != "equiv"]
    if not rows:
        raise ConfigError("no timed rows with status ok in " + ", ".join(map(str, csv_paths)))
    devices = sorted({r.gpu for r in rows})
    if len(devices) > 1:
        raise ConfigError(f"the CSVs come from {len(devices)} devices ({'; '.join(devices)}); "
                          "ratios are only comparable within one: report one device at a time")
    tables: dict[tuple[str, str], dict[str, dict[str, float]]] = defaultdict(dict)
    wide: dict[tuple[str, str], dict[str, set[str]]] = defaultdict(dict)
    for row in rows:
        table, label = (sweep_label(row), row.mode), case_label(row)
        tables[table].setdefault(label, {})[row.backend] = row.ms_p50
        if spreads_wide(row):
            wide[table].setdefault(label, set()).add(row.backend)
    dense = frozenset(case_label(r) for r in rows if r.mask == "none" and r.bias == "none")
    return Collected(rows, dict(tables), is_interpreter_row(rows[0]), dict(wide), dense)


# A row whose p80 time exceeds its p20 time by more than this factor: its median says less
# than the others' (an eager call whose host time exceeds its kernels' takes the host's
# jitter; a peer's compile or a neighbour's work in the middle of its repeats).
WIDE_SPREAD = 1.25


def spreads_wide(row) -> bool:
    """Whether ``row``'s p20-p80 times spread more than ``WIDE_SPREAD``."""
    return (row.ms_p20 is not None and row.ms_p80 is not None and row.ms_p20 > 0
            and row.ms_p80 > WIDE_SPREAD * row.ms_p20)


def shape_label(row) -> str:
    """Batch, heads (query/key-value), lengths and head dim, e.g. ``B2 H16/4 L4096 D128``."""
    lengths = (f"L{row.seqlen_q}" if row.seqlen_q == row.seqlen_k
               else f"Lq{row.seqlen_q} Lk{row.seqlen_k}")
    return f"B{row.batch} H{row.heads_q}/{row.heads_kv} {lengths} D{row.head_dim}"


def case_label(row) -> str:
    """The shape, then the mask (with its window, documents and format where set), the bias and
    whether it is causal."""
    window = f" W{row.window}" if row.window and row.mask != "none" else ""
    documents = f" [{row.documents}]" if row.documents else ""
    mask_format = f" as {row.mask_format}" if row.mask_format != "bool" else ""
    causal = " causal" if row.causal else ""
    return f"{shape_label(row)} {row.mask}{window}{documents}{mask_format} {row.bias}{causal}"


def ratio_to_best_peer(times: dict[str, float], dense_case: bool = False
                       ) -> tuple[float, str] | None:
    """The fastest peer's median time over ours, with that peer; None without our time or any
    peer's. ``dense_case``: the case has no mask and no bias (``DENSE_PEER`` is a peer)."""
    names = PEERS + (DENSE_PEER,) if dense_case else PEERS
    peers = {p: times[p] for p in names if p in times}
    if not peers or "triton" not in times:
        return None
    best = min(peers, key=peers.get)
    return peers[best] / times["triton"], best
