"""dkdv's wide tile: 64 query rows x 128 keys with 8 warps on the GPU (16 x 64 under the
interpreter), taken by grids of enough key programs at 64 < head dim <= 128 in 16-bit.

Test shapes are too small to take it by the shape rule, so each gradient case forces it with
``kernel_options={"dkdv_wide_tile": True}`` and checks every gradient against float64 autograd
of the reference: masks with partial and empty tiles, the causal edge, GQA with and without
head shares, the fused launch, each way the bias gradient is made, and determinism. The rule
itself is checked on Problems of an H100-sized GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from attn_helpers import (Dims, assert_deterministic_grads, backward_schedule, forcing,
                          random_problem, run_backward)
from kernels import dmattn_func, prepare_mask
from kernels.planning import tuning
from kernels.planning.inputs import AttnShape
from kernels.planning.activity import ActivityMap, shared_granularity
from kernels.planning.backward_schedule import (backward_tiles, compared_dkdv_tiles,
                                                dkdv_takes_wide_tile)
from kernels.planning.problem import Problem
from kernels.planning.schedule import activity_tiles, schedule

WIDE = {"dkdv_wide_tile": True}

# (dims, mask axes or None, bias axes or None, causal, more options)
CASES = [
    # Lengths that leave a partial key block and a partial query step, the causal edge, a
    # per-(batch, kv head) mask with empty tiles and a one-row bias (dkdv sums its rows).
    pytest.param(Dims(1, 37, 150, heads_q=4, heads_kv=2, head_dim=80), "BxHkxLqxLk",
                 "1xHkx1xLk", True, {}, id="D80-kv_row-causal"),
    # Lq above Lk (bottom-right causal puts the first rows before every key), MQA, no bias.
    pytest.param(Dims(2, 90, 70, heads_q=3, heads_kv=1, head_dim=128), "1x1xLqxLk", None, True,
                 {}, id="D128-mqa-causal"),
    # A full bias per query head: its gradient is written by dq; no mask, not causal.
    pytest.param(Dims(1, 40, 130, heads_q=2, heads_kv=2, head_dim=96), None, "BxHqxLqxLk",
                 False, {}, id="D96-q_full"),
    # The group's heads in two shares, each writing partials the last one sums.
    pytest.param(Dims(1, 33, 140, heads_q=4, heads_kv=2, head_dim=80), "BxHkxLqxLk",
                 "1xHkx1xLk", True, {"dkdv_head_shares": 2}, id="D80-head-shares"),
    # One launch for dq and dkdv programs.
    pytest.param(Dims(1, 25, 100, heads_q=4, heads_kv=2, head_dim=128), "BxHkxLqxLk",
                 "1xHkxLqxLk", True, {"backward": "fused"}, id="D128-fused-kv_full"),
]


@pytest.mark.parametrize("dims,mask_axes,bias_axes,causal,more", CASES)
def test_wide_tile_gives_the_reference_gradients(dims, mask_axes, bias_axes, causal, more,
                                                 device):
    options = {**WIDE, **more}
    q, k, v, mask, bias = random_problem(dims, torch.bfloat16, device,
                                         mask=mask_axes or "1x1x1x1",
                                         bias=bias_axes or "1x1x1x1", keep=0.6)
    mask = mask if mask_axes else None
    bias = bias if bias_axes else None
    run_backward(q, k, v, mask, bias, causal, func=forcing(**options))
    dkdv = backward_schedule(q, k, v, mask, bias, causal, kernel_options=options).general.dkdv
    wide = tuning.DKDV_INTERPRETED_WIDE if device.type == "cpu" else tuning.DKDV_D128_WIDE
    assert (dkdv.block_m, dkdv.block_n) == (wide.block_m, wide.block_n)


def test_wide_tile_with_a_prepared_mask_is_deterministic(device):
    """A prepared mask's lists were built for its default tiles; the forced wide tile takes
    its own from the same map, and two deterministic runs give identical bits."""
    dims = Dims(1, 41, 133, heads_q=4, heads_kv=2, head_dim=80)
    q, k, v, mask, bias = random_problem(dims, torch.float16, device, mask="BxHkxLqxLk",
                                         bias="1xHkx1xLk", keep=0.5)
    prepared = prepare_mask(mask, q, k, True)

    def with_prepared(q, k, v, mask, bias, causal, scale=None, **kwargs):
        assert mask is prepared.mask
        return dmattn_func(q, k, v, prepared, bias, causal, scale, kernel_options=WIDE,
                           **kwargs)

    run_backward(q, k, v, mask, bias, True, func=with_prepared)
    assert_deterministic_grads(q, k, v, mask, bias, True, func=with_prepared)


@pytest.mark.parametrize("dtype,head_dim,seqlen_q", [
    pytest.param(torch.float32, 128, 64, id="fp32"),
    pytest.param(torch.bfloat16, 64, 64, id="D64"),
    pytest.param(torch.bfloat16, 192, 64, id="D192"),
    pytest.param(torch.bfloat16, 128, tuning.DKDV_DECODE_ROWS, id="decode-rows"),
])
def test_forcing_the_wide_tile_where_it_cannot_apply_names_the_option(dtype, head_dim,
                                                                     seqlen_q):
    problem = _problem(1, 4, 2, seqlen_q, 256, head_dim, dtype)
    with pytest.raises(ValueError, match=r"kernel_options\['dkdv_wide_tile'\]: True needs"):
        backward_tiles(problem, {"dkdv_wide_tile": True})


def test_the_option_takes_a_bool(device):
    dims = Dims(1, 20, 30, heads_q=2, heads_kv=2, head_dim=80)
    q, k, v, _, _ = random_problem(dims, torch.bfloat16, device, mask="1x1x1x1",
                                   bias="1x1x1x1")
    with pytest.raises(ValueError, match=r"kernel_options\['dkdv_wide_tile'\]: expected"):
        backward_schedule(q, k, v, kernel_options={"dkdv_wide_tile": 1})


def _problem(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, dtype=torch.bfloat16,
             multiprocessors=132):
    shape = AttnShape(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen_q,
                      seqlen_k=seqlen_k, head_dim=head_dim)
    return Problem(shape, dtype, torch.device("cuda"), interpreted=False,
                   multiprocessors=multiprocessors, is_causal=True, softmax_scale=0.1)


@pytest.mark.parametrize("sizes,wide", [
    ((2, 16, 4, 8192, 8192, 128), True),    # 512 programs of 128 keys
    ((1, 16, 4, 4096, 4096, 80), True),     # 128: padded head dims too
    ((1, 16, 4, 2048, 2048, 128), True),    # 64, on 132 multiprocessors
    ((1, 8, 2, 2048, 2048, 128), False),    # 32
    ((1, 16, 4, 64, 8192, 128), True),      # DKDV_WIDE_MIN_ROWS query rows
    ((1, 16, 4, 32, 8192, 128), False),     # fewer
    ((2, 16, 4, 8192, 8192, 64), False),    # D64 has its own tiles
    ((2, 16, 4, 8192, 8192, 256), False),
])
def test_the_shape_rule(sizes, wide):
    problem = _problem(*sizes)
    dkdv, _ = backward_tiles(problem)
    assert (dkdv == tuning.DKDV_D128_WIDE) == wide
    assert backward_tiles(problem, {"dkdv_wide_tile": False})[0] != tuning.DKDV_D128_WIDE


@pytest.mark.parametrize("sizes", [(2, 16, 4, 8192, 8192, 128), (1, 8, 2, 2048, 2048, 96)],
                         ids=("wide", "narrow"))
def test_one_activity_map_serves_dkdv_either_way(sizes):
    """A prepared mask's map is built before a call's options are known: its tiles must make
    up dkdv's tile whether the call forces the wide tile or not."""
    problem = _problem(*sizes)
    rows, cols = shared_granularity(activity_tiles(problem, schedule(problem).forward))
    for wide in (False, True):
        dkdv, dq = backward_tiles(problem, {"dkdv_wide_tile": wide})
        for tile_rows, tile_cols in ((dkdv.block_m, dkdv.block_n), (dq.block_m, dq.block_n)):
            assert tile_rows % rows == 0 and tile_cols % cols == 0, (wide, rows, cols)


