"""The packed backward (``kernels.planning.backward_packed``): a few query rows per GQA group (decode),
one launch in which each program owns a share of the key blocks of one (batch, kv head), writes
their dk and dv whole, adds its part of the group's dq, and stores its blocks' part of the bias
gradient. Every case checks that the packed plan was the one made, and every gradient against
float64 autograd of the reference; odd key lengths leave partial last blocks, and long ones
split the keys into shares whose dq partials must all land in the sum. Masks of every head
layout are read densely, and blocks that no row keeps must read no K or V."""

from __future__ import annotations

import pytest
import torch

from attn_helpers import (CAUSAL, DTYPES, MASKED_BAND, Dims, assert_deterministic_grads,
                          backward_schedule, grads_of, nan_in_band, random_mask, random_problem,
                          random_qkv, run_backward)
from kernels import dmattn_func, prepare_mask
from kernels.planning.inputs import AttnShape
from kernels.planning.backward_schedule import BackwardRoute, takes_packed
from kernels.planning.problem import OperandLayout, Problem

# (dims, whether the keys split into shares: on the GPU and under the interpreter alike, which
# differ in key block and multiprocessor count)
CASES = [
    pytest.param(Dims(1, 1, 1031, heads_q=4, heads_kv=2, head_dim=40), True, id="gqa-split"),
    pytest.param(Dims(2, 1, 97, heads_q=8, heads_kv=8, head_dim=80), False, id="mha"),
    pytest.param(Dims(1, 1, 513, heads_q=16, heads_kv=1, head_dim=64), True, id="mqa16-split"),
    pytest.param(Dims(1, 3, 1100, heads_q=6, heads_kv=2, head_dim=128), True, id="lq3-g3-split"),
    pytest.param(Dims(1, 1, 2050, heads_q=2, heads_kv=2, head_dim=256), True, id="d256-split"),
    pytest.param(Dims(3, 4, 17, heads_q=4, heads_kv=1, head_dim=16), False, id="lq4-rows16"),
    pytest.param(Dims(1, 1, 1, heads_q=2, heads_kv=1, head_dim=40), False, id="one-key"),
]


def packed(q, k, v, mask=None, bias=None, causal=False, **kwargs):
    """The packed route's launch of this call; fails where another route would run."""
    bwd = backward_schedule(q, k, v, mask, bias, causal, **kwargs)
    assert bwd.route is BackwardRoute.PACKED, f"this call takes the {bwd.route} backward"
    return bwd.packed


@pytest.mark.parametrize("dims,split", CASES)
@pytest.mark.parametrize("causal", CAUSAL)
def test_packed_grads(dims, split, causal, device):
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    run_backward(q, k, v, None, None, causal)
    assert (packed(q, k, v, None, None, causal).key_splits > 1) == split


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_grads_dtypes(dtype, device):
    dims = Dims(2, 2, 211, heads_q=8, heads_kv=2, head_dim=80)
    q, k, v = random_qkv(dims, dtype, device)
    run_backward(q, k, v, None, None, True)
    packed(q, k, v, None, None, True)


def test_packed_rows_before_their_keys_are_empty(device):
    """Causal with Lq > Lk: the first rows see no key, and their dq must be exactly 0."""
    dims = Dims(1, 5, 3, heads_q=3, heads_kv=3, head_dim=40)
    q, k, v = random_qkv(dims, torch.float16, device)
    run = run_backward(q, k, v, None, None, True)
    packed(q, k, v, None, None, True)
    assert (run.grads.dq[:, :2] == 0).all()


@pytest.mark.parametrize("layout", ("bhld", "sliced", "strided"))
def test_packed_grads_qkv_layouts(layout, device):
    dims = Dims(2, 1, 300, heads_q=4, heads_kv=2, head_dim=40)
    q, k, v = random_qkv(dims, torch.bfloat16, device, layout)
    run_backward(q, k, v, None, None, True, scale=0.7)
    packed(q, k, v, None, None, True)


def test_packed_split_is_deterministic(device):
    """The key shares' dq partials are summed in share order: identical bits run to run."""
    dims = Dims(1, 1, 1031, heads_q=4, heads_kv=1, head_dim=40)
    q, k, v = random_qkv(dims, torch.float16, device)
    assert_deterministic_grads(q, k, v, None, None, True)
    assert packed(q, k, v, None, None, True, deterministic=True).key_splits > 1


