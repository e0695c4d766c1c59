"""The host side of the wavelet matrix behind ``topk_intervals``' causal selection: when the
kernels run, their tiles and launches. The kernels and how they work are in
``triton_device.wavelet_kernels``.
"""

from __future__ import annotations

import torch

from ..runtime.arith import ceil_div, next_power_of_2
from ..runtime.launch import interpreter_problem, is_interpreted, launch
from ..triton_device.wavelet_kernels import (_answer_kernel, _first_level_kernel, _intervals_kernel,
                                             _level_kernel)


BLOCK = 1024  # positions per program of the level passes; a multiple of 32
RECORDS = 4  # (block, count) records per block and level
CHUNK = 1024  # records summed per step by a level program
QUERIES = 512  # queries per program of the query kernels (interpreter: INTERPRETED_QUERIES)
INTERPRETED_QUERIES = 2048
INTERPRETED_ROWS = 16  # most rows per program under the interpreter
MAX_LENGTH = 2**31 - 2 * BLOCK  # longer rows take the torch version


def runs_kernels(device: torch.device, n: int) -> bool:
    """Whether rows of ``n`` values on ``device`` take these kernels: on CUDA, and on the CPU
    under Triton's interpreter (as every kernel of this package does) where that interpreter
    can run them (``launch.interpreter_problem``)."""
    if n > MAX_LENGTH:
        return False
    if device.type == "cuda":
        return True
    return is_interpreted(_level_kernel) and interpreter_problem() is None


def _tiles(rows: int) -> tuple[int, int]:
    """(ROWS, QUERIES) of the launches."""
    if is_interpreted(_level_kernel):
        return min(next_power_of_2(rows), INTERPRETED_ROWS), INTERPRETED_QUERIES
    return 1, QUERIES


class _Levels:
    """The rank tables and zero counts of every level of the rows ``values`` ((rows, n) int64,
    a permutation of [0, n) per row) and, when asked, the inverse permutation (int32)."""

    def __init__(self, values: torch.Tensor, inverse: bool, tile_rows: int):
        rows, n = values.shape
        device = values.device
        self.n = n
        self.bits = max(1, (n - 1).bit_length())
        self.words = (n >> 5) + 1  # words of positions [0, n]
        nblocks = n // BLOCK + 1  # blocks of positions [0, n]
        values = values.contiguous()
        current = torch.empty(rows, n, dtype=torch.int32, device=device)
        spare = torch.empty_like(current)
        records = torch.empty(rows, nblocks, RECORDS, dtype=torch.int64, device=device)
        next_records = torch.empty_like(records)
        self.table = torch.empty(self.bits, rows, self.words, dtype=torch.int64, device=device)
        self.totals = torch.empty(self.bits, rows, dtype=torch.int32, device=device)
        self.rank = torch.empty_like(current) if inverse else current
        grid = (nblocks, ceil_div(rows, tile_rows))
        launch(_first_level_kernel, grid, values, current, records, self.rank, rows, n, nblocks,
               self.bits - 1, BLOCK=BLOCK, ROWS=tile_rows, WRITE_RANK=inverse)
        for level in range(self.bits):
            launch(_level_kernel, grid, current, spare, records, next_records, self.table,
                   self.totals, rows, n, nblocks, self.words, level, self.bits - 1 - level,
                   BLOCK=BLOCK, CHUNK=CHUNK, ROWS=tile_rows)
            current, spare = spare, current
            records, next_records = next_records, records


def kth_smallest(values: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 k: torch.Tensor) -> torch.Tensor:
    """``topk._kth_smallest`` (same arguments, same bits) by these kernels."""
    rows, m = lo.shape
    answer = torch.empty(rows, m, dtype=torch.int64, device=values.device)
    if not (rows and m):
        return answer
    tile_rows, queries = _tiles(rows)
    levels = _Levels(values, False, tile_rows)
    launch(_answer_kernel, (ceil_div(m, queries), ceil_div(rows, tile_rows)), levels.table,
           levels.totals, lo.contiguous(), hi.contiguous(), k.contiguous(), answer, rows, m,
           levels.words, levels.bits, QUERIES=queries, ROWS=tile_rows)
    return answer


def causal_intervals(order: torch.Tensor, window: int, seqlen_q: int | None,
                     keys=None) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 (start, end), (rows, n), of ``topk._intervals`` with causality, from
    the rows' rank order ((rows, n) int64, positions sorted by rank). ``keys``: the
    ``PackedKeys`` of packed sequences, or None for one sequence of n keys and ``seqlen_q``
    queries."""
    rows, n = order.shape
    tile_rows, queries = _tiles(rows)
    levels = _Levels(order, True, tile_rows)
    start = torch.empty(rows, n, dtype=torch.int32, device=order.device)
    end = torch.empty_like(start)
    # No key has n keys that beat it: a window above n keeps every key on every row, as
    # n + 1 does, and the clamp keeps it an int32.
    window = min(window, n + 1)
    if keys is None:
        local = key_start = seqlen_k = seqlen_q_of = start  # not read
    else:
        local, key_start = keys.local, keys.key_start
        seqlen_k, seqlen_q_of = keys.seqlen_k, keys.seqlen_q
        seqlen_q = 1  # not read
    launch(_intervals_kernel, (ceil_div(n, queries), ceil_div(rows, tile_rows)), levels.table,
           levels.totals, levels.rank, local, key_start, seqlen_k, seqlen_q_of, start, end,
           rows, n, levels.words, levels.bits, window, seqlen_q, QUERIES=queries,
           ROWS=tile_rows, PACKED=keys is not None)
    return start, end
