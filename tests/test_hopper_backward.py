"""The Hopper route of the backward (Gluon, ``kernels.hopper_device.attention_backward``) on a
Hopper GPU (marked ``hopper``; Gluon has no interpreter): dq, dk and dv against the float64
reference on awkward shapes, GQA/MQA, both dtypes, causal or not, masks, intervals, a bias row
and its gradient; every test counts the route each backward took, so a silent fallback fails
it. Where the schedule takes it is in ``test_hopper_backward_routes.py``; its offline compile
in ``test_hopper_offline.py``.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from attn_helpers import (Dims, assert_close_to_reference, forcing, random_bias,
                          random_intervals, random_mask, random_qkv, run_backward)
from hopper_helpers import MASKED_SHAPES, band, fuzzed_dims, fuzzed_mask, shape_id
from kernels import (attention_reference, dmattn_func, prepare_mask, record_routes,
                     topk_intervals)
from kernels.planning import tuning
from kernels.planning.hopper_backward import grid_order_group

FORCED = forcing(backward="hopper")


def HOPPER(*args, **kwargs):
    """``dmattn_func`` with its backward forced onto the Hopper route (counted when the
    gradients are taken, in ``_backward_on_hopper``)."""
    return FORCED(*args, **kwargs)


def _backward_on_hopper(q, k, v, causal, mask=None):
    with record_routes() as routes:
        run = run_backward(q, k, v, mask, causal=causal, func=HOPPER)
    assert routes.backward and set(routes.backward) == {"hopper"}, routes.describe()
    return run


SHAPES = [  # (batch, Lq, Lk, Hq, Hk, D)
    (1, 1, 1, 1, 1, 64),
    (2, 17, 97, 4, 2, 128),
    (1, 97, 17, 3, 3, 40),
    (2, 1025, 1025, 4, 1, 80),
    (1, 300, 700, 6, 2, 64),
    (3, 300, 129, 2, 1, 128),
    (1, 1000, 1000, 8, 8, 16),
]


@pytest.mark.hopper
@pytest.mark.parametrize("sizes", SHAPES, ids=shape_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_hopper_backward_matches_the_reference(device, sizes, causal, dtype):
    q, k, v = random_qkv(Dims(*sizes), dtype, device)
    _backward_on_hopper(q, k, v, causal)


@pytest.mark.hopper
@pytest.mark.parametrize("sizes", [(2, 1025, 1025, 4, 1, 80), (3, 300, 700, 6, 2, 64),
                                   (2, 2048, 2048, 4, 2, 128)], ids=shape_id)
@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "deterministic"])
def test_a_causal_grid_ordered_in_groups_matches_the_reference(device, monkeypatch, sizes,
                                                               deterministic):
    """``tuning.HOPPER_BACKWARD_CAUSAL_GROUP_WAVES``: groups of (batch, key head)s, each
    ordered by key block. 48 programs a group on 132 multiprocessors: at B2 Hk2 L2048 groups of
    3 and 1 (the last one smaller), the other shapes one group."""
    monkeypatch.setattr(tuning, "HOPPER_BACKWARD_CAUSAL_GROUP_WAVES", 0.37)
    q, k, v = random_qkv(Dims(*sizes), torch.bfloat16, device)
    with record_routes() as routes:
        run_backward(q, k, v, causal=True, deterministic=deterministic, func=FORCED)
    assert set(routes.backward) == {"hopper"}, routes.describe()


@pytest.mark.hopper
def test_hopper_backward_reads_strided_views(device):
    q, k, v = random_qkv(Dims(2, 333, 333, 4, 2, 64), torch.bfloat16, device, "bhld")
    _backward_on_hopper(q, k, v, True)


@pytest.mark.hopper
def test_an_unaligned_gradient_runs_the_triton_backward(device):
    q, k, v = random_qkv(Dims(1, 200, 200, 2, 2, 64), torch.bfloat16, device)
    grad = torch.randn(q.numel() + 1, device=device).to(q.dtype)[1:].view(q.shape)
    with record_routes() as routes:
        run_backward(q, k, v, causal=True, grad_out=grad, func=HOPPER)
    assert routes.backward and "hopper" not in routes.backward


@pytest.mark.hopper
def test_hopper_backward_on_random_shapes(device):
    """A seeded fuzz: lengths 1-2000, head dims 8-128 (multiples of 8), GQA/MQA, both dtypes,
    causal or not."""
    rng = random.Random(66)
    for _ in range(30):
        dims = fuzzed_dims(rng, max_batch=2, max_length=2000)
        q, k, v = random_qkv(dims, rng.choice([torch.bfloat16, torch.float16]), device)
        _backward_on_hopper(q, k, v, rng.random() < 0.5)


# -- the masked form (bool masks and KeyIntervals through the activity lists)

@pytest.mark.hopper
@pytest.mark.parametrize("sizes", MASKED_SHAPES, ids=shape_id)
@pytest.mark.parametrize("batch, heads", [("B", "Hq"), ("1", "Hk"), ("B", "1"), ("1", "1")],
                         ids=["B-Hq", "1-Hk", "B-1", "1-1"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("keep", [0.02, 0.5, 1.0], ids=["keep2", "keep50", "keep100"])
def test_masked_hopper_backward_matches_the_reference(device, sizes, batch,
                                                      heads, causal, keep):
    dims = Dims(*sizes)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    mask = random_mask(dims.operand_shape(batch, heads, "Lq", "Lk"), device, keep)
    _backward_on_hopper(q, k, v, causal, mask)


@pytest.mark.hopper
@pytest.mark.parametrize("window", [1, 100, 1024], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("prepared", [False, True], ids=["per-call", "prepared"])
def test_masked_hopper_backward_walks_the_full_blocks_of_a_band(device, window, prepared):
    dims = Dims(2, 2048, 2048, 4, 2, 128)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    mask = band(dims, window, device)
    if prepared:
        mask = prepare_mask(mask, q, k, is_causal=True)
    _backward_on_hopper(q, k, v, True, mask)



@pytest.mark.hopper
@pytest.mark.parametrize("split_heads", [False, True], ids=["whole", "split"])
def test_repeated_backwards_of_one_prepared_mask_each_match_the_reference(device, split_heads):
    """Calls of one plan reuse its kept scratch views and mask arguments: each of three
    backwards, with new inputs, a new gradient and the bias written in place between them,
    matches the reference (a stale descriptor or an accumulator not zeroed again fails)."""
    dims = Dims(2, 720, 720, 4, 2, 128)  # mask rows of 720 bytes: TMA reads them
    func = forcing(backward="hopper", backward_split_heads=split_heads)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    mask = prepare_mask(random_mask(dims.operand_shape("B", "Hk", "Lq", "Lk"), device, 0.3),
                        q, k, is_causal=True)
    bias = random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), torch.bfloat16, device)
    for seed in range(3):
        torch.manual_seed(seed)
        for t in (q, k, v):
            t.detach().normal_()
        bias.detach().normal_()
        with record_routes() as routes:
            run_backward(q, k, v, mask, bias, causal=True, func=func)
        assert set(routes.backward) == {"hopper"}, routes.describe()

# Both passes forced: the Hopper forward builds lists for KeyIntervals a call gives (the Triton
# forward may read them itself, leaving the backward no lists: it then runs the Triton one).
BOTH = forcing(forward_route="hopper", backward="hopper")


@pytest.mark.hopper
@pytest.mark.parametrize("sizes", MASKED_SHAPES, ids=shape_id)
@pytest.mark.parametrize("batch, heads", [("B", "Hq"), ("1", "Hk"), ("B", "1")],
                         ids=["B-Hq", "1-Hk", "B-1"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("prepared", [False, True], ids=["per-call", "prepared"])
def test_hopper_backward_of_intervals_matches_the_reference(device, sizes,
                                                            batch, heads, causal, prepared):
    """KeyIntervals: each warpgroup loads its keys' (start, end) words once per query head
    and tests the list's partial blocks with them."""
    dims = Dims(*sizes)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    mask = random_intervals(dims, heads, batch, device, seed=sizes[1])
    if prepared:
        mask = prepare_mask(mask, q, k, is_causal=causal)
    with record_routes() as routes:
        run_backward(q, k, v, mask, causal=causal, func=BOTH)
    assert set(routes.backward) == {"hopper"}, routes.describe()


