"""The forward's tile for KeyIntervals without a bias (``tuning.FORWARD_D128_INTERVALS``): at head
dim 128 on the GPU, 64 query rows with 4 warps, where a bias or a bool mask keeps 128 rows with
8 warps. The rule is checked on Problems of an H100-sized GPU. The calls at D128 are checked
against the float64 reference: on ``--device cuda`` they run that tile, under the interpreter
its own tiles. They cover intervals read by the call, a prepared mask that serves calls with and
without a bias from one activity map, the backward after such a forward, and varlen."""

from __future__ import annotations

import pytest
import torch

from attn_helpers import (Dims, assert_close_to_reference, assert_empty_rows_and_finite,
                          assert_grads_close_to_reference, random_bias, random_intervals,
                          random_qkv)
from kernels import (KeyIntervals, attention_reference, attention_varlen_reference, dmattn_func,
                     dmattn_varlen_func, prepare_mask)
from kernels.planning import tuning
from kernels.planning.activity import shared_granularity
from kernels.planning.inputs import AttnShape, check_inputs
from kernels.planning.forward import call_problem
from kernels.planning.forward_schedule import forward_list_tiles
from kernels.planning.problem import OperandLayout, Problem
from kernels.planning.schedule import activity_tiles, schedule
from kernels.tolerance import check_tensor

INTERVALS, BIAS, BOOL = "intervals", "kv_row bias", "bool mask"


def _problem(mask=INTERVALS, bias=False, seqlen_q=4096, head_dim=128, dtype=torch.bfloat16,
             interpreted=False, heads=(16, 4)):
    heads_q, heads_kv = heads
    shape = AttnShape(batch=1, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen_q,
                      seqlen_k=4096, head_dim=head_dim)
    group = heads_q // heads_kv
    return Problem(shape, dtype, torch.device("cuda"), interpreted=interpreted,
                   multiprocessors=132, is_causal=True, softmax_scale=0.1,
                   mask=OperandLayout((1, heads_kv, seqlen_q, 4096), group),
                   bias=OperandLayout((1, heads_kv, 1, 4096), group) if bias else None,
                   intervals=mask == INTERVALS)


@pytest.mark.parametrize("problem,tile", [
    (_problem(), tuning.FORWARD_D128_INTERVALS),
    (_problem(heads=(8, 8)), tuning.FORWARD_D128_INTERVALS),
    (_problem(dtype=torch.float16), tuning.FORWARD_D128_INTERVALS),
    (_problem(seqlen_q=64), tuning.FORWARD_D128_INTERVALS),
    (_problem(bias=True), tuning.FORWARD_D128_MASKED),  # a bias: 1.15-1.37x slower there
    (_problem(mask=BOOL), tuning.FORWARD_D128_MASKED),  # a bool mask: 1.18-1.32x
    (_problem(seqlen_q=63), tuning.FORWARD_D128_MASKED),  # decode-sized query lengths
    (_problem(head_dim=96), tuning.FORWARD_D128_MASKED),  # padded head dims: not measured
    (_problem(dtype=torch.float32), tuning.FORWARD_FP32),
    (_problem(interpreted=True), tuning.FORWARD_INTERPRETED),
], ids=["gqa", "mha", "fp16", "64-rows", "bias", "bool", "63-rows", "D96", "fp32", "interpreter"])
def test_the_tile_rule(problem, tile):
    assert schedule(problem).forward.tile == tile


@pytest.mark.parametrize("heads", [(16, 4), (8, 8)], ids=["gqa", "mha"])
def test_one_activity_map_serves_the_forward_with_and_without_a_bias(heads):
    """A prepared mask's map is built before a call's bias is known: its tiles make up the
    forward's list tile whichever tile the bias picks."""
    for bias in (False, True):
        problem = _problem(bias=bias, heads=heads)
        rows, cols = shared_granularity(activity_tiles(problem, schedule(problem).forward))
        for other in (False, True):
            forward = schedule(_problem(bias=other, heads=heads)).forward
            tile_rows, tile_cols = forward.list_tile
            assert tile_rows % rows == 0 and tile_cols % cols == 0, (bias, other, rows, cols)
        assert len(forward_list_tiles(problem, schedule(problem).forward)) == 2


