"""The Hopper route of the forward (Gluon, ``kernels.hopper_device``).

Host side, on every machine: which problems the schedule sends to it, what forcing it says
where it does not apply, the TMA layout rule, and that its modules import under the installed
Triton. Device side (marked ``hopper``; Gluon has no interpreter): its outputs, LSE and the
gradients of a backward after it, against the float64 reference, on awkward shapes.
"""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch

from attn_helpers import (Dims, forcing, random_intervals, random_mask, random_qkv, run_backward,
                          run_forward)
from kernels import dmattn_func, prepare_mask, record_routes, schedule_for
from kernels.planning import tuning
from kernels.planning.activity import ActivityMap
from kernels.planning.forward_schedule import forward_list_tiles
from kernels.planning.hopper_forward import _mask_geometry, hopper_gap, list_tile, may_take_masks
from kernels.planning.inputs import check_inputs
from kernels.planning.inputs import AttnShape
from kernels.planning.problem import OperandLayout, Problem, tma_mask, tma_strides
from kernels.planning.schedule import normalize_options, schedule


def hopper_problem(**changes) -> Problem:
    """A dense bf16 problem on an H100 that the Hopper forward covers."""
    shape = AttnShape(batch=2, seqlen_q=4096, seqlen_k=4096, heads_q=16, heads_kv=4,
                      head_dim=128)
    problem = Problem(shape, torch.bfloat16, torch.device("cuda"), interpreted=False,
                      multiprocessors=132, is_causal=False, softmax_scale=128 ** -0.5,
                      capability=(9, 0), tma_operands=True)
    return replace(problem, **changes)


def sized(**sizes) -> AttnShape:
    return replace(hopper_problem().shape, **sizes)


# -- host side: the route choice
@pytest.mark.parametrize("changes", [
    {},
    {"is_causal": True},
    {"dtype": torch.float16},
    {"shape": sized(head_dim=64)},
    {"shape": sized(head_dim=40)},
    {"shape": sized(head_dim=80, heads_kv=1)},
    {"shape": sized(seqlen_q=tuning.HOPPER_FORWARD_MIN_QUERIES, seqlen_k=512)},
    {"shape": sized(seqlen_q=1025, seqlen_k=3001), "is_causal": True},
], ids=["dense", "causal", "fp16", "d64", "d40", "d80-mqa", "fewest-rows", "odd-lengths"])
def test_dense_16_bit_problems_on_hopper_take_the_hopper_route(changes):
    sched = schedule(hopper_problem(**changes))
    assert sched.forward.route == "hopper"
    assert sched.forward.hopper == tuning.HOPPER_FORWARD
    assert "forward: route=hopper" in str(sched)


@pytest.mark.parametrize("changes, reason", [
    ({"capability": (8, 0)}, "compute capability 9.0"),
    ({"capability": (10, 0)}, "compute capability 9.0"),
    ({"capability": None}, "CUDA GPU only"),
    ({"interpreted": True, "capability": None}, "interpreter"),
    ({"dtype": torch.float32}, "float16 or bfloat16"),
    ({"mask": OperandLayout((2, 4, 4096, 4096), 4)}, "reads the mask through TMA"),
    ({"mask": OperandLayout((2, 4, 1, 4096), 4), "tma_mask": True, "intervals": True},
     "compiled offline only"),
    ({"bias": OperandLayout((2, 4, 1, 4096), 4)}, "no bias"),
    ({"shape": sized(head_dim=256)}, "head dims up to 128"),
    ({"shape": sized(head_dim=20)}, "multiples of 8"),
    ({"tma_operands": False}, "TMA"),
    ({"softmax_scale": 0.0}, "positive softmax_scale"),
    ({"softmax_scale": -0.1}, "positive softmax_scale"),
    ({"shape": sized(batch=2**16, heads_q=2**12, heads_kv=2**10)}, "tiles of 128 query rows"),
], ids=["ampere", "blackwell", "no-gpu", "interpreter", "fp32", "mask", "intervals", "bias",
        "d256", "d20",
        "strides", "zero-scale", "negative-scale", "grid"])