@pytest.mark.hopper
def test_masked_hopper_backward_on_random_shapes(device):
    """A seeded fuzz of 100 backwards: lengths up to 1500 (odd key lengths through a mask
    sliced from rows padded to 16 bytes), head dims 8-128, GQA/MQA, every batch and head
    broadcast of the mask (a stride-0 expand too), keep 0-100% (empty rows and key blocks
    no row sees), causal or not, both dtypes, prepared masks."""
    rng = random.Random(166)
    for _ in range(100):
        dims = fuzzed_dims(rng, max_batch=2, max_length=1500)
        q, k, v = random_qkv(dims, rng.choice([torch.bfloat16, torch.float16]), device)
        mask = fuzzed_mask(rng, dims, device)
        causal = rng.random() < 0.5
        if rng.random() < 0.3:
            mask = prepare_mask(mask, q, k, is_causal=causal)
        _backward_on_hopper(q, k, v, causal, mask)


@pytest.mark.hopper
@pytest.mark.parametrize("sizes, window", [((2, 1000, 1000, 8, 2, 128), 100),
                                           ((1, 1500, 1500, 6, 3, 64), 300),
                                           ((3, 700, 700, 4, 1, 80), 64)],
                         ids=lambda v: shape_id(v) if isinstance(v, tuple) else f"W{v}")
