"""Spreading one sweep over processes: ``--shard i/n`` and ``--distributed`` under torchrun.

Both use the same deterministic, cost-balanced assignment: cases sorted by estimated cost
(largest first, ties by case id) go one by one to the least-loaded share, lowest index on ties.
This is greedy longest-processing-time scheduling; the cost is the FLOP model's estimate, so
one 32k-token case is not counted the same as one 256-token case.

Under torchrun each rank writes its rows to its own part file as they finish (a killed rank
loses nothing it finished), then rank 0 gathers every rank's rows with
``torch.distributed.gather_object`` and writes one CSV in plan order, the same file a single
process would have written. The process group uses gloo: it only moves Python objects, so it
works the same for GPUs, CPUs and several hosts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from . import flops
from .case import Case
from .errors import ConfigError

# Ranks finish their shares at different times and then wait in the gather; a sweep can run for
# hours, so the collective timeout must outlast the longest share rather than gloo's default.
GATHER_TIMEOUT = timedelta(hours=24)


@dataclass(frozen=True)
class Share:
    index: int
    count: int

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Share:
    parts = text.split("/")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"--shard: expected I/N with 0 <= I < N (e.g. 0/4), got {text!r}")
    index, count = int(parts[0]), int(parts[1])
    if count < 1 or index >= count:
        raise ConfigError(f"--shard: expected I/N with 0 <= I < N (e.g. 0/4), got {text!r}")
    return Share(index, count)


def assign(cases: tuple[Case, ...], count: int, modes: tuple[str, ...],
           n_backends: int) -> list[list[Case]]:
    """Split ``cases`` into ``count`` shares of similar estimated cost, deterministically.

    Each share keeps the sweep's own case order, so every process runs its cases in the same
    order a single process would.
    """
    cost = {c: flops.estimated_cost(c, modes, n_backends) for c in cases}
    order = sorted(cases, key=lambda c: (-cost[c], c.case_id))
    loads = [0.0] * count
    owner = {}
    for case in order:
        target = min(range(count), key=lambda r: (loads[r], r))
        loads[target] += cost[case]
        owner[case] = target
    return [[c for c in cases if owner[c] == r] for r in range(count)]


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int


def torchrun_rank() -> RankInfo:
    """The rank as torchrun describes it in the environment; a clear error outside torchrun."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    missing = [n for n in names if n not in os.environ]
    if missing:
        raise ConfigError(f"--distributed: {missing[0]} is not set; launch with "
                          "`torchrun --nproc-per-node N -m dmbench ...` (or use --shard I/N)")
    return RankInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                    int(os.environ["LOCAL_RANK"]))


def init_group(info: RankInfo) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=info.rank, world_size=info.world_size,
                                timeout=GATHER_TIMEOUT)


def gather_to_rank0(payload, info: RankInfo):
    """Every rank's ``payload`` as a list on rank 0 (None elsewhere)."""
    import torch.distributed as dist

    gathered = [None] * info.world_size if info.rank == 0 else None
    dist.gather_object(payload, gathered, dst=0)
    return gathered


def finish_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def part_path(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.stem}.rank{rank}.part.csv")