def _map_of(live_blocks_per_row: torch.Tensor, sub: int = 32) -> ActivityMap:
    """A (1, 1) activity map of (sub x sub) tiles, active (1) where ``live_blocks_per_row``
    (map rows x map cols, bool) says so."""
    return ActivityMap(live_blocks_per_row.to(torch.int8)[None, None], sub, sub)


def test_active_area_counts_the_pairs_of_active_tiles():
    live = torch.zeros(5, 9, dtype=torch.bool)  # 160 x 288 pairs in 32 x 32 tiles
    live[0, 0] = live[4, 8] = live[2, 3] = True
    activity = _map_of(live)
    # 64 x 128 tiles: (0, 0), the partial corner (2, 2) and (1, 0) from map tile (2, 3).
    assert activity.count_active_areas([(64, 128), (32, 64)]) == (3 * 64 * 128, 3 * 32 * 64)
    assert activity.active_area(64, 128) == 3 * 64 * 128
    assert activity.active_area(32, 32) is None


@pytest.mark.parametrize("grain,wide", [(1, False), (4, True)], ids=("64-key", "128-key"))
def test_masks_active_at_a_finer_grain_keep_the_narrow_tile(grain, wide):
    """Every other 64-key block of every row live: the wide tile walks twice the pairs and
    loses (block_topk masks, ``DKDV_WIDE_MAX_EXTRA_WORK``); live in runs of 128 keys and
    more, it keeps the wide tile. Uncounted, the shape rule alone decides."""
    problem = _problem(2, 16, 4, 8192, 8192, 128)
    cols = torch.arange(8192 // 32)
    live = ((cols // (2 * grain)) % 2 == 0).expand(8192 // 32, -1).contiguous()
    activity = _map_of(live)
    assert dkdv_takes_wide_tile(replace(problem, activity=activity))  # not counted yet
    activity.count_active_areas(compared_dkdv_tiles())
    assert dkdv_takes_wide_tile(replace(problem, activity=activity)) == wide
