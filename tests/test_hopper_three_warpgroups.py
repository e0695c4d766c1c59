"""Three consumer warpgroups on the Hopper forward (``tuning.HOPPER_FORWARD_THREE``, 192 query
rows a work tile, head dims up to 64).

Host side: where ``kernel_options['forward_consumers']`` = 3 takes them, which calls take them
by default, and what they refuse, named. Device side (marked ``hopper``): out and LSE against
the float64 reference without a mask, under masks of one key row, and a backward after them.
The two-warpgroup route is ``test_hopper_route``'s.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from attn_helpers import (Dims, forcing, random_intervals, random_mask, random_qkv, run_backward,
                          run_forward)
from hopper_helpers import OVERLAPPED_THREE, hopper_problem, shape_id, sized, tma_keys
from kernels import prepare_mask, record_routes, schedule_for, topk_intervals
from kernels.planning import hopper_forward, tuning
from kernels.planning.hopper_forward import hopper_gap
from kernels.planning.problem import OperandLayout
from kernels.planning.schedule import normalize_options, schedule


# -- host side
THREE = normalize_options({"forward_route": "hopper", "forward_consumers": 3})


def test_three_consumer_warpgroups_run_where_asked_and_on_long_dense_calls():
    """``kernel_options['forward_consumers']`` = 3 takes ``tuning.HOPPER_FORWARD_THREE``
    (192 query rows over 128-key blocks) on the Hopper forward, forced or by default; by
    default, calls without a mask or bias at head dims up to 64 whose lengths both reach
    ``tuning.HOPPER_FORWARD_THREE_MIN_LENGTH`` take it, others two warpgroups; 2 keeps two."""
    d64 = hopper_problem(shape=sized(head_dim=64))  # L4096
    sched = schedule(d64, THREE)
    assert sched.forward.hopper == tuning.HOPPER_FORWARD_THREE
    assert "192x128 s2 serial" in str(sched)
    assert schedule(d64).forward.hopper == tuning.HOPPER_FORWARD
    asked = normalize_options({"forward_consumers": 3})
    assert schedule(d64, asked).forward.hopper == tuning.HOPPER_FORWARD_THREE
    two = normalize_options({"forward_consumers": 2})
    least = tuning.HOPPER_FORWARD_THREE_MIN_LENGTH
    long = hopper_problem(shape=sized(head_dim=64, seqlen_q=least, seqlen_k=least))
    assert schedule(long).forward.hopper == tuning.HOPPER_FORWARD_THREE
    assert schedule(replace(long, is_causal=True)).forward.hopper == tuning.HOPPER_FORWARD_THREE
    assert schedule(long, two).forward.hopper == tuning.HOPPER_FORWARD
    short = sized(head_dim=64, seqlen_q=least - 1, seqlen_k=least)
    for other in (hopper_problem(shape=short),
                  hopper_problem(shape=sized(head_dim=80, seqlen_q=least, seqlen_k=least)),
                  replace(long, bias=OperandLayout((2, 4, 1, least), 4), tma_bias=True)):
        assert schedule(other).forward.hopper in (tuning.HOPPER_FORWARD, None)


@pytest.mark.parametrize("changes, reason", [
    ({"shape": sized(head_dim=80)}, "head dims up to 64, not 80"),
    ({"mask": OperandLayout((2, 4, 4096, 4096), 4), "tma_mask": True},
     "not a bool mask per query row"),
    ({"shape": sized(head_dim=64), "mask": OperandLayout((2, 4, 1, 4096), 4), "tma_mask": True,
      "bias": OperandLayout((2, 4, 4096, 4096), 4), "tma_bias": True},
     "no full bias beside a bool mask row"),
], ids=["d80", "mask", "full-bias-mask-row"])
def test_three_consumer_warpgroups_refuse_what_they_do_not_cover(changes, reason):
    problem = hopper_problem(**changes)
    assert hopper_gap(problem) is None
    with pytest.raises(ValueError, match=r"kernel_options\['forward_consumers'\]: 3 does not "
                                         r"cover this call: .*" + reason):
        schedule(problem, THREE)


@pytest.mark.parametrize("changes", [
    {"mask": OperandLayout((2, 4, 1, 4096), 4), "tma_mask": True},
    {"mask": OperandLayout((2, 4, 1, 4096), 4), "tma_mask": True, "intervals": True},
], ids=["bool-row", "intervals"])
def test_three_consumer_warpgroups_take_masks_of_one_key_row_where_asked(changes):
    """A mask of one key row (a bool row for every query row, KeyIntervals' words) takes
    three consumer warpgroups where ``kernel_options['forward_consumers']`` = 3 asks, with
    192-row lists, never by default."""
    problem = hopper_problem(shape=sized(head_dim=64, seqlen_q=8192, seqlen_k=8192), **changes)
    sched = schedule(problem, THREE)
    assert sched.forward.hopper == tuning.HOPPER_FORWARD_THREE
    assert hopper_forward.list_tile(sched.forward.hopper) == (192, 128)
    assert schedule(problem).forward.hopper in (tuning.HOPPER_FORWARD, None)


@pytest.mark.parametrize("changes", [
    {},
    {"mask": OperandLayout((2, 4, 1, 4096), 4), "tma_mask": True, "intervals": True},
    {"mask": OperandLayout((2, 4, 4096, 4096), 4), "tma_mask": True,
     "shape": sized(head_dim=64)},
], ids=["no-mask", "intervals", "mask-tile-d64"])
def test_a_full_bias_takes_the_hopper_forward_where_forced(monkeypatch, changes):
    """A full bias (a row per query row) that TMA reads takes the Hopper forward where
    ``kernel_options['forward_route']`` asks, with three warpgroups too at head dims up to 64;
    by default only with ``tuning.HOPPER_FORWARD_FULL_BIAS`` (off until measured)."""
    problem = hopper_problem(bias=OperandLayout((2, 4, 4096, 4096), 4), tma_bias=True,
                             **changes)
    assert hopper_gap(problem) is None
    forced = normalize_options({"forward_route": "hopper"})
    assert schedule(problem, forced).forward.hopper == tuning.HOPPER_FORWARD
    assert schedule(problem).forward.hopper is None
    if "mask" not in changes:
        monkeypatch.setattr(tuning, "HOPPER_FORWARD_FULL_BIAS", True)
        assert schedule(problem).forward.hopper == tuning.HOPPER_FORWARD
    if "mask" not in changes:
        d64 = replace(problem, shape=sized(head_dim=64))
        assert schedule(d64, THREE).forward.hopper == tuning.HOPPER_FORWARD_THREE


def test_three_consumer_warpgroups_on_the_triton_route_are_refused():
    triton = normalize_options({"forward_route": "triton", "forward_consumers": 3})
    with pytest.raises(ValueError, match="forward_consumers.*Triton route"):
        schedule(hopper_problem(shape=sized(head_dim=64)), triton)


@pytest.mark.parametrize("value", [1, 4, "3", True, 3.0])
def test_the_consumers_option_takes_two_or_three(value):
    with pytest.raises(ValueError, match=r"kernel_options\['forward_consumers'\]: expected 2 "
                                         r"or 3"):
        normalize_options({"forward_consumers": value})


# -- device side: a Hopper GPU
THREE_SHAPES = [  # (batch, Lq, Lk, Hq, Hk, D), head dims up to 64
    (1, 1, 1, 1, 1, 64),
    (2, 17, 97, 4, 2, 64),
    (1, 97, 17, 3, 3, 40),
    (2, 1025, 1025, 4, 1, 64),
    (1, 1000, 3000, 6, 2, 64),
    (3, 300, 129, 2, 1, 32),
    (1, 2048, 2048, 8, 8, 16),
    (1, 4095, 4095, 2, 2, 64),
]


@pytest.mark.hopper
@pytest.mark.parametrize("sizes", THREE_SHAPES, ids=shape_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("biased", [False, True], ids=["no-bias", "kv_row"])
@pytest.mark.parametrize("tile", [tuning.HOPPER_FORWARD_THREE, OVERLAPPED_THREE], ids=str)
def test_three_consumer_warpgroups_match_the_reference(device, monkeypatch, no_kept_plans,
                                                       sizes, causal, dtype, biased, tile):
    """The forward of three consumer warpgroups (``kernel_options['forward_consumers']`` = 3),
    the shipped serial 128-key tile and the overlapped 64-key one: out and LSE against the
    float64 reference, into poisoned outputs, with a kv_row bias read from a padded row (its
    rows 16-byte aligned at any Lk). A bias over one key is refused, as on the two-warpgroup
    route."""
    monkeypatch.setattr(tuning, "HOPPER_FORWARD_THREE", tile)
    dims = Dims(*sizes)
    q, k, v = random_qkv(dims, dtype, device)
    bias = None
    if biased:
        padded = tma_keys(dims.seqlen_k, 2)
        bias = torch.randn(dims.batch, dims.heads_kv, 1, padded, device=device).to(dtype)
        bias = bias[..., :dims.seqlen_k]
    options = {"forward_route": "hopper", "forward_consumers": 3}
    if biased and dims.seqlen_k == 1:  # one key: the bias reads as broadcast along the keys
        with pytest.raises(ValueError, match="broadcast along the keys"):
            schedule_for(q, k, v, attn_bias=bias, is_causal=causal, kernel_options=options)
        return
    assert schedule_for(q, k, v, attn_bias=bias, is_causal=causal,
                        kernel_options=options).forward.hopper == tile
    with record_routes() as routes:
        run_forward(q, k, v, None, bias, causal, func=forcing(**options))
    assert set(routes.forward) == {"hopper"}, routes.describe()


@pytest.mark.hopper
@pytest.mark.parametrize("sizes", THREE_SHAPES[1:], ids=shape_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("form", ["row", "intervals", "prepared-intervals", "top-W"])
@pytest.mark.parametrize("biased", [False, True], ids=["no-bias", "kv_row"])
def test_three_consumer_warpgroups_read_key_rows(device, no_kept_plans, sizes, causal, form,
                                                 biased):
    """Three consumer warpgroups (forced) under a bool mask of one row for every query row,
    KeyIntervals (as the call gives them, and prepared) and a key-ordered top-W selection,
    with or without a kv_row bias read from a padded row: out and LSE against the float64
    reference, into poisoned outputs, every forward on the Hopper route. The route reads the
    mask through TMA: the bool rows come from rows padded to 16 bytes; the intervals' words
    sit in rows of an even number of keys at any Lk."""
    dims = Dims(*sizes)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    bias = None
    if biased:
        padded = tma_keys(dims.seqlen_k, 2)
        bias = torch.randn(dims.batch, dims.heads_kv, 1, padded, device=device)
        bias = bias.to(torch.bfloat16)[..., :dims.seqlen_k]
    if form == "row":
        padded = tma_keys(dims.seqlen_k, 1)
        mask = random_mask((*dims.operand_shape("B", "Hk", "1", "Lk")[:3], padded), device,
                           0.4)[..., :dims.seqlen_k]
    elif form == "top-W":
        selection = torch.randn(dims.batch, dims.heads_kv, 1, dims.seqlen_k, device=device)
        mask = topk_intervals(selection, max(dims.seqlen_k // 8, 1), seqlen_q=dims.seqlen_q,
                              is_causal=causal)
    else:
        mask = random_intervals(dims, "Hk", "B", device, seed=sizes[1])
        if form == "prepared-intervals":
            mask = prepare_mask(mask, q, k, is_causal=causal)
    with record_routes() as routes:
        run_forward(q, k, v, mask, bias, causal,
                    func=forcing(forward_route="hopper", forward_consumers=3))
    assert set(routes.forward) == {"hopper"}, routes.describe()


@pytest.mark.hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_backward_after_three_consumer_warpgroups_matches_the_reference(device, causal):
    """The backward reads the three-warpgroup forward's output and LSE."""
    q, k, v = random_qkv(Dims(2, 1500, 1500, 8, 2, 64), torch.bfloat16, device)
    with record_routes() as routes:
        run_backward(q, k, v, causal=causal,
                     func=forcing(forward_route="hopper", forward_consumers=3))
    assert set(routes.forward) == {"hopper"}, routes.describe()