def test_what_the_hopper_route_does_not_cover_runs_the_triton_route_and_forcing_says_why(
        changes, reason):
    problem = hopper_problem(**changes)
    assert reason in hopper_gap(problem)
    sched = schedule(problem)
    assert sched.forward.route == "triton" and sched.forward.hopper is None
    assert "forward: route=triton" in str(sched) and "hopper=" not in str(sched)
    with pytest.raises(ValueError, match=r"kernel_options\['forward_route'\]: 'hopper' does "
                                         r"not cover this call: .*" + reason):
        schedule(problem, normalize_options({"forward_route": "hopper"}))


BOOL_MASK = {"mask": OperandLayout((2, 4, 4096, 4096), 4), "tma_mask": True}


def _counted(partial_share: float | None) -> ActivityMap:
    """A prepared mask's map whose share of partial Hopper tiles was counted (None: not)."""
    shares = {} if partial_share is None else {(*list_tile(), False): partial_share}
    return ActivityMap(torch.zeros(1, 1, 1, 1, dtype=torch.int8), 64, 64,
                       _partial_shares=shares)


@pytest.mark.parametrize("partial_share, route", [
    (None, "triton"), (0.0, "hopper"), (tuning.HOPPER_FORWARD_MASK_PARTIAL_SHARE, "hopper"),
    (0.5, "triton"), (1.0, "triton")], ids=["uncounted", "all-full", "at-limit", "half", "all"])
def test_a_bool_mask_takes_the_hopper_route_where_its_tiles_are_mostly_full(partial_share,
                                                                            route):
    problem = hopper_problem(**BOOL_MASK, activity=_counted(partial_share))
    assert hopper_gap(problem) is None
    assert schedule(problem).forward.route == route
    forced = schedule(problem, normalize_options({"forward_route": "hopper"}))
    assert forced.forward.hopper == tuning.HOPPER_FORWARD


def test_the_masked_hopper_forward_lists_are_built_with_the_others():
    problem = hopper_problem(**BOOL_MASK)
    forced = schedule(problem, normalize_options({"forward_route": "hopper"})).forward
    assert list_tile() in forward_list_tiles(problem, forced)
    assert list_tile() == (2 * tuning.HOPPER_FORWARD.rows, tuning.HOPPER_FORWARD.block_n)
    # A prepared mask knows no q, k and v (no TMA operands): its map still serves the tile.
    prepared = replace(problem, tma_operands=False)
    assert may_take_masks(prepared)
    assert list_tile() in forward_list_tiles(prepared, schedule(prepared).forward)
    elsewhere = replace(problem, capability=(8, 0))
    assert list_tile() not in forward_list_tiles(elsewhere, schedule(elsewhere).forward)


def _checked_mask(shape, stride=None, seqlen=64, heads=(4, 2)):
    dims = Dims(2, seqlen, seqlen, *heads, 64)
    q, k, v = random_qkv(dims, torch.bfloat16, "cpu")
    mask = torch.ones(shape, dtype=torch.bool)
    if stride is not None:
        end = 1 + sum((size - 1) * step for size, step in zip(shape, stride))
        mask = torch.ones(end, dtype=torch.bool).as_strided(shape, stride)
    return check_inputs(q, k, v, mask, None, None).mask


@pytest.mark.parametrize("shape, stride, readable", [
    ((2, 4, 64, 64), None, True),
    ((1, 1, 64, 64), None, True),
    ((2, 2, 64, 64), (0, 4096, 64, 1), True),       # batch expanded: read at index 0
    ((2, 4, 64, 64), (64 * 65, 64 * 65 * 2, 65, 1), False),  # 65-byte rows
    ((2, 4, 1, 64), None, True),                     # one row for every query row
    ((2, 4, 64, 1), None, False),                    # one key for every key
    ((2, 4, 64, 64), (16384, 4096, 1, 64), False),   # keys not contiguous
    ((2, 4, 64, 64), (256, 64, 0, 1), False),        # one row expanded over every row
], ids=["full", "shared", "batch-expanded", "odd-rows", "row-broadcast", "key-broadcast",
        "transposed", "rows-expanded"])
def test_tma_reads_a_bool_mask_with_one_row_per_query_and_16_byte_strides(shape, stride,
                                                                           readable):
    assert tma_mask(_checked_mask(shape, stride)) is readable


