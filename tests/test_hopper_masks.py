"""Masks on the Hopper forward (``kernels.hopper_device.attention_forward``'s MASK_KIND).

Host side, on every machine: which masks a TMA descriptor reads and how, the default that
takes a prepared mask of mostly full tiles, the lists built for it, and the refusals of the forms
it does not read. A bias row is tested here too, with and without a mask. Device side (marked
``hopper``): outputs and LSE against the float64 reference for every broadcast, keep share,
band, prepared or per-call mask, the backward after it, and a seeded fuzz; every call is forced
and counted, so a silent fallback fails.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from attn_helpers import (Dims, random_bias, random_intervals, random_mask, random_qkv,
                          run_backward, run_forward)
from hopper_helpers import (FORCED, HOPPER, MASKED_SHAPES, band, fuzzed_dims, fuzzed_mask,
                            hopper_problem, shape_id, sized, tma_keys)
from kernels import prepare_mask, record_routes, schedule_for
from kernels.planning import tuning
from kernels.planning.activity import ActivityMap
from kernels.planning.forward_schedule import forward_list_tiles
from kernels.planning.hopper_forward import hopper_gap, list_tile, may_take_masks
from kernels.planning.hopper_forward_launch import mask_geometry
from kernels.planning.inputs import check_inputs
from kernels.planning.problem import OperandLayout, tma_bias, tma_mask
from kernels.planning.schedule import normalize_options, schedule


# -- host side
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


INTERVALS = {"mask": OperandLayout((2, 4, 1, 4096), 4), "tma_mask": True, "intervals": True}


@pytest.mark.parametrize("seqlen, causal, row_kept, route", [
    (4096, False, None, "triton"),   # no bound, no count: the Triton route as before
    (4096, False, 1024, "hopper"),   # key-ordered top-W1024 (calls fold causality): 9 blocks
    (2048, False, 256, "triton"),    # W256: 3 blocks
    (1024, True, 1024, "triton"),    # W >= L: the causal walk, 4.5 blocks
    (2048, True, 1024, "hopper"),    # unordered causal top-W1024: 8.5 blocks
    (4096, False, 512, "triton"),    # 5 blocks
    (4096, False, 513, "hopper"),    # 6 blocks
], ids=["unbounded", "w1024", "w256", "w-covers-l", "causal-w1024", "below", "at-limit"])
def test_intervals_that_keep_w_keys_per_row_take_the_hopper_route_where_tiles_walk_far(
        seqlen, causal, row_kept, route):
    """Intervals built per call are never counted; their row bound W (top-W selections, bool
    masks read as runs) estimates a tile's walk as min(the unmasked walk, W / 128 + 1)."""
    problem = hopper_problem(**INTERVALS, row_kept=row_kept, is_causal=causal,
                             shape=sized(seqlen_q=seqlen, seqlen_k=seqlen))
    assert hopper_gap(problem) is None
    assert schedule(problem).forward.route == route
    assert tuning.HOPPER_FORWARD_INTERVALS_MIN_KEY_BLOCKS == 6  # the cases above sit on it
    bool_mask = replace(problem, intervals=False, mask=BOOL_MASK["mask"])
    assert schedule(bool_mask).forward.route == "triton"  # a bool mask's bound is unread


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


@pytest.mark.parametrize("shape, stride, readable", [
    ((2, 2, 1, 64), None, True),
    ((1, 4, 1, 64), None, True),
    ((2, 1, 1, 64), (0, 64, 64, 1), True),          # batch expanded: read at index 0
    ((2, 2, 1, 60), None, False),                    # 120-byte rows
    ((2, 2, 1, 64), (256, 128, 128, 2), False),      # keys not contiguous
    ((2, 2, 64, 64), None, True),                    # a row per query: a full bias's tiles
    ((2, 2, 64, 60), None, False),                   # 120-byte query rows
    ((2, 2, 64, 64), (8192, 4096, 1, 64), False),    # keys not contiguous (transposed)
], ids=["per-head", "shared-batch", "batch-expanded", "odd-rows", "strided-keys", "full",
        "full-odd-rows", "full-transposed"])
