"""The packed backward (``kernels.backward_packed``): a few query rows per GQA group (decode)
without a mask or bias, one launch in which each program owns a share of the key blocks of one
(batch, kv head), writes their dk and dv whole and adds its part of the group's dq. Every
case checks that the packed plan was the one made, and every gradient against float64
autograd of the reference; odd key lengths leave partial last blocks, and long ones split the
keys into shares whose dq partials must all land in the sum."""

from __future__ import annotations

import pytest
import torch

from attn_helpers import (CAUSAL, DTYPES, Dims, assert_deterministic_grads, random_qkv,
                          record_backward_plans, run_backward)
from kernels import backward_packed
from kernels._checks import AttnShape

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


@pytest.fixture
def packed_plans(monkeypatch):
    return record_backward_plans(monkeypatch, "PackedBackwardPlan")


@pytest.mark.parametrize("dims,split", CASES)
@pytest.mark.parametrize("causal", CAUSAL)
def test_packed_grads(dims, split, causal, device, packed_plans):
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    run_backward(q, k, v, None, None, causal)
    assert len(packed_plans) == 1, "this call should take the packed backward"
    assert (packed_plans[0].splits > 1) == split


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_grads_dtypes(dtype, device, packed_plans):
    dims = Dims(2, 2, 211, heads_q=8, heads_kv=2, head_dim=80)
    q, k, v = random_qkv(dims, dtype, device)
    run_backward(q, k, v, None, None, True)
    assert len(packed_plans) == 1


def test_packed_rows_before_their_keys_are_empty(device, packed_plans):
    """Causal with Lq > Lk: the first rows see no key, and their dq must be exactly 0."""
    dims = Dims(1, 5, 3, heads_q=3, heads_kv=3, head_dim=40)
    q, k, v = random_qkv(dims, torch.float16, device)
    run = run_backward(q, k, v, None, None, True)
    assert len(packed_plans) == 1
    assert (run.grads.dq[:, :2] == 0).all()


@pytest.mark.parametrize("layout", ("bhld", "sliced", "strided"))
def test_packed_grads_qkv_layouts(layout, device, packed_plans):
    dims = Dims(2, 1, 300, heads_q=4, heads_kv=2, head_dim=40)
    q, k, v = random_qkv(dims, torch.bfloat16, device, layout)
    run_backward(q, k, v, None, None, True, scale=0.7)
    assert len(packed_plans) == 1


def test_packed_split_is_deterministic(device, packed_plans):
    """The key shares' dq partials are summed in share order: identical bits run to run."""
    dims = Dims(1, 1, 1031, heads_q=4, heads_kv=1, head_dim=40)
    q, k, v = random_qkv(dims, torch.float16, device)
    assert_deterministic_grads(q, k, v, None, None, True)
    assert packed_plans and all(plan.splits > 1 for plan in packed_plans)


class _Plan:
    """The fields ``packs_rows`` reads from a forward plan."""

    def __init__(self, seqlen_q, heads_q, heads_kv, mask=None, bias=None):
        self.shape = AttnShape(1, seqlen_q, 4096, heads_q, heads_kv, 128)
        self.mask, self.bias = mask, bias


@pytest.mark.parametrize("plan,packs", [
    (_Plan(1, 32, 8), True),
    (_Plan(1, 16, 1), True),  # MQA: 16 rows, one tile
    (_Plan(4, 16, 4), True),
    (_Plan(5, 16, 4), False),  # 20 rows
    (_Plan(1, 32, 1), False),  # 32 heads in a group
    (_Plan(1, 32, 8, mask=object()), False),
    (_Plan(1, 32, 8, bias=object()), False),
])
def test_which_calls_pack(plan, packs):
    assert backward_packed.packs_rows(plan) == packs