@pytest.mark.parametrize("split", [None, False], ids=["default", "whole-groups"])
def test_key_ordered_top_w_backward_walks_longest_first_and_matches(device, monkeypatch,
                                                                    no_kept_plans, sizes,
                                                                    window, split):
    """Key-ordered top-W intervals of a kv_row bias (the transformers integration's form),
    whose grid goes by key block over all units (``grid_order_group``): dq, dk, dv and the
    bias gradient against the reference, split heads (the default) and whole groups. The
    lengths keep the intervals' int32 rows 16-byte aligned, as TMA reads them."""
    from kernels.planning import hopper_backward

    groups = []
    original = hopper_backward.grid_order_group

    def recorded(problem, key_blocks, units):
        groups.append((original(problem, key_blocks, units), units))
        return groups[-1][0]
    monkeypatch.setattr(hopper_backward, "grid_order_group", recorded)
    dims = Dims(*sizes)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    bias = random_bias((dims.batch, dims.heads_kv, 1, dims.seqlen_k), torch.bfloat16,
                       device).requires_grad_()
    intervals = topk_intervals(bias.detach(), window, order_keys=True)
    options = {"backward": "hopper"}
    if split is not None:
        options["backward_split_heads"] = split
    with record_routes() as routes:
        run_backward(q, k, v, intervals, bias, causal=True, func=forcing(**options))
    assert set(routes.backward) == {"hopper"}, routes.describe()
    units = dims.batch * (dims.heads_q if split is None else dims.heads_kv)
    assert groups and all(group == every == units for group, every in groups), groups