# (dims, mask shape, bias shape): decode and few-row shapes with each head layout of a mask
# and each bias gradient the packed launch writes (one row per group, a row per tile row, zero).
MASKED_CASES = [
    pytest.param(Dims(2, 1, 1031, heads_q=8, heads_kv=2, head_dim=64), "BxHkx1xLk", "BxHkx1xLk",
                 id="decode-gqa-kvrow-split"),
    pytest.param(Dims(1, 1, 300, heads_q=4, heads_kv=1, head_dim=40), "1xHqx1xLk", "1xHqx1xLk",
                 id="decode-mqa-per-head"),
    pytest.param(Dims(2, 1, 97, heads_q=4, heads_kv=4, head_dim=80), "Bx1x1xLk", "1x1x1xLk",
                 id="decode-mha-shared"),
    pytest.param(Dims(1, 3, 515, heads_q=6, heads_kv=2, head_dim=16), "1xHkxLqxLk", "Bx1x1xLk",
                 id="lq3-g3-one-row"),
    pytest.param(Dims(2, 4, 65, heads_q=4, heads_kv=1, head_dim=16), "BxHqxLqxLk", "BxHqxLqxLk",
                 id="lq4-full-per-row"),
    pytest.param(Dims(1, 2, 200, heads_q=4, heads_kv=4, head_dim=40), "Bx1xLqxLk", "Bx1xLqxLk",
                 id="lq2-mha-head-shared"),
    pytest.param(Dims(1, 1, 150, heads_q=2, heads_kv=1, head_dim=40), "BxHkx1xLk", "BxHkx1x1",
                 id="decode-key-broadcast-zero"),
]


@pytest.mark.parametrize("dims,mask_shape,bias_shape", MASKED_CASES)
@pytest.mark.parametrize("causal", CAUSAL)
def test_packed_masked_biased_grads(dims, mask_shape, bias_shape, causal, device):
    q, k, v, mask, bias = random_problem(dims, torch.bfloat16, device, mask_shape, bias_shape,
                                         keep=0.3)
    run_backward(q, k, v, mask, bias, causal)
    packed(q, k, v, mask, bias, causal)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_bias_grad_dtypes(dtype, device):
    """The one-row gradient is stored in the bias dtype where it is the bias's own shape."""
    dims = Dims(1, 1, 1031, heads_q=8, heads_kv=2, head_dim=40)
    q, k, v, mask, bias = random_problem(dims, dtype, device, "BxHkx1xLk", "BxHkx1xLk")
    run_backward(q, k, v, mask, bias, True)
    assert packed(q, k, v, mask, bias, True).key_splits > 1


def test_packed_bias_without_grad(device):
    """A bias that needs no gradient is added, with rows of their own (no one-row bias)."""
    dims = Dims(2, 2, 333, heads_q=8, heads_kv=4, head_dim=40)
    q, k, v, mask, bias = random_problem(dims, torch.float16, device, "1xHkxLqxLk",
                                         "BxHqxLqxLk")
    grad_out = torch.randn(q.shape, device=device).to(q.dtype)

    def with_fixed_bias(q, k, v, mask, _, causal, scale, **kwargs):
        return dmattn_func(q, k, v, mask, bias, causal, scale, **kwargs)

    got = grads_of(with_fixed_bias, q, k, v, mask, None, True, None, grad_out)
    # The same call with the bias as a leaf, checked against the reference.
    run = run_backward(q, k, v, mask, bias, True, grad_out=grad_out)
    for name in ("dq", "dk", "dv"):
        assert torch.equal(getattr(got, name), getattr(run.grads, name)), name
    packed(q, k, v, mask, bias, True, bias_grad=False)
    packed(q, k, v, mask, bias, True)


def test_packed_expanded_bias_grad(device):
    """A stride-0 expand() of a (B, Hk, 1, Lk) bias gets its gradient in the base's shape."""
    dims = Dims(2, 1, 260, heads_q=8, heads_kv=2, head_dim=16)
    q, k, v, mask, bias = random_problem(dims, torch.float32, device, "BxHkx1xLk", "BxHkx1xLk")
    run_backward(q, k, v, mask, bias, False,
                 bias_view=lambda t: t.expand(dims.batch, dims.heads_kv, 1, dims.seqlen_k))
    packed(q, k, v, mask, bias, False)