def test_tma_reads_a_bias_with_contiguous_keys_and_16_byte_strides(shape, stride, readable):
    """A bias row, and a full bias (a row per query row) as the Hopper forward copies it."""
    dims = Dims(2, 64, shape[3], 4, 2, 64)
    q, k, v = random_qkv(dims, torch.bfloat16, "cpu")
    bias = torch.zeros(shape, dtype=torch.bfloat16)
    if stride is not None:
        end = 1 + sum((size - 1) * step for size, step in zip(shape, stride))
        bias = torch.zeros(end, dtype=torch.bfloat16).as_strided(shape, stride)
    assert tma_bias(check_inputs(q, k, v, None, bias, None).bias) is readable


def test_the_mask_descriptor_reads_a_stride_0_axis_at_index_0():
    view = torch.ones(1, 1, 64, 64, dtype=torch.bool).expand(3, 4, 64, 64)
    shape, strides, head_div, batches = mask_geometry(view, heads_q=8)
    assert shape == [1, 1, 64, 64] and strides[2:] == [64, 1]
    assert all(s * 1 % 16 == 0 for s in strides[:-1])
    assert head_div == 8 and batches == 0
    own = torch.ones(3, 4, 64, 64, dtype=torch.bool)
    assert mask_geometry(own, heads_q=8) == ([3, 4, 64, 64], list(own.stride()), 2, 1)


def test_the_mask_descriptor_ends_at_the_last_key():
    """The descriptor's key axis is the keys' own length, not their row's padding: TMA fills a
    box's keys past it with 0, which is all that hides keys past Lk in the forward's
    non-causal masked blocks (``softmax.fold_scores``' KEEP_ENDS_KEYS)."""
    padded = torch.ones(2, 4, 64, 80, dtype=torch.bool)[..., :63]  # rows padded to 80 bytes
    shape, strides, _, _ = mask_geometry(padded, heads_q=8)
    assert shape == [2, 4, 64, 63] and strides == [4 * 64 * 80, 64 * 80, 80, 1]
    words = torch.zeros(2, 4, 64, dtype=torch.int64)[..., :63]  # KeyIntervals' words
    view = words[:, :, None, :].expand(2, 4, 64, 63)  # their query stride is 0
    assert mask_geometry(view, heads_q=8, words=True)[0] == [2, 4, 63]


def test_key_row_masks_are_covered():
    for mask in (OperandLayout((2, 4, 1, 4096), 4), OperandLayout((1, 4, 4096, 4096), 4)):
        changes = {"mask": mask, "tma_mask": True, "intervals": mask.shape[2] == 4096}
        problem = hopper_problem(**changes)
        assert hopper_gap(problem) is None and may_take_masks(problem)


def test_a_forced_hopper_forward_walks_lists_and_refuses_a_forced_key_scan():
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
    """KeyIntervals' int64 words sit in rows of an even number of keys, so TMA reads them at
    any key length: at Lk 63 each (batch, head) row of words is 64 words (512 bytes) long."""
    dims = Dims(2, 64, 64, 4, 2, 64)
    q, k, v = random_qkv(dims, torch.bfloat16, "cpu")
    for seqlen_k in (64, 63):
        k2, v2 = k[:, :seqlen_k], v[:, :seqlen_k]
        dims_k = Dims(2, 64, seqlen_k, 4, 2, 64)
        mask = check_inputs(q, k2, v2, random_intervals(dims_k, "Hk", "B", "cpu"), None,
                            None).mask
        assert tma_mask(mask), seqlen_k
        assert mask.view.stride()[:2] == (2 * 64, 64), seqlen_k
    view = mask.view.view(torch.int32)  # the kernel reads (start, end) int32 pairs
    shape, strides, head_div, batches = mask_geometry(view, heads_q=4, words=True)
    assert shape == [2, 2, 126] and strides == [256, 128, 1] and head_div == 2 and batches == 1