def assert_backwards_repeat_bitwise(q, k, v, bias, causal, func=FORCED):
    """Five forced Hopper backwards of one deterministic call give bitwise equal dq, dk, dv
    (and the bias's gradient)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v, bias) if t is not None]
    out = func(*leaves[:3], None, leaves[3] if bias is not None else None, causal,
               deterministic=True)
    grad = torch.randn_like(out)
    first = torch.autograd.grad(out, leaves, grad, retain_graph=True)
    for _ in range(4):
        again = torch.autograd.grad(out, leaves, grad, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


# -- the ordered dQ (deterministic=True)
@pytest.mark.hopper
@pytest.mark.parametrize("sizes", [(2, 1025, 1025, 4, 1, 80), (1, 300, 700, 6, 2, 64),
                                   (2, 2048, 2048, 4, 2, 128)],
                         ids=shape_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias-row"])
def test_deterministic_hopper_backward_is_bitwise_repeatable(device, sizes, causal, with_bias):
    """Five backwards of one call give bitwise equal dq, dk, dv (and a bias row's gradient),
    which match the reference (``run_backward``)."""
    dims = Dims(*sizes)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    bias = (random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), torch.bfloat16, device)
            if with_bias else None)
    with record_routes() as routes:
        run_backward(q, k, v, bias=bias, causal=causal, deterministic=True, func=FORCED)
    assert set(routes.backward) == {"hopper"}, routes.describe()
    assert_backwards_repeat_bitwise(q, k, v, bias, causal)


# -- a bias row and its gradient
@pytest.mark.hopper
@pytest.mark.parametrize("sizes", [(2, 300, 512, 4, 2, 128), (1, 1025, 1040, 4, 1, 80),
                                   (2, 17, 64, 2, 2, 64)],
                         ids=shape_id)
@pytest.mark.parametrize("batch, heads", [("B", "Hk"), ("1", "Hq"), ("B", "1")],
                         ids=["B-Hk", "1-Hq", "B-1"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_hopper_backward_of_a_bias_row_matches_the_reference(device, sizes, batch,
                                                             heads, causal, masked):
    """flash-dmattn's (B, Hk, 1, Lk) bias and its broadcasts, with its gradient (summed over
    the rows, and over the group where the bias has fewer heads than the queries), with and
    without a bool mask."""
    dims = Dims(*sizes)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    bias = random_bias(dims.operand_shape(batch, heads, "1", "Lk"), torch.bfloat16,
                       device).requires_grad_()
    mask = (random_mask(dims.operand_shape("B", "Hk", "Lq", "Lk"), device, 0.5) if masked
            else None)
    with record_routes() as routes:
        run_backward(q, k, v, mask, bias, causal=causal, func=FORCED)
    assert set(routes.backward) == {"hopper"}, routes.describe()


# -- the seeded fuzz of every form together
@pytest.mark.hopper
@pytest.mark.parametrize("part", [0, 1, 2], ids=lambda p: f"part{p}")
def test_hopper_backward_fuzz_of_every_form(device, part):
    """300 seeded backwards forced onto the Hopper route, in three parts of 100: lengths up to
    1500 (odd ones too), head dims 8-128, GQA/MQA, both dtypes, causal or not; no mask, a bool
    mask (every broadcast, keep 0-100%: empty rows and key blocks no row sees; per call or
    prepared) or KeyIntervals (prepared, or listed by a forced Hopper forward); a bias row in
    every broadcast with its gradient; deterministic=True without a mask, five backwards
    bitwise equal. Each against the float64 reference, and each took the Hopper route."""
    _fuzz_every_form(random.Random(660 + part), 100, device)


@pytest.mark.hopper
@pytest.mark.parametrize("part", [0, 1], ids=lambda p: f"part{p}")
def test_split_heads_on_every_form(device, part):
    """``kernel_options['backward_split_heads']`` True, a program per query head of each key
    block and dK, dV reduce-added in float32: 200 of the fuzz's backwards, in two parts of
    100, each with a GQA group of 2-4 heads and no deterministic=True."""
    _fuzz_every_form(random.Random(860 + part), 100, device,
                     options={"backward_split_heads": True})


@pytest.mark.hopper
@pytest.mark.parametrize("part", [0, 1], ids=lambda p: f"part{p}")
def test_the_unspread_dq_staging_on_every_form(device, part):
    """``kernel_options['backward_dq_spread']`` False, the staging head dim 128 takes without
    the spread: 120 of the fuzz's backwards at head dim 128, in two parts of 60."""
    _fuzz_every_form(random.Random(760 + part), 60, device, head_dim=128,
                     options={"backward_dq_spread": False})