def test_the_mask_descriptor_reads_a_stride_0_axis_at_index_0():
    view = torch.ones(1, 1, 64, 64, dtype=torch.bool).expand(3, 4, 64, 64)
    shape, strides, head_div, batches = _mask_geometry(view, heads_q=8)
    assert shape == [1, 1, 64, 64] and strides[2:] == [64, 1]
    assert all(s * 1 % 16 == 0 for s in strides[:-1])
    assert head_div == 8 and batches == 0
    own = torch.ones(3, 4, 64, 64, dtype=torch.bool)
    assert _mask_geometry(own, heads_q=8) == ([3, 4, 64, 64], list(own.stride()), 2, 1)


def test_key_row_masks_are_gated_until_they_run_on_a_gpu(monkeypatch):
    for mask in (OperandLayout((2, 4, 1, 4096), 4), OperandLayout((1, 4, 4096, 4096), 4)):
        changes = {"mask": mask, "tma_mask": True, "intervals": mask.shape[2] == 4096}
        problem = hopper_problem(**changes)
        assert "compiled offline only" in hopper_gap(problem)
        assert not may_take_masks(problem)
        monkeypatch.setattr(tuning, "HOPPER_KEY_ROW_MASKS_RAN_ON_GPU", True)
        assert hopper_gap(problem) is None and may_take_masks(problem)
        monkeypatch.setattr(tuning, "HOPPER_KEY_ROW_MASKS_RAN_ON_GPU", False)


def test_a_forced_hopper_forward_walks_lists_and_refuses_a_forced_key_scan(monkeypatch):
    monkeypatch.setattr(tuning, "HOPPER_KEY_ROW_MASKS_RAN_ON_GPU", True)
    intervals = OperandLayout((1, 4, 1, 4096), 4)
    problem = hopper_problem(mask=intervals, tma_mask=True, intervals=True,
                             interval_pair=True, forward_only=True,
                             shape=sized(seqlen_k=2048))
    forced = schedule(problem, normalize_options({"forward_route": "hopper"})).forward
    assert forced.hopper is not None and not forced.scan_keys
    with pytest.raises(ValueError, match="forward_key_scan.*conflict"):
        schedule(problem, normalize_options({"forward_route": "hopper",
                                             "forward_key_scan": True}))


def test_the_mask_kind_follows_the_mask():
    from kernels.hopper_device import attention_forward as device
    from kernels.planning import hopper_forward as host

    for name in ("NO_MASK", "MASK_TILE", "MASK_ROW", "INTERVAL_WORDS"):
        assert getattr(device, name).value == getattr(host, name)
    assert host.mask_kind(hopper_problem()) == host.NO_MASK
    assert host.mask_kind(hopper_problem(**BOOL_MASK)) == host.MASK_TILE
    row = OperandLayout((2, 4, 1, 4096), 4)
    assert host.mask_kind(hopper_problem(mask=row)) == host.MASK_ROW
    assert host.mask_kind(hopper_problem(mask=row, intervals=True)) == host.INTERVAL_WORDS


def test_tma_reads_interval_words_with_16_byte_strides():
    dims = Dims(2, 64, 64, 4, 2, 64)
    q, k, v = random_qkv(dims, torch.bfloat16, "cpu")
    for seqlen_k, readable in ((64, True), (63, False)):
        k2, v2 = k[:, :seqlen_k], v[:, :seqlen_k]
        dims_k = Dims(2, 64, seqlen_k, 4, 2, 64)
        mask = check_inputs(q, k2, v2, random_intervals(dims_k, "Hk", "B", "cpu"), None,
                            None).mask
        assert tma_mask(mask) is readable  # an odd Lk gives 8 x Lk-byte head strides
    view = mask.view.view(torch.int32)  # the kernel reads (start, end) int32 pairs
    shape, strides, head_div, batches = _mask_geometry(view, heads_q=4, words=True)
    assert shape == [2, 2, 126] and strides[-1] == 1 and head_div == 2 and batches == 1


