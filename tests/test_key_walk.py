"""One definition of the key blocks a tile of query rows needs without a mask
(``kernels.planning.key_walk.tile_key_blocks``), held against what the activity lists hold for
a mask that keeps every pair, against the Triton forward's split (``spans.causal_block_split``)
and against the host's mean of the Hopper forward's walk (``hopper_forward.mean_key_blocks``).
The Hopper kernel's own walk (``hopper_device.tiles.WorkTiles.key_blocks``) runs on a GPU only;
``tests/test_hopper_route.py`` checks its outputs there on the same awkward lengths."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from attn_helpers import Dims, random_qkv
from kernels.planning import tuning
from kernels.planning.activity import lists_from_activity, tile_activity
from kernels.planning.hopper_forward import list_tile, mean_key_blocks
from kernels.planning.inputs import check_inputs
from kernels.planning.key_walk import tile_key_blocks
from kernels.planning.problem import Problem
from kernels.runtime.arith import ceil_div
from kernels.triton_device.spans import causal_block_split

LENGTHS = [(1, 1), (17, 97), (97, 17), (128, 128), (129, 300), (300, 129), (256, 640),
           (400, 256)]


def _lists_of_a_mask_that_keeps_every_pair(seqlen_q, seqlen_k, causal, rows, block_n, device):
    dims = Dims(1, seqlen_q, seqlen_k, 1, 1, 16)
    q, k, v = random_qkv(dims, torch.float32, device)
    mask = torch.ones(1, 1, seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    checked = check_inputs(q, k, v, mask, None, None)
    activity = tile_activity(checked.mask, checked.shape, 32, 32, causal)
    return lists_from_activity(activity, rows, block_n, False).counts[0, 0].tolist()


@pytest.mark.interpreter
@pytest.mark.parametrize("seqlen_q, seqlen_k", LENGTHS, ids=lambda n: str(n))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_walk_is_what_the_lists_of_a_mask_keeping_every_pair_hold(device, seqlen_q,
                                                                       seqlen_k, causal):
    rows, block_n = list_tile()
    counts = _lists_of_a_mask_that_keeps_every_pair(seqlen_q, seqlen_k, causal, rows, block_n,
                                                    device)
    for index, (count, full) in enumerate(counts):
        first = index * rows
        active, whole = tile_key_blocks(first, rows, seqlen_q, seqlen_k, block_n, causal)
        assert count == active
        if first + rows <= seqlen_q:
            assert full == whole
        else:  # the lists count a tile past Lq as partial; the walk ignores rows never written
            assert full <= whole


@triton.jit
def _split_kernel(out_ptr, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  IS_CAUSAL: tl.constexpr):
    row_block = tl.program_id(0)
    full, total = causal_block_split(row_block * BLOCK_M, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k,
                                     IS_CAUSAL)
    tl.store(out_ptr + 2 * row_block, full)
    tl.store(out_ptr + 2 * row_block + 1, total)


@pytest.mark.interpreter
@pytest.mark.parametrize("seqlen_q, seqlen_k", LENGTHS, ids=lambda n: str(n))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("block_m, block_n", [(64, 64), (128, 64), (16, 32)])
def test_the_triton_split_walks_the_active_blocks_and_tests_from_the_full_ones(
        device, seqlen_q, seqlen_k, causal, block_m, block_n):
    row_blocks = ceil_div(seqlen_q, block_m)
    out = torch.full((row_blocks, 2), -1, dtype=torch.int32, device=device)
    _split_kernel[(row_blocks,)](out, seqlen_q, seqlen_k, BLOCK_M=block_m, BLOCK_N=block_n,
                                 IS_CAUSAL=causal)
    for row_block, (full, total) in enumerate(out.tolist()):
        active, whole = tile_key_blocks(row_block * block_m, block_m, seqlen_q, seqlen_k,
                                        block_n, causal)
        assert total == active
        # Without causality the Triton loop bounds the last block by its loads instead.
        assert full == (active if not causal else min(whole, active))


@pytest.mark.parametrize("seqlen_q, seqlen_k", LENGTHS + [(4096, 512), (512, 4096)],
                         ids=lambda n: str(n))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_hopper_estimate_averages_the_walk_with_one_block_for_an_empty_tile(
        seqlen_q, seqlen_k, causal):
    from kernels.planning.inputs import AttnShape

    shape = AttnShape(batch=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=1, heads_kv=1,
                      head_dim=128)
    problem = Problem(shape, torch.bfloat16, torch.device("cuda"), interpreted=False,
                      multiprocessors=132, is_causal=causal, softmax_scale=1.0)
    rows, block_n = list_tile()
    walks = [max(tile_key_blocks(first, rows, seqlen_q, seqlen_k, block_n, causal)[0], 1)
             for first in range(0, seqlen_q, rows)]
    assert mean_key_blocks(problem) == pytest.approx(sum(walks) / len(walks))
    assert rows == 2 * tuning.HOPPER_FORWARD.rows