def _fuzz_every_form(rng, count, device, head_dim=None, options=None):
    """``count`` of the fuzz's backwards (``test_hopper_backward_fuzz_of_every_form``), at
    ``head_dim`` where given, with these ``kernel_options`` besides the forced routes."""
    options = options or {}
    forced = forcing(backward="hopper", **options)
    both = forcing(forward_route="hopper", backward="hopper", **options)
    split = options.get("backward_split_heads", False)  # needs a group, not deterministic
    for _ in range(count):
        dims = fuzzed_dims(rng, max_batch=2, max_length=1500)
        if head_dim is not None:
            dims = replace(dims, head_dim=head_dim)
        if split and dims.heads_q == dims.heads_kv:
            dims = replace(dims, heads_q=dims.heads_kv * rng.choice([2, 3, 4]))
        dtype = rng.choice([torch.bfloat16, torch.float16])
        q, k, v = random_qkv(dims, dtype, device)
        causal = rng.random() < 0.5
        # A bool mask of one query row, a bias row of one key or its gradient over one query
        # row run the Triton backward.
        kind = rng.choice(["none", "bool", "intervals"] if dims.seqlen_q > 1 else
                          ["none", "intervals"])
        bias = None
        if min(dims.seqlen_q, dims.seqlen_k) > 1 and rng.random() < 0.4:
            shape = dims.operand_shape(rng.choice(["1", "B"]), rng.choice(["1", "Hk", "Hq"]),
                                       "1", "Lk")
            bias = random_bias(shape, dtype, device)
        deterministic = kind == "none" and rng.random() < 0.3 and not split
        mask, func = None, forced
        if kind == "bool":
            mask = fuzzed_mask(rng, dims, device)
            if rng.random() < 0.3:
                mask = prepare_mask(mask, q, k, is_causal=causal)
        elif kind == "intervals":
            # KeyIntervals' words are (Bm, Hm, Lk) int64: TMA reads them with a batch or head
            # axis only where Lk is even (16-byte strides), so odd key lengths share one row.
            heads, batch = rng.choice(["1", "Hk", "Hq"]), rng.choice(["1", "B"])
            if dims.seqlen_k % 2:
                heads, batch = "1", "1"
            mask = random_intervals(dims, heads, batch, device, seed=rng.randrange(1 << 30))
            if bias is not None or rng.random() < 0.5:  # the Hopper forward takes no bias
                mask = prepare_mask(mask, q, k, is_causal=causal)
            else:
                func = both
        case = f"{dims} {dtype} causal={causal} {kind} bias={bias is not None and bias.shape}"
        with record_routes() as routes:
            run_backward(q, k, v, mask, bias, causal=causal, deterministic=deterministic,
                         func=func)
        assert set(routes.backward) == {"hopper"}, f"{case}: {routes.describe()}"
        if deterministic:
            assert_backwards_repeat_bitwise(q, k, v, bias, causal, forced)


@pytest.mark.hopper
@pytest.mark.parametrize("bias_row", [False, True], ids=["no-bias", "kv_row"])
def test_a_captured_backward_splits_on_the_hopper_route_and_replays_correctly(
        device, monkeypatch, no_kept_plans, bias_row):
    """bias.yaml's B1 H8/2 L2048 D128 causal grid (its longest walk 7.8x the even share with
    whole groups, 1.9x split) with ``tuning.HOPPER_BACKWARD_SPLIT_CAPTURED``: warmed up
    eagerly on the Triton backward, then captured into a CUDA graph, where its backward is
    planned (and the split Hopper kernel compiled where no earlier test did) inside the
    capture; the replay's gradients against the float64 reference."""
    monkeypatch.setattr(tuning, "HOPPER_BACKWARD_SPLIT_CAPTURED", True)
    dims = Dims(batch=1, seqlen_q=2048, seqlen_k=2048, heads_q=8, heads_kv=2, head_dim=128)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    bias = (random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), torch.bfloat16, device)
            if bias_row else None)
    grad_out = torch.randn_like(q)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, bias) if t is not None]

    def step():
        out = dmattn_func(*leaves[:3], attn_bias=leaves[3] if bias_row else None,
                          is_causal=True)
        return (out, *torch.autograd.grad(out, leaves, grad_out))

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), record_routes() as eager_routes:
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    assert set(eager_routes.backward) == {"dq+dkdv"}, eager_routes.describe()
    graph = torch.cuda.CUDAGraph()
    with record_routes() as routes, torch.cuda.graph(graph):
        captured = step()
    for tensor in captured:
        tensor.fill_(float("nan"))  # poisoned: the replay must write every element
    graph.replay()
    torch.cuda.synchronize(device)
    assert set(routes.backward) == {"hopper"}, routes.describe()
    upcast = [t.detach().float().requires_grad_() for t in leaves]
    truth = attention_reference(*upcast[:3], None, upcast[3] if bias_row else None, True)
    want = (truth, *torch.autograd.grad(truth, upcast, grad_out.to(truth.dtype)))
    low_leaves = [t.detach().requires_grad_() for t in leaves]
    low = attention_reference(*low_leaves[:3], None, low_leaves[3] if bias_row else None, True,
                              upcast=False)
    baseline = (low, *torch.autograd.grad(low, low_leaves, grad_out))
    for name, got, ref, eager in zip(("out", "dq", "dk", "dv", "dbias"), captured, want,
                                     baseline):
        assert got.isfinite().all(), name
        assert_close_to_reference(name, got, ref, eager, torch.bfloat16)