def test_short_query_lengths_keep_the_triton_route_unless_forced():
    problem = hopper_problem(shape=sized(seqlen_q=tuning.HOPPER_FORWARD_MIN_QUERIES - 1))
    assert hopper_gap(problem) is None
    assert schedule(problem).forward.route == "triton"
    forced = schedule(problem, normalize_options({"forward_route": "hopper"}))
    assert forced.forward.route == "hopper"


@pytest.mark.parametrize("seqlen_q, seqlen_k, causal, blocks, route", [
    (512, 512, False, 4.0, "hopper"),
    (512, 512, True, 2.5, "triton"),
    (1024, 1024, True, 4.5, "hopper"),
    (4096, 384, False, 3.0, "triton"),
    (512, 4096, True, 30.5, "hopper"),  # bottom-right: the rows see most keys
    (4096, 512, True, 1.1875, "triton"),  # most rows see no key: their tiles walk block 0
])
def test_tiles_that_walk_few_key_blocks_keep_the_triton_route(seqlen_q, seqlen_k, causal,
                                                               blocks, route):
    from kernels.planning.hopper_forward import mean_key_blocks

    problem = hopper_problem(shape=sized(seqlen_q=seqlen_q, seqlen_k=seqlen_k), is_causal=causal)
    assert mean_key_blocks(problem) == pytest.approx(blocks)
    assert schedule(problem).forward.route == route


def test_forcing_the_triton_route_keeps_it_where_the_hopper_route_would_run():
    sched = schedule(hopper_problem(), normalize_options({"forward_route": "triton"}))
    assert sched.forward.route == "triton"


def test_the_triton_launch_stays_planned_beside_the_hopper_route():
    """A call whose addresses a descriptor cannot take runs the Triton launch: its tile,
    splits and grid order are the same as without the Hopper route."""
    problem = hopper_problem(is_causal=True)
    hopper = schedule(problem).forward
    triton = schedule(problem, normalize_options({"forward_route": "triton"})).forward
    assert replace(hopper, hopper=None) == triton


@pytest.mark.parametrize("value", ["cuda", "gluon", None, 1])
def test_the_route_option_takes_a_route_name(value):
    with pytest.raises(ValueError, match=r"kernel_options\['forward_route'\]: expected "
                                         r"'triton', 'hopper' or 'gather'"):
        normalize_options({"forward_route": value})


@pytest.mark.interpreter
def test_forcing_the_hopper_route_on_the_interpreter_names_the_reason():
    q, k, v = random_qkv(Dims(1, 8, 8, 2, 2, 64), torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="not under Triton's interpreter"):
        dmattn_func(q, k, v, kernel_options={"forward_route": "hopper"})
    assert schedule_for(q, k, v).forward.route == "triton"


@pytest.mark.parametrize("layout, takes", [
    ("contiguous", True), ("bhld", True), ("sliced", False), ("strided", False)])
def test_tma_takes_unit_last_strides_and_16_byte_multiples(layout, takes):
    q, k, v = random_qkv(Dims(2, 16, 16, 4, 2, 64), torch.bfloat16, torch.device("cpu"), layout)
    assert tma_strides(q, k, v) is takes


def test_a_head_dim_of_odd_bytes_is_not_for_tma():
    q = torch.empty(1, 8, 2, 36, dtype=torch.bfloat16)  # 72-byte rows
    assert not tma_strides(q)
    assert tma_strides(torch.empty(1, 8, 2, 40, dtype=torch.bfloat16))  # 80-byte rows


def test_a_descriptor_is_compiled_for_its_box_and_layout_not_its_sizes():
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from kernels.runtime.launch import specialization

    box = [1, 64, 1, 128]
    layout = gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)

    def described(t):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), box, layout)

    short = described(torch.empty(1, 100, 2, 128, dtype=torch.bfloat16))
    long = described(torch.empty(3, 4096, 8, 128, dtype=torch.bfloat16))
    assert specialization(short) == specialization(long)
    assert hash(specialization(short)) == hash(specialization(long))
    other = TensorDescriptor(long.base, long.shape, long.strides, [1, 128, 1, 128],
                             gl.NVMMASharedLayout.get_default_for([1, 128, 1, 128], gl.bfloat16))
    assert specialization(other) != specialization(long)


