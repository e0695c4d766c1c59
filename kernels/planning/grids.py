"""The grid rules the forward's and the backward's launches both follow: into how many key
shares a grid that underfills the GPU splits (``key_splits``), how many grid rows one chunk of
a ``spans.grid_position`` grid holds (``grid_chunk_rows``), and how many list entries a kernel
reads from each end of a list to find a causal loop's interior (``edge_slots``).
``forward_schedule`` and ``backward_schedule`` decide with them; ``backward`` sets its launches'
arguments with them."""

from __future__ import annotations

from ..runtime.arith import ceil_div, next_power_of_2
from . import tuning


def key_splits(programs: int, key_blocks: int, multiprocessors: int, min_blocks: int) -> int:
    """Key shares for a grid of ``programs`` (1: none): only where it fills less than half the
    GPU, as many as keep ``programs`` x shares within ``SPLIT_PROGRAMS_PER_SM`` programs per
    multiprocessor (one wave of resident programs, no partial second one), at least
    ``min_blocks`` key blocks a share."""
    if 2 * programs > multiprocessors:
        return 1
    return max(1, min(tuning.SPLIT_PROGRAMS_PER_SM * multiprocessors // programs,
                      key_blocks // min_blocks, tuning.MAX_KEY_SPLITS))


def grid_chunk_rows(rows: int, blocks: int, group: int, uneven: bool,
                    multiprocessors: int) -> int:
    """Rows per chunk of a ``spans.grid_position`` grid: ``rows`` rows of ``blocks`` programs
    each, consecutive runs of ``group`` rows sharing K and V (a GQA group).

    With even work per program, one row per chunk: the programs running together then belong
    to one or two heads and share their K and V in L2. With uneven work (causal), a chunk
    starts its longest programs first and ends on its shortest, which keeps the grid's last
    wave short, but only if the chunk holds enough programs to fill the GPU several times
    over; more rows than that only spread the programs running together over more heads.
    """
    if not uneven:
        return 1
    # The fewest whole groups that divide the rows into equal chunks and fill the GPU: a
    # narrower last chunk would end the grid on its own longest programs.
    for size in range(group, rows, group):
        if rows % size == 0 and size * blocks >= tuning.CHUNK_PROGRAMS_PER_SM * multiprocessors:
            return size
    return rows


def edge_slots(loop_rows: int, step_rows: int) -> int:
    """List entries read from each end by ``spans.interior_span``: a loop over
    ``step_rows``-sized blocks crosses the causal diagonal of a ``loop_rows``-sized block in at
    most ceil(loop_rows / step_rows) + 1 blocks; a partial last block is one of those or one
    more."""
    return next_power_of_2(ceil_div(loop_rows, step_rows) + 2)