# -- device side: a Hopper GPU
@pytest.mark.hopper
def test_by_default_a_prepared_band_takes_the_hopper_route_and_a_random_mask_does_not(device):
    dims = Dims(1, 4096, 4096, 4, 2, 128)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    prepared_band = prepare_mask(band(dims, 2048, device), q, k, is_causal=True)
    scattered = random_mask((1, 1, 4096, 4096), device)
    for mask, route in ((prepared_band, "hopper"), (scattered, "triton"),
                        (prepare_mask(scattered, q, k, is_causal=True), "triton")):
        assert schedule_for(q, k, v, mask, is_causal=True).forward.route == route
        with record_routes() as routes:
            run_forward(q, k, v, mask, causal=True)
        assert set(routes.forward) == {route}


@pytest.mark.hopper
@pytest.mark.parametrize("sizes", MASKED_SHAPES, ids=shape_id)
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


@pytest.mark.hopper
@pytest.mark.parametrize("window", [1, 100, 1024], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_masked_hopper_forward_walks_full_tiles_of_aband(device, window, dtype):
    dims = Dims(2, 2000, 2048, 8, 2, 128)
    q, k, v = random_qkv(dims, dtype, device)
    run_forward(q, k, v, band(dims, window, device), causal=True, func=HOPPER)


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
@pytest.mark.parametrize("sizes", MASKED_SHAPES, ids=shape_id)
@pytest.mark.parametrize("batch, heads", [("B", "Hq"), ("1", "Hk"), ("B", "1")],
                         ids=["B-Hq", "1-Hk", "B-1"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("form", ["row", "intervals", "prepared-intervals"])
def test_masked_hopper_forward_reads_key_rows(device, sizes, batch, heads, causal,
                                              form):
    """A bool mask of one row for every query row, and KeyIntervals (as the call gives them,
    and prepared), read as one [1, 128] row of a key block per slot."""
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
        device):
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
        dims = fuzzed_dims(rng, max_batch=3, max_length=1500)
        q, k, v = random_qkv(dims, rng.choice([torch.bfloat16, torch.float16]), device,
                             rng.choice(["contiguous", "bhld"]))
        mask = fuzzed_mask(rng, dims, device)
        causal = rng.random() < 0.5
        if rng.random() < 0.3:
            mask = prepare_mask(mask, q, k, is_causal=causal)
        run_forward(q, k, v, mask, causal=causal, func=HOPPER)


# -- a bias row on the Hopper forward
@pytest.mark.hopper
@pytest.mark.parametrize("sizes", MASKED_SHAPES[:3] + [(1, 97, 208, 3, 3, 40)], ids=shape_id)
@pytest.mark.parametrize("batch, heads", [("B", "Hk"), ("1", "Hq"), ("B", "1")],
                         ids=["B-Hk", "1-Hq", "B-1"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_hopper_forward_with_a_bias_row_matches_the_reference(device, sizes, batch, heads,
                                                              causal, masked):
    """flash-dmattn's (B, Hk, 1, Lk) bias and its broadcasts, with and without a bool mask,
    in both dtypes; -inf entries in the bias hide their keys."""
    dims = Dims(*sizes)
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = random_qkv(dims, dtype, device)
        bias = random_bias(dims.operand_shape(batch, heads, "1", "Lk"), dtype, device)
        bias[..., ::7] = float("-inf")
        mask = (random_mask(dims.operand_shape("B", "Hk", "Lq", "Lk"), device, 0.5)
                if masked else None)
        run_forward(q, k, v, mask, bias, causal=causal, func=HOPPER)


@pytest.mark.hopper
def test_the_backward_after_a_biased_hopper_forward_matches_the_reference(device):
    dims = Dims(2, 700, 712, 4, 2, 128)  # rows of 712 keys: 16-byte strides, as TMA reads
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    bias = random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), torch.bfloat16, device)
    with record_routes() as routes:
        run_backward(q, k, v, None, bias, causal=True, func=FORCED)
    assert set(routes.forward) == {"hopper"}, routes.describe()


@pytest.mark.hopper
def test_biased_hopper_forward_on_random_shapes(device):
    """A seeded fuzz of 100 calls with a bias row in a random broadcast (keys sliced from
    rows padded to 16 bytes), with or without a bool mask, and some -inf bias entries."""
    rng = random.Random(82)
    for _ in range(100):
        dims = fuzzed_dims(rng, max_batch=3, max_length=1500)
        if dims.seqlen_k == 1:  # a bias of one key is broadcast along the keys: Triton's
            continue
        dtype = rng.choice([torch.bfloat16, torch.float16])
        q, k, v = random_qkv(dims, dtype, device)
        shape = dims.operand_shape(rng.choice(["1", "B"]), rng.choice(["1", "Hk", "Hq"]), "1",
                                   "Lk")
        padded = tma_keys(dims.seqlen_k, 2)
        bias = random_bias((*shape[:3], padded), dtype, device)[..., :dims.seqlen_k]
        if rng.random() < 0.2:
            bias[..., rng.randrange(dims.seqlen_k)] = float("-inf")
        mask = fuzzed_mask(rng, dims, device) if rng.random() < 0.4 else None
        run_forward(q, k, v, mask, bias, causal=rng.random() < 0.5, func=HOPPER)


@pytest.mark.hopper
@pytest.mark.parametrize("consumers", [2, 3])
def test_a_full_bias_on_the_hopper_forward_on_random_shapes(device, consumers):
    """A seeded fuzz of 80 forced calls with a full bias (a row per query row) in a random
    broadcast (keys sliced from rows padded to 16 bytes, some -inf entries), with no mask, a
    bool mask (per query row at head dims up to 64, one row), or KeyIntervals: out and LSE
    against the float64 reference, every forward on the Hopper route; two warpgroups, and
    three at head dims up to 64 (which refuse a bool mask row beside a full bias)."""
    from attn_helpers import forcing

    rng = random.Random(90 + consumers)
    forced = forcing(forward_route="hopper", forward_consumers=consumers)
    for case in range(80):
        dims = fuzzed_dims(rng, max_batch=3, max_length=1500)
        if consumers == 3 and dims.head_dim > 64:
            dims = replace(dims, head_dim=rng.choice([16, 32, 40, 64]))
        if dims.seqlen_k == 1:  # one key: a bias broadcast along the keys, Triton's
            continue
        dtype = rng.choice([torch.bfloat16, torch.float16])
        q, k, v = random_qkv(dims, dtype, device)
        shape = dims.operand_shape(rng.choice(["1", "B"]), rng.choice(["1", "Hk", "Hq"]), "Lq",
                                   "Lk")
        padded = tma_keys(dims.seqlen_k, 2)
        bias = random_bias((*shape[:3], padded), dtype, device)[..., :dims.seqlen_k]
        if rng.random() < 0.2:
            bias[..., rng.randrange(dims.seqlen_q), rng.randrange(dims.seqlen_k)] = float("-inf")
        form = rng.choice(["none", "row", "intervals", "tile"])
        mask = None
        if form == "tile" and dims.head_dim <= 64 and consumers == 2:
            mask = fuzzed_mask(rng, dims, device)
        elif form == "row":
            padded_k = tma_keys(dims.seqlen_k, 1)
            mask = random_mask((*dims.operand_shape("B", "Hk", "1", "Lk")[:3], padded_k), device,
                               0.5)[..., :dims.seqlen_k]
        elif form == "intervals":
            mask = random_intervals(dims, "Hk", "B", device, seed=case)
        causal = rng.random() < 0.5
        if consumers == 3 and form == "row":  # refused: that form races (three_consumer_gap)
            with pytest.raises(ValueError, match="no full bias beside a bool mask row"):
                forced(q, k, v, mask, bias, causal)
            continue
        with record_routes() as routes:
            run_forward(q, k, v, mask, bias, causal=causal, func=forced)
        assert set(routes.forward) == {"hopper"}, (case, routes.describe())