def test_the_gluon_kernel_imports_under_this_triton():
    from kernels.hopper_device.attention_forward import attention_forward

    assert attention_forward.arg_names[:5] == ["q_desc", "k_desc", "v_desc", "o_desc",
                                               "lse_ptr"]
    assert {"CAUSAL", "STAGES", "CONSUMER_REGS", "LOADER_REGS"} <= set(
        attention_forward.arg_names)


# -- device side: a Hopper GPU
def _count_hopper_launches(monkeypatch) -> list:
    """The Hopper launches made from now on (one entry each)."""
    from kernels.planning.hopper_forward import HopperForwardLaunch

    launched = []
    original = HopperForwardLaunch.__call__
    monkeypatch.setattr(HopperForwardLaunch, "__call__",
                        lambda self, *args: launched.append(1) or original(self, *args))
    return launched


FORCED = forcing(forward_route="hopper")


def HOPPER(*args, **kwargs):
    """``dmattn_func`` forced onto the Hopper route, failing unless every forward it ran
    launched the Hopper kernel (a silent fallback to the Triton launch fails the test)."""
    with record_routes() as routes:
        result = FORCED(*args, **kwargs)
    assert routes.forward and set(routes.forward) == {"hopper"}, (
        f"the forced call ran {routes.describe() or 'no forward'}")
    return result

SHAPES = [  # (batch, Lq, Lk, Hq, Hk, D)
    (1, 1, 1, 1, 1, 64),
    (2, 17, 97, 4, 2, 128),
    (1, 97, 17, 3, 3, 40),
    (2, 1025, 1025, 4, 1, 80),
    (1, 4095, 4095, 2, 2, 128),
    (1, 1000, 3000, 6, 2, 64),
    (3, 300, 129, 2, 1, 128),
    (1, 2048, 2048, 8, 8, 16),
]


@pytest.mark.hopper
@pytest.mark.parametrize("sizes", SHAPES, ids=lambda s: "B{}-Lq{}-Lk{}-H{}/{}-D{}".format(*s))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_hopper_forward_matches_the_reference(device, sizes, causal, dtype):
    dims = Dims(*sizes)
    q, k, v = random_qkv(dims, dtype, device)
    assert schedule_for(q, k, v, is_causal=causal,
                        kernel_options={"forward_route": "hopper"}).forward.route == "hopper"
    run_forward(q, k, v, causal=causal, func=HOPPER)


@pytest.mark.hopper
@pytest.mark.parametrize("layout", ["contiguous", "bhld"])
def test_hopper_forward_reads_strided_views(device, layout):
    q, k, v = random_qkv(Dims(2, 333, 333, 4, 2, 64), torch.bfloat16, device, layout)
    run_forward(q, k, v, causal=True, func=HOPPER)


@pytest.mark.hopper
def test_the_default_route_on_hopper_is_the_hopper_forward(device):
    dims = Dims(1, tuning.HOPPER_FORWARD_MIN_QUERIES, 700, 4, 2, 128)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    assert schedule_for(q, k, v).forward.route == "hopper"
    with record_routes() as routes:
        run_forward(q, k, v, causal=True)
    assert set(routes.forward) == {"hopper"}


@pytest.mark.hopper
def test_an_unaligned_address_runs_the_triton_launch(device, monkeypatch):
    launched = _count_hopper_launches(monkeypatch)
    dims = Dims(1, 600, 600, 2, 2, 64)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    run_forward(q, k, v, func=HOPPER)
    assert launched == [1]
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=device)[1:].view(q.shape)
    shifted.copy_(q)  # 2 bytes past a 16-byte boundary, strides unchanged
    with record_routes() as routes:
        run_forward(shifted, k, v, func=FORCED)
    assert launched == [1]
    assert set(routes.forward) == {"triton"}


@pytest.mark.hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_backward_after_the_hopper_forward_matches_the_reference(device, causal):
    dims = Dims(2, 300, 515, 4, 2, 128)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    run_backward(q, k, v, causal=causal, func=HOPPER)