# (dims, interval heads, interval batch): GQA with a partial last query and key block, MHA with
# per-query-head intervals.
SHAPES = [
    pytest.param(Dims(2, 130, 200, heads_q=8, heads_kv=2, head_dim=128), "Hk", "B", id="gqa"),
    pytest.param(Dims(1, 97, 97, heads_q=2, heads_kv=2, head_dim=128), "Hq", "1", id="mha"),
]
CAUSAL = (pytest.param(False, id="full"), pytest.param(True, id="causal"))


def _forward_matches(q, k, v, mask, bias, causal, reference_mask=None):
    reference_mask = mask if reference_mask is None else reference_mask
    out, lse = dmattn_func(q, k, v, mask, bias, causal, return_lse=True)
    ref_out, ref_lse = attention_reference(q, k, v, reference_mask, bias, causal,
                                           return_lse=True)
    low_out, low_lse = attention_reference(q, k, v, reference_mask, bias, causal,
                                           return_lse=True, upcast=False)
    assert_empty_rows_and_finite(out, lse, ref_lse)
    assert_close_to_reference("out", out, ref_out, low_out, q.dtype)
    assert_close_to_reference("lse", lse, ref_lse, low_lse, q.dtype)


@pytest.mark.parametrize("dims,heads,batch", SHAPES)
@pytest.mark.parametrize("causal", CAUSAL)
def test_intervals_without_a_bias_match_the_reference(dims, heads, batch, causal, device):
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    intervals = random_intervals(dims, heads, batch, device, seed=11)
    _forward_matches(q, k, v, intervals, None, causal)
    grad_out = torch.randn(q.shape, device=device).to(q.dtype)
    assert_grads_close_to_reference(q, k, v, intervals, None, causal, grad_out, q.dtype)


@pytest.mark.parametrize("causal", CAUSAL)
def test_a_prepared_mask_serves_calls_with_and_without_a_bias(causal, device):
    dims = SHAPES[0].values[0]
    q, k, v = random_qkv(dims, torch.float16, device)
    intervals = random_intervals(dims, "Hk", "B", device, seed=12)
    prepared = prepare_mask(intervals, q, k, causal)
    bias = random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), torch.float16, device)
    for call_bias in (None, bias, None):
        _forward_matches(q, k, v, prepared, call_bias, causal, reference_mask=intervals)


def test_varlen_without_a_bias_matches_the_reference(device):
    """Sequences of 0, 1 and 90 query rows in one packed batch of 161 rows, causal."""
    lengths = ((70, 70), (0, 3), (1, 1), (90, 90))
    cu_q = torch.tensor([0] + [n for n, _ in lengths]).cumsum(0).to(torch.int32).to(device)
    cu_k = torch.tensor([0] + [n for _, n in lengths]).cumsum(0).to(torch.int32).to(device)
    gen = torch.Generator(device="cpu").manual_seed(13)
    q, k, v = (torch.randn(int(cu[-1]), heads, 128, generator=gen).to(torch.bfloat16).to(device)
               for cu, heads in ((cu_q, 4), (cu_k, 2), (cu_k, 2)))
    out, lse = dmattn_varlen_func(q, k, v, cu_q, cu_k, 90, 90, is_causal=True, return_lse=True)
    ref = attention_varlen_reference(q, k, v, cu_q, cu_k, is_causal=True, return_lse=True)
    low = attention_varlen_reference(q, k, v, cu_q, cu_k, is_causal=True, return_lse=True,
                                     upcast=False)
    for name, got, want, eager in zip(("out", "lse"), (out, lse), ref, low):
        check = check_tensor(name, got, want, eager, q.dtype)
        assert check.passed, check.describe()


def test_problems_mark_interval_masks():
    """A call's Problem says whether its mask is KeyIntervals; a bool mask's does not."""
    dims = Dims(1, 80, 80, heads_q=2, heads_kv=2, head_dim=128)
    q, k, v = random_qkv(dims, torch.bfloat16, "cpu")
    start = torch.zeros(1, 1, 80, dtype=torch.int32)
    intervals = KeyIntervals(start, start + 80)
    for mask, marked in ((intervals, True), (torch.ones(1, 1, 80, 80, dtype=torch.bool), False)):
        checked = check_inputs(q, k, v, mask, None, None)
        assert call_problem(checked, q, is_causal=False).intervals is marked
