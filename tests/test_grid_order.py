"""The order in which the attention kernels' 1-D grids visit (block, row) pairs
(``spans.grid_position``), the chunk size the host picks for it (``grid_chunk_rows``), and the
key shares of a grid that underfills the GPU (``key_splits``).
Every kernel test runs through ``grid_position`` too; these tests pin the mapping itself,
including chunk sizes that the kernel tests' shapes never pick (a narrower last chunk)."""

from __future__ import annotations

import itertools

import pytest
import torch
import triton
import triton.language as tl

from kernels.planning.grids import grid_chunk_rows, key_splits
from kernels.triton_device.spans import grid_position


@triton.jit
def _positions_kernel(out_ptr, blocks, chunk_rows, LAST_FIRST: tl.constexpr):
    pid = tl.program_id(0)
    block, row = grid_position(pid, blocks, chunk_rows, LAST_FIRST)
    tl.store(out_ptr + 2 * pid, block)
    tl.store(out_ptr + 2 * pid + 1, row)


def _positions(blocks: int, rows: int, chunk_rows: int, last_first: bool,
               device: torch.device) -> list[tuple[int, int]]:
    out = torch.full((blocks * rows, 2), -1, dtype=torch.int32, device=device)  # poisoned
    _positions_kernel[(blocks * rows,)](out, blocks, chunk_rows, LAST_FIRST=last_first)
    return [tuple(p) for p in out.tolist()]


@pytest.mark.parametrize("blocks, rows, chunk_rows", [
    (1, 1, 1), (5, 3, 1), (5, 3, 3), (4, 7, 3), (3, 8, 4), (6, 5, 2), (2, 9, 9),
])
@pytest.mark.parametrize("last_first", [False, True])
def test_grid_position_visits_every_pair_once_in_chunk_order(blocks, rows, chunk_rows,
                                                             last_first, device):
    got = _positions(blocks, rows, chunk_rows, last_first, device)
    # What the order should be: chunks of chunk_rows rows (the last may be narrower); in a
    # chunk, blocks in order (last first if asked), all the chunk's rows for each block.
    want = []
    for first in range(0, rows, chunk_rows):
        chunk = range(first, min(first + chunk_rows, rows))
        order = range(blocks - 1, -1, -1) if last_first else range(blocks)
        want += [(block, row) for block in order for row in chunk]
    assert got == want
    assert sorted(got) == sorted(itertools.product(range(blocks), range(rows)))


def test_grid_chunk_rows_keeps_rows_in_order_without_uneven_work():
    assert grid_chunk_rows(32, 64, 4, False, 132) == 1


@pytest.mark.parametrize("rows, blocks, group", [
    (32, 64, 4), (32, 128, 4), (32, 256, 4), (16, 256, 4), (4, 256, 1), (2, 512, 2),
    (48, 64, 4), (44, 64, 4), (64, 16, 8), (1, 1, 1), (8, 4096, 1), (6, 4096, 2),
])
def test_grid_chunk_rows_fills_the_gpu_in_whole_groups(rows, blocks, group):
    from kernels.planning import tuning

    sms = 132
    size = grid_chunk_rows(rows, blocks, group, True, sms)
    assert 1 <= size <= rows
    assert size == rows or size % group == 0  # a GQA group's heads stay in one chunk
    # Enough programs per chunk to fill the GPU several times, unless the grid is smaller.
    assert size == rows or size * blocks >= tuning.CHUNK_PROGRAMS_PER_SM * sms
    assert rows % size == 0  # chunks of equal size: no narrow last chunk
    # ... and the smallest such: no fewer whole groups divide the rows and fill the GPU.
    assert not [s for s in range(group, size, group)
                if rows % s == 0 and s * blocks >= tuning.CHUNK_PROGRAMS_PER_SM * sms]


@pytest.mark.parametrize("programs", [1, 8, 16, 17, 33, 64, 65, 66, 67, 100, 128, 132])
@pytest.mark.parametrize("key_blocks", [1, 7, 64, 512, 4096])
def test_key_splits_fill_one_wave_and_no_more(programs, key_blocks):
    """Shares keep the grid within one wave of ``SPLIT_PROGRAMS_PER_SM`` programs per
    multiprocessor (a partial second wave cost 4-6% on decode, H200), take the most that fit,
    keep ``min_blocks`` key blocks a share, and split nothing that fills half the GPU."""
    from kernels.planning import tuning

    sms, least = 132, 4
    wave = tuning.SPLIT_PROGRAMS_PER_SM * sms
    shares = key_splits(programs, key_blocks, sms, least)
    if 2 * programs > sms:
        assert shares == 1
        return
    assert 1 <= shares <= tuning.MAX_KEY_SPLITS
    assert shares == 1 or programs * shares <= wave
    assert shares == 1 or key_blocks // shares >= least
    more = shares + 1  # one share more would overfill the wave or the blocks' minimum
    assert (programs * more > wave or key_blocks // more < least
            or more > tuning.MAX_KEY_SPLITS)