@pytest.mark.hopper
def test_by_default_a_prepared_band_takes_the_hopper_route_and_a_random_mask_does_not(device):
    dims = Dims(1, 4096, 4096, 4, 2, 128)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    band = prepare_mask(_band(dims, 2048, device), q, k, is_causal=True)
    scattered = random_mask((1, 1, 4096, 4096), device)
    for mask, route in ((band, "hopper"), (scattered, "triton"),
                        (prepare_mask(scattered, q, k, is_causal=True), "triton")):
        assert schedule_for(q, k, v, mask, is_causal=True).forward.route == route
        with record_routes() as routes:
            run_forward(q, k, v, mask, causal=True)
        assert set(routes.forward) == {route}


MASKED_SHAPES = [  # (batch, Lq, Lk, Hq, Hk, D): Lk a multiple of 16 (TMA reads mask rows)
    (2, 300, 512, 4, 2, 128),
    (1, 1025, 1040, 4, 1, 80),
    (2, 17, 64, 2, 2, 64),
    (1, 700, 4096, 6, 2, 128),
]


@pytest.mark.hopper
@pytest.mark.parametrize("sizes", MASKED_SHAPES,
                         ids=lambda s: "B{}-Lq{}-Lk{}-H{}/{}-D{}".format(*s))
@pytest.mark.parametrize("batch, heads", [("B", "Hq"), ("1", "Hk"), ("B", "1"), ("1", "1")],
                         ids=["B-Hq", "1-Hk", "B-1", "1-1"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("keep", [0.02, 0.5, 1.0], ids=["keep2", "keep50", "keep100"])
def test_masked_hopper_forward_matches_the_reference(device, sizes, batch, heads, causal, keep):
    dims = Dims(*sizes)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    mask = random_mask(dims.operand_shape(batch, heads, "Lq", "Lk"), device, keep)
    mask[..., 5, :] = False  # an empty row
    run_forward(q, k, v, mask, causal=causal, func=HOPPER)


def _band(dims: Dims, window: int, device) -> torch.Tensor:
    """A sliding window of ``window`` keys ending at each row's diagonal: mostly full tiles,
    partial ones on its two edges."""
    rows = torch.arange(dims.seqlen_q, device=device)[:, None]
    keys = torch.arange(dims.seqlen_k, device=device)[None, :]
    last = rows + dims.seqlen_k - dims.seqlen_q
    return ((keys <= last) & (keys > last - window))[None, None]


@pytest.mark.hopper
@pytest.mark.parametrize("window", [1, 100, 1024], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_masked_hopper_forward_walks_full_tiles_of_a_band(device, window, dtype):
    dims = Dims(2, 2000, 2048, 8, 2, 128)
    q, k, v = random_qkv(dims, dtype, device)
    run_forward(q, k, v, _band(dims, window, device), causal=True, func=HOPPER)


@pytest.mark.hopper
def test_masked_hopper_forward_reads_expanded_and_sliced_masks(device):
    dims = Dims(3, 513, 640, 4, 2, 64)
    q, k, v = random_qkv(dims, torch.bfloat16, device, "bhld")
    expanded = random_mask((1, 2, 513, 640), device, 0.3).expand(3, 2, 513, 640)
    run_forward(q, k, v, expanded, causal=True, func=HOPPER)
    wide = random_mask((3, 4, 513, 768), device, 0.3)
    run_forward(q, k, v, wide[..., 64:704], func=HOPPER)  # rows of 768 bytes, offset 64


@pytest.mark.hopper
def test_masked_hopper_forward_with_a_prepared_mask_and_a_mask_per_call(device):
    dims = Dims(2, 1024, 1024, 4, 2, 128)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    for seed in range(3):  # one kept plan, a new mask each call
        torch.manual_seed(seed)
        mask = random_mask((2, 2, 1024, 1024), device, 0.1 + 0.4 * seed)
        run_forward(q, k, v, mask, causal=True, func=HOPPER)
    prepared = prepare_mask(mask, q, k, is_causal=True)
    run_forward(q, k, v, prepared, causal=True, func=HOPPER)


@pytest.mark.hopper
def test_the_backward_after_the_masked_hopper_forward_matches_the_reference(device):
    dims = Dims(2, 300, 512, 4, 2, 128)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    mask = random_mask((2, 2, 300, 512), device, 0.4)
    run_backward(q, k, v, mask, causal=True, func=HOPPER)


@pytest.mark.hopper
def test_a_mask_tma_cannot_read_falls_back_or_is_refused_with_its_reason(device):
    dims = Dims(1, 600, 600, 2, 2, 64)  # 600-byte mask rows
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    mask = random_mask((1, 1, 600, 600), device)
    with pytest.raises(ValueError, match="reads the mask through TMA"):
        FORCED(q, k, v, mask, None, False)
    dims = Dims(1, 640, 640, 2, 2, 64)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    shifted = torch.zeros(640 * 640 + 1, dtype=torch.bool, device=device)[1:]
    shifted = shifted.view(1, 1, 640, 640)
    shifted.copy_(random_mask((1, 1, 640, 640), device))  # 1 byte past a 16-byte boundary
    with record_routes() as routes:
        run_forward(q, k, v, shifted, func=FORCED)
    assert set(routes.forward) == {"triton"}


@pytest.mark.hopper
@pytest.mark.parametrize("sizes", MASKED_SHAPES,
                         ids=lambda s: "B{}-Lq{}-Lk{}-H{}/{}-D{}".format(*s))
@pytest.mark.parametrize("batch, heads", [("B", "Hq"), ("1", "Hk"), ("B", "1")],
                         ids=["B-Hq", "1-Hk", "B-1"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("form", ["row", "intervals", "prepared-intervals"])
def test_masked_hopper_forward_reads_key_rows(device, monkeypatch, sizes, batch, heads, causal,
                                              form):
    """A bool mask of one row for every query row, and KeyIntervals (as the call gives them,
    and prepared), read as one [1, 128] row of a key block per slot."""
    monkeypatch.setattr(tuning, "HOPPER_KEY_ROW_MASKS_RAN_ON_GPU", True)
    dims = Dims(*sizes)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    if form == "row":
        mask = random_mask(dims.operand_shape(batch, heads, "1", "Lk"), device, 0.4)
    else:
        mask = random_intervals(dims, heads, batch, device, seed=sizes[1])
        if form == "prepared-intervals":
            mask = prepare_mask(mask, q, k, is_causal=causal)
    run_forward(q, k, v, mask, causal=causal, func=HOPPER)


@pytest.mark.hopper
def test_the_backward_after_the_hopper_forward_of_intervals_matches_the_reference(
        device, monkeypatch):
    monkeypatch.setattr(tuning, "HOPPER_KEY_ROW_MASKS_RAN_ON_GPU", True)
    dims = Dims(2, 300, 512, 4, 2, 128)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    run_backward(q, k, v, random_intervals(dims, "Hk", "B", device), causal=True, func=HOPPER)


@pytest.mark.hopper
def test_masked_hopper_forward_on_random_shapes(device):
    """A seeded fuzz of 300 calls: lengths up to 1500 (odd key lengths through a mask sliced
    from rows padded to 16 bytes), head dims 8-128, GQA/MQA, every batch and head broadcast of
    the mask (a stride-0 expand too), keep 0-100% (empty rows), causal or not, both dtypes,
    strided q, k and v, and prepared masks. NaN never passes (``run_forward``)."""
    rng = random.Random(65)
    for _ in range(300):
        heads_kv = rng.choice([1, 2, 3])
        dims = Dims(rng.randint(1, 3), rng.randint(1, 1500), rng.randint(1, 1500),
                    heads_kv * rng.choice([1, 2, 4]), heads_kv, 8 * rng.randint(1, 16))
        q, k, v = random_qkv(dims, rng.choice([torch.bfloat16, torch.float16]), device,
                             rng.choice(["contiguous", "bhld"]))
        batch, heads = rng.choice(["1", "B"]), rng.choice(["1", "Hk", "Hq"])
        shape = dims.operand_shape(batch, heads, "Lq", "Lk")
        padded = -(-dims.seqlen_k // 16) * 16
        keep = rng.choice([0.0, 0.01, 0.3, 0.9, 1.0])
        mask = random_mask((*shape[:3], padded), device, keep)[..., :dims.seqlen_k]
        if batch == "1" and rng.random() < 0.3:
            mask = mask.expand(dims.batch, *mask.shape[1:])
        causal = rng.random() < 0.5
        if rng.random() < 0.3:
            mask = prepare_mask(mask, q, k, is_causal=causal)
        run_forward(q, k, v, mask, causal=causal, func=HOPPER)


@pytest.mark.hopper
def test_hopper_forward_on_random_shapes(device):
    """A seeded fuzz: lengths 1-3000, head dims 8-128 (multiples of 8), GQA/MQA, both dtypes,
    causal or not."""
    rng = random.Random(55)
    for _ in range(40):
        heads_kv = rng.choice([1, 2, 3])
        dims = Dims(rng.randint(1, 3), rng.randint(1, 3000), rng.randint(1, 3000),
                    heads_kv * rng.choice([1, 2, 4]), heads_kv, 8 * rng.randint(1, 16))
        dtype = rng.choice([torch.bfloat16, torch.float16])
        q, k, v = random_qkv(dims, dtype, device)
        run_forward(q, k, v, causal=rng.random() < 0.5, func=HOPPER)


# -- device side: what the route must work under
@pytest.mark.hopper
def test_torch_compile_fullgraph_runs_the_hopper_forward(device, monkeypatch):
    torch._dynamo.reset()
    dims = Dims(1, 1000, 1000, 4, 2, 128)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    launched = _count_hopper_launches(monkeypatch)
    compiled = torch.compile(lambda q, k, v: dmattn_func(q, k, v, is_causal=True),
                             fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v)
    assert launched, "the compiled call did not take the Hopper route"
    assert torch.equal(got, dmattn_func(q, k, v, is_causal=True))
    torch._dynamo.reset()


@pytest.mark.hopper
@pytest.mark.parametrize("masked", [False, True], ids=["dense", "prepared-band"])
def test_a_cuda_graph_replays_the_hopper_forward_on_new_inputs(device, monkeypatch, masked):
    dims = Dims(2, 1000, 1024, 4, 2, 128)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    mask = prepare_mask(_band(dims, 300, device), q, k, is_causal=True) if masked else None
    launched = _count_hopper_launches(monkeypatch)
    FORCED(q, k, v, mask, None, True)  # plans and compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = FORCED(q, k, v, mask, None, True)
    assert len(launched) == 2
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    graph.replay()
    assert torch.equal(captured, FORCED(q, k, v, mask, None, True))
    assert torch.isfinite(captured.float()).all()


@pytest.mark.hopper
def test_warmup_compiles_the_hopper_forward_for_every_length_between(device):
    from kernels import compiled_forms, warmup

    warmup(seqlens=[1024, 3000], heads_q=4, heads_kv=2, head_dim=128, dtype=torch.bfloat16,
           device=device, is_causal=True)
    before = compiled_forms()
    for length in (1100, 1537, 2048, 2999):
        q, k, v = random_qkv(Dims(1, length, length, 4, 2, 128), torch.bfloat16, device)
        assert schedule_for(q, k, v, is_causal=True).forward.route == "hopper"
        with record_routes() as routes:
            run_backward(q, k, v, causal=True)
        assert set(routes.forward) == {"hopper"}
    assert compiled_forms() == before


@pytest.mark.hopper
def test_a_bf16_llama_takes_the_hopper_route_and_matches_eager(device, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from kernels.integrations import transformers as dm_hf
    from kernels.tolerance import check_tensor

    dm_hf.register()
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=384,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=1024)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                          attn_implementation="eager")
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                         attn_implementation="dmattn")
    ours.load_state_dict(eager.state_dict())
    tokens = torch.randint(0, 97, (2, 1000), device=device)
    launched = _count_hopper_launches(monkeypatch)
    with torch.no_grad():
        got = ours.to(device, torch.bfloat16)(tokens).logits
        baseline = eager.to(device, torch.bfloat16)(tokens).logits
        truth = eager.to(device, torch.float64)(tokens).logits
    assert len(launched) == 2  # one per layer
    scale = truth.abs().max()
    check = check_tensor("logits", got.double() / scale, truth / scale,
                         baseline.double() / scale, torch.bfloat16)
    assert check.passed, check.describe()
