"""The Hopper route of the forward (Gluon, ``kernels.hopper_device``).

Host side, on every machine: which problems the schedule sends to it, what forcing it says
where it does not apply, the TMA layout rule, and that its modules import under the installed
Triton. Device side (marked ``hopper``; Gluon has no interpreter): its outputs, LSE and the
gradients of a backward after it, against the float64 reference, on awkward shapes. Masks on
the route are ``test_hopper_masks``'; three consumer warpgroups
``test_hopper_three_warpgroups``'.
"""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch

from attn_helpers import Dims, random_qkv, run_backward, run_forward
from hopper_helpers import (FORCED, HOPPER, band, count_hopper_launches, fuzzed_dims,
                            hopper_in_tile_order, hopper_problem, shape_id, sized)
from kernels import dmattn_func, prepare_mask, record_routes, schedule_for
from kernels.planning import tuning
from kernels.planning import hopper_forward
from kernels.planning.hopper_forward import hopper_gap
from kernels.planning.problem import OperandLayout, tma_strides
from kernels.planning.schedule import normalize_options, schedule


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
    ({"bias": OperandLayout((2, 4, 4096, 4096), 4)}, "full bias through TMA"),
    ({"bias": OperandLayout((2, 4, 1, 4096), 4)}, "bias row through TMA"),
    ({"bias": OperandLayout((2, 4, 4096, 1), 4), "tma_bias": True}, "broadcast along the keys"),
    ({"bias": OperandLayout((2, 4, 4096, 4096), 4), "tma_bias": True,
      "mask": OperandLayout((2, 4, 4096, 4096), 4), "tma_mask": True},
     "full bias beside a bool mask per query row takes head dims up to 64"),
    ({"shape": sized(head_dim=256)}, "head dims up to 128"),
    ({"shape": sized(head_dim=20)}, "multiples of 8"),
    ({"tma_operands": False}, "TMA"),
    ({"softmax_scale": 0.0}, "positive softmax_scale"),
    ({"softmax_scale": -0.1}, "positive softmax_scale"),
    ({"shape": sized(batch=2**16, heads_q=2**12, heads_kv=2**10)}, "tiles of 128 query rows"),
], ids=["ampere", "blackwell", "no-gpu", "interpreter", "fp32", "mask", "untma-full-bias",
        "untma-bias-row", "key-broadcast-bias", "full-bias-mask-tile-d128", "d256", "d20",
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
    assert replace(hopper, hopper=None, tile_order=None) == triton


def test_causal_calls_of_up_to_the_bound_of_k_and_v_bytes_deal_their_tiles_balanced(
        monkeypatch):
    """Causal calls whose K and V fit the bound deal their tiles balanced; a call over it, or
    not causal, keeps a head's tiles consecutive; the option forces either."""
    causal = hopper_problem(is_causal=True, shape=sized(batch=1, heads_q=8, heads_kv=2))
    assert schedule(causal).forward.tile_order == "balanced"
    big = replace(causal, shape=sized(batch=8, heads_q=16, heads_kv=4, seqlen_q=16384,
                                      seqlen_k=16384))
    assert schedule(big).forward.tile_order == "heads"
    kv_bytes = 2 * 1 * 2 * 4096 * 128 * 2
    monkeypatch.setattr(tuning, "HOPPER_FORWARD_BALANCED_MAX_KV_BYTES", kv_bytes)
    assert schedule(causal).forward.tile_order == "balanced"
    assert schedule(replace(causal, is_causal=False)).forward.tile_order == "heads"
    longer = replace(causal, shape=replace(causal.shape, seqlen_k=4097))
    assert hopper_forward.tile_order(longer, {}) == "heads"
    assert schedule(causal, {"forward_tile_order": "heads"}).forward.tile_order == "heads"
    assert schedule(hopper_problem(), {"forward_tile_order": "balanced"}).forward.tile_order \
        == "balanced"
    assert "tile_order=balanced" in str(schedule(causal))


def test_key_intervals_deal_their_tiles_balanced_and_bool_masks_by_heads():
    """KeyIntervals' walks follow the rows' kept keys (key-ordered top-W intervals run with
    is_causal False): dealt balanced up to the bound of K and V bytes, as causal calls are; a
    bool mask that is not causal keeps a head's tiles consecutive."""
    intervals = OperandLayout((1, 4, 1, 4096), 4)
    problem = hopper_problem(mask=intervals, tma_mask=True, intervals=True,
                             interval_pair=True, row_kept=1024)
    assert hopper_forward.tile_order(problem, {}) == "balanced"
    assert hopper_forward.tile_order(replace(problem, is_causal=True), {}) == "balanced"
    big = replace(problem, shape=sized(batch=8, seqlen_q=16384, seqlen_k=16384))
    assert hopper_forward.tile_order(big, {}) == "heads"
    assert hopper_forward.tile_order(problem, {"forward_tile_order": "heads"}) == "heads"
    bool_row = replace(problem, intervals=False, interval_pair=False, row_kept=None)
    assert hopper_forward.tile_order(bool_row, {}) == "heads"


@pytest.mark.parametrize("value", ["snake", None, 1])
def test_the_tile_order_option_takes_an_order_name(value):
    with pytest.raises(ValueError, match=r"kernel_options\['forward_tile_order'\]: expected "
                                         r"'heads' or 'balanced'"):
        normalize_options({"forward_tile_order": value})


def test_a_tile_order_for_a_call_on_the_triton_route_is_refused():
    with pytest.raises(ValueError, match=r"'forward_tile_order'\] orders the Hopper forward"):
        schedule(hopper_problem(), {"forward_route": "triton", "forward_tile_order": "heads"})
    assert schedule(hopper_problem(), {"forward_route": "triton"}).forward.tile_order is None
    assert "tile_order" not in str(schedule(hopper_problem(), {"forward_route": "triton"}))


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

    from kernels.runtime.forms import specialization

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


def test_a_bias_row_takes_the_hopper_forward_at_wide_heads_only():
    """A bias row TMA reads takes the Hopper forward by the dense rules at head dims of at least
    ``tuning.HOPPER_FORWARD_BIAS_MIN_HEAD_DIM`` and the Triton route below; a row TMA cannot
    read is a gap, named."""
    problem = hopper_problem(bias=OperandLayout((2, 4, 1, 4096), 4), tma_bias=True)
    assert hopper_gap(problem) is None
    assert schedule(problem).forward.route == "hopper"
    narrow = replace(problem, shape=sized(head_dim=64))
    assert hopper_gap(narrow) is None
    assert schedule(narrow).forward.route == "triton"
    unread = replace(problem, tma_bias=False)
    assert "bias row through TMA" in hopper_gap(unread)
    assert schedule(unread).forward.route == "triton"


@pytest.mark.parametrize("head_dim, batch, heads, length, window, takes", [
    (64, 1, (2, 1), 16384, 4096, True),     # 128 tiles x 2 heads x 33 blocks: 8448 visits
    (64, 2, (16, 4), 8192, 1024, True),     # 2048 tiles x 9 blocks: 18432
    (64, 1, (2, 1), 32768, 1024, False),    # 512 tiles x 9 blocks: 4608
    (64, 1, (16, 4), 4096, 1024, False),    # 512 tiles x 9 blocks: 4608
    (32, 1, (16, 4), 16384, 1024, False),   # 18432 visits, but below the head-dim floor
    (64, 1, (2, 1), 16384, 16384, False),   # 16512 visits, but every key kept (W = L)
])
def test_a_bias_row_beside_long_kept_walks_takes_the_hopper_forward_at_head_dim_64(
        head_dim, batch, heads, length, window, takes):
    """Below ``tuning.HOPPER_FORWARD_BIAS_MIN_HEAD_DIM``, a bias row beside KeyIntervals that
    keep at most W keys a row takes the Hopper forward where the head dim reaches
    ``tuning.HOPPER_FORWARD_BIAS_LONG_MIN_HEAD_DIM``, W is at most
    ``tuning.HOPPER_FORWARD_BIAS_LONG_MAX_KEPT_SHARE`` of the keys and the call's tiles x
    estimated key blocks reach ``tuning.HOPPER_FORWARD_BIAS_LONG_MIN_VISITS``; without the
    bound on the kept keys it keeps the Triton route."""
    shape = sized(batch=batch, heads_q=heads[0], heads_kv=heads[1], seqlen_q=length,
                  seqlen_k=length, head_dim=head_dim)
    problem = hopper_problem(shape=shape, is_causal=True, tma_bias=True,
                             bias=OperandLayout((batch, heads[1], 1, length), heads[0] // heads[1]),
                             mask=OperandLayout((batch, heads[1], 1, length), heads[0] // heads[1]),
                             tma_mask=True, intervals=True, row_kept=window)
    assert hopper_gap(problem) is None
    assert (schedule(problem).forward.route == "hopper") == takes
    assert schedule(replace(problem, row_kept=None)).forward.route == "triton"


def test_the_gluon_kernel_imports_under_this_triton():
    from kernels.hopper_device.attention_forward import attention_forward

    assert attention_forward.arg_names[:5] == ["q_desc", "k_desc", "v_desc", "o_desc",
                                               "lse_ptr"]
    assert {"CAUSAL", "STAGES", "CONSUMER_REGS", "LOADER_REGS"} <= set(
        attention_forward.arg_names)


# -- device side: a Hopper GPU
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
@pytest.mark.parametrize("sizes", SHAPES, ids=shape_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_hopper_forward_matches_the_reference(device, sizes, causal, dtype):
    dims = Dims(*sizes)
    q, k, v = random_qkv(dims, dtype, device)
    assert schedule_for(q, k, v, is_causal=causal,
                        kernel_options={"forward_route": "hopper"}).forward.route == "hopper"
    run_forward(q, k, v, causal=causal, func=HOPPER)


@pytest.mark.hopper
@pytest.mark.parametrize("sizes", SHAPES + [(1, 4096, 4096, 8, 2, 128), (3, 1500, 2600, 5, 1, 64)],
                         ids=shape_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("order", ["heads", "balanced"])
def test_each_tile_order_matches_the_reference(device, sizes, causal, order):
    """Every tile dealt once: fewer tiles than programs, one partial round forwards (an even
    number of whole rounds) and one backwards (odd), into outputs poisoned before the call."""
    dims = Dims(*sizes)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    run_forward(q, k, v, causal=causal, func=hopper_in_tile_order(order))


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
    launched = count_hopper_launches(monkeypatch)
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
def test_hopper_forward_on_random_shapes(device):
    """A seeded fuzz: lengths 1-3000, head dims 8-128 (multiples of 8), GQA/MQA, both dtypes,
    causal or not."""
    rng = random.Random(55)
    for _ in range(40):
        dims = fuzzed_dims(rng, max_batch=3, max_length=3000)
        dtype = rng.choice([torch.bfloat16, torch.float16])
        q, k, v = random_qkv(dims, dtype, device)
        run_forward(q, k, v, causal=rng.random() < 0.5, func=HOPPER)


# -- device side: what the route must work under
@pytest.mark.hopper
def test_torch_compile_fullgraph_runs_the_hopper_forward(device, monkeypatch):
    torch._dynamo.reset()
    dims = Dims(1, 1000, 1000, 4, 2, 128)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    launched = count_hopper_launches(monkeypatch)
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
    mask = prepare_mask(band(dims, 300, device), q, k, is_causal=True) if masked else None
    launched = count_hopper_launches(monkeypatch)
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
    launched = count_hopper_launches(monkeypatch)
    with torch.no_grad():
        got = ours.to(device, torch.bfloat16)(tokens).logits
        baseline = eager.to(device, torch.bfloat16)(tokens).logits
        truth = eager.to(device, torch.float64)(tokens).logits
    assert len(launched) == 2  # one per layer
    scale = truth.abs().max()
    check = check_tensor("logits", got.double() / scale, truth / scale,
                         baseline.double() / scale, torch.bfloat16)
    assert check.passed, check.describe()