def test_packed_masked_blocks_read_no_keys_or_values(device):
    """Keys 128..255 are masked for every row and hold NaN: blocks that no row keeps skip
    their K and V reads, so no gradient turns NaN, and their dk and dv are zero."""
    dims = Dims(1, 1, 384, heads_q=4, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    mask = random_mask(dims.operand_shape("1", "1", "1", "Lk"), device)
    mask[..., MASKED_BAND] = False
    band = MASKED_BAND
    grad_out = torch.randn(q.shape, device=device)
    clean = grads_of(dmattn_func, q, k, v, mask, None, False, None, grad_out)
    poisoned = grads_of(dmattn_func, q, nan_in_band(k), nan_in_band(v), mask, None, False, None,
                        grad_out)
    packed(q, k, v, mask)
    assert torch.equal(poisoned.dq, clean.dq)
    assert torch.equal(poisoned.dk, clean.dk) and torch.equal(poisoned.dv, clean.dv)
    assert (clean.dk[:, band] == 0).all() and (clean.dv[:, band] == 0).all()


def test_packed_masked_split_is_deterministic(device):
    dims = Dims(1, 1, 1031, heads_q=4, heads_kv=1, head_dim=40)
    q, k, v, mask, bias = random_problem(dims, torch.float16, device, "1x1x1xLk", "1xHkx1xLk")
    assert_deterministic_grads(q, k, v, mask, bias, True)
    assert packed(q, k, v, mask, bias, True, deterministic=True).key_splits > 1


# Blocks of this many keys are live or dead as a whole in ``block_sparse_mask``: a multiple of
# the packed key block on the GPU (64) and under the interpreter (16).
SPARSE_BLOCK = 64


def block_sparse_mask(dims: Dims, shape: tuple, device, every: int) -> torch.Tensor:
    """A mask of ``shape`` (key axis Lk) that keeps random keys of every ``every``-th
    ``SPARSE_BLOCK``-key block, the same blocks for every row and head, and none elsewhere."""
    blocks = -(-dims.seqlen_k // SPARSE_BLOCK)
    block_live = torch.arange(blocks, device=device) % every == 0
    keys = block_live.repeat_interleave(SPARSE_BLOCK)[:dims.seqlen_k]
    return keys & random_mask(shape, device, keep=0.5)


def dead_block_keys(mask: torch.Tensor) -> torch.Tensor:
    """Keys of the ``SPARSE_BLOCK``-key blocks that no row of any batch or head keeps. (A
    dead key inside a live block may be read: its probability is 0, but 0 x NaN is NaN.)"""
    keys = mask.shape[-1]
    kept = mask.any(dim=2).any(dim=1).any(dim=0)
    padded = torch.nn.functional.pad(kept, (0, -keys % SPARSE_BLOCK))
    dead = ~padded.view(-1, SPARSE_BLOCK).any(dim=1)
    return dead.repeat_interleave(SPARSE_BLOCK)[:keys]


# (dims, mask shape, bias shape) of block-sparse decode: the mask is prepared, so its live key
# blocks are counted, and with an eighth of them live the launch branches around the dead ones.
SPARSE_CASES = [
    pytest.param(Dims(2, 1, 1031, heads_q=8, heads_kv=2, head_dim=64), "BxHkx1xLk", "BxHkx1xLk",
                 id="decode-gqa-kvrow-split"),
    pytest.param(Dims(1, 1, 700, heads_q=4, heads_kv=1, head_dim=40), "1xHqx1xLk", "1xHqx1xLk",
                 id="decode-mqa-per-head"),
    pytest.param(Dims(1, 3, 515, heads_q=6, heads_kv=2, head_dim=16), "1xHkxLqxLk", "Bx1x1xLk",
                 id="lq3-g3-one-row"),
]


@pytest.mark.parametrize("dims,mask_shape,bias_shape", SPARSE_CASES)
@pytest.mark.parametrize("causal", CAUSAL)
def test_packed_prepared_block_sparse_skips_dead_blocks(dims, mask_shape, bias_shape, causal,
                                                        device):
    q, k, v, _, bias = random_problem(dims, torch.bfloat16, device, mask_shape, bias_shape)
    mask = block_sparse_mask(dims, dims.operand_shape(*mask_shape.split("x")), device, 8)
    prepared = prepare_mask(mask, q, k, causal)

    def with_prepared(q, k, v, _, bias, causal, scale, **kwargs):
        return dmattn_func(q, k, v, prepared, bias, causal, scale, **kwargs)

    run_backward(q, k, v, mask, bias, causal, func=with_prepared)
    assert packed(q, k, v, prepared, bias, causal).skips_dead_blocks


def test_packed_skipped_blocks_read_no_keys_or_values(device):
    """Dead blocks hold NaN keys and values: a skipped block reads neither, so no gradient
    turns NaN, and its dk and dv are stored as zeros."""
    dims = Dims(1, 1, 1031, heads_q=4, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    mask = block_sparse_mask(dims, dims.operand_shape("1", "1", "1", "Lk"), device, 8)
    dead = dead_block_keys(mask)
    assert dead.any()
    prepared = prepare_mask(mask, q, k)
    grad_out = torch.randn(q.shape, device=device)
    clean = grads_of(dmattn_func, q, k, v, prepared, None, False, None, grad_out)
    poisoned = grads_of(dmattn_func, q, nan_in_band(k, dead), nan_in_band(v, dead), prepared,
                        None, False, None, grad_out)
    assert packed(q, k, v, prepared).skips_dead_blocks
    assert torch.equal(poisoned.dq, clean.dq)
    assert torch.equal(poisoned.dk, clean.dk) and torch.equal(poisoned.dv, clean.dv)
    assert (clean.dk[:, dead] == 0).all() and (clean.dv[:, dead] == 0).all()


@pytest.mark.parametrize("every,prepared,skips", [
    pytest.param(8, True, True, id="prepared-sparse"),
    pytest.param(1, True, False, id="prepared-dense"),  # every block live: the predicate
    pytest.param(8, False, False, id="unprepared"),  # not counted: the predicate
])
def test_which_masks_skip_dead_blocks(every, prepared, skips, device):
    dims = Dims(1, 1, 520, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    mask = block_sparse_mask(dims, dims.operand_shape("1", "Hk", "1", "Lk"), device, every)
    attn_mask = prepare_mask(mask, q, k) if prepared else mask
    grads_of(dmattn_func, q, k, v, attn_mask, None, False, None, torch.randn_like(q))
    assert packed(q, k, v, attn_mask).skips_dead_blocks == skips


def test_live_share_counts_blocks_live_in_any_head_of_a_tile(device):
    """A (1, Hq, 1, Lk) mask with G = 2: a tile's block is live where either head keeps a key."""
    dims = Dims(1, 1, 256, heads_q=4, heads_kv=2, head_dim=16)
    q, k, _ = random_qkv(dims, torch.float16, device)
    mask = torch.zeros(1, 4, 1, 256, dtype=torch.bool, device=device)
    mask[0, 0, 0, 0] = mask[0, 1, 0, 64] = mask[0, 3, 0, 130] = True
    activity = prepare_mask(mask, q, k).activity
    # Tiles (heads 0-1, heads 2-3) x four 64-key blocks: three of the eight are live.
    assert activity.count_live_share(64, 2) == 3 / 8
    assert activity.count_live_share(64, 1) == 3 / 16
    assert activity.count_live_share(128, 2) == 2 / 4  # keys 0 and 64 share a block


@pytest.mark.parametrize("bias_shape", ["BxHkxLqxLk", "BxHqx1xLk"])
def test_bias_grads_packing_cannot_write_take_the_general_path(bias_shape, device):
    """Lq = 3 with G = 3: a (B, Hk, Lq, Lk) gradient sums each query's 3 heads, a (B, Hq, 1, Lk)
    one each head's 3 queries; both keep the general backward."""
    dims = Dims(1, 3, 70, heads_q=6, heads_kv=2, head_dim=16)
    q, k, v, mask, bias = random_problem(dims, torch.float32, device, "1xHkxLqxLk", bias_shape)
    run_backward(q, k, v, mask, bias, True)
    assert backward_schedule(q, k, v, mask, bias, True).route is not BackwardRoute.PACKED


def _problem(seqlen_q, heads_q, heads_kv, bias_shape=None, bias_grad=False) -> Problem:
    """A decode-sized problem for ``takes_packed``."""
    bias = None if bias_shape is None else OperandLayout(bias_shape, heads_q // bias_shape[1])
    return Problem(AttnShape(1, seqlen_q, 4096, heads_q, heads_kv, 128), torch.bfloat16,
                   torch.device("cpu"), interpreted=False, multiprocessors=132, is_causal=False,
                   softmax_scale=0.125, bias=bias, bias_grad=bias_grad)


@pytest.mark.parametrize("problem,packs", [
    (_problem(1, 32, 8), True),
    (_problem(1, 16, 1), True),  # MQA: 16 rows, one tile
    (_problem(4, 16, 4), True),
    (_problem(5, 16, 4), False),  # 20 rows
    (_problem(1, 32, 1), False),  # 32 heads in a group
    (_problem(1, 32, 8, (1, 8, 1, 4096), bias_grad=True), True),  # one gradient row per group
    (_problem(1, 32, 8, (1, 32, 1, 4096), bias_grad=True), True),  # a row per query head
    (_problem(1, 32, 8, (1, 1, 1, 1), bias_grad=True), True),  # broadcast along keys: zero
    (_problem(4, 16, 4, (1, 4, 1, 4096), bias_grad=True), True),
    (_problem(4, 16, 4, (1, 16, 4, 4096), bias_grad=True), True),
    (_problem(4, 16, 4, (1, 4, 4, 4096), bias_grad=True), False),  # a query's 4 heads sum
    (_problem(4, 16, 4, (1, 4, 4, 4096)), True),  # ... unless no gradient is wanted
    (_problem(4, 16, 4, (1, 16, 1, 4096), bias_grad=True), False),  # a head's 4 queries sum
    # MHA: each row its own, heads summed after
    (_problem(4, 4, 4, (1, 1, 4, 4096), bias_grad=True), True),
])
def test_which_calls_pack(problem, packs):
    assert takes_packed(problem) == packs
