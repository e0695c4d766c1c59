"""Helpers of the Hopper route's tests (``test_hopper_route``,
``test_hopper_three_warpgroups``, ``test_hopper_masks``, ``test_hopper_backward``): a problem the route covers, the forced call that fails on a silent
fallback, a band mask, the masked tests' shapes and a fuzz case's mask."""

from __future__ import annotations

from dataclasses import replace

import torch

from attn_helpers import Dims, forcing, random_mask
from kernels import record_routes
from kernels.planning import tuning
from kernels.planning.inputs import AttnShape
from kernels.planning.problem import Problem


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



def count_hopper_launches(monkeypatch) -> list:
    """The Hopper launches made from now on (one entry each)."""
    from kernels.planning.hopper_forward_launch import HopperForwardLaunch

    launched = []
    original = HopperForwardLaunch.__call__
    monkeypatch.setattr(HopperForwardLaunch, "__call__",
                        lambda self, *args: launched.append(1) or original(self, *args))
    return launched



FORCED = forcing(forward_route="hopper")
FORCED_ORDER = {order: forcing(forward_route="hopper", forward_tile_order=order)
                for order in ("heads", "balanced")}


def _only_hopper(forced, *args, **kwargs):
    with record_routes() as routes:
        result = forced(*args, **kwargs)
    assert routes.forward and set(routes.forward) == {"hopper"}, (
        f"the forced call ran {routes.describe() or 'no forward'}")
    return result


def HOPPER(*args, **kwargs):
    """``dmattn_func`` forced onto the Hopper route, failing unless every forward it ran
    launched the Hopper kernel (a silent fallback to the Triton launch fails the test)."""
    return _only_hopper(FORCED, *args, **kwargs)


def hopper_in_tile_order(order: str):
    """As ``HOPPER``, its tiles dealt in ``order`` ('heads' or 'balanced')."""
    return lambda *args, **kwargs: _only_hopper(FORCED_ORDER[order], *args, **kwargs)


def band(dims: Dims, window: int, device) -> torch.Tensor:
    """A sliding window of ``window`` keys ending at each row's diagonal: mostly full tiles,
    partial ones on its two edges."""
    rows = torch.arange(dims.seqlen_q, device=device)[:, None]
    keys = torch.arange(dims.seqlen_k, device=device)[None, :]
    last = rows + dims.seqlen_k - dims.seqlen_q
    return ((keys <= last) & (keys > last - window))[None, None]



MASKED_SHAPES = [  # (batch, Lq, Lk, Hq, Hk, D): Lk a multiple of 16 (TMA reads mask rows)
    (2, 300, 512, 4, 2, 128),
    (1, 1025, 1040, 4, 1, 80),
    (2, 17, 64, 2, 2, 64),
    (1, 700, 4096, 6, 2, 128),
]


def shape_id(sizes) -> str:
    """A test id of (batch, Lq, Lk, Hq, Hk, D)."""
    return "B{}-Lq{}-Lk{}-H{}/{}-D{}".format(*sizes)


def fuzzed_dims(rng, max_batch: int, max_length: int) -> Dims:
    """A fuzz case's sizes: batch and both lengths from 1 up, 1-3 key heads in GQA groups of
    1, 2 or 4 (MQA too), head dims 8-128 in steps of 8."""
    heads_kv = rng.choice([1, 2, 3])
    return Dims(rng.randint(1, max_batch), rng.randint(1, max_length),
                rng.randint(1, max_length), heads_kv * rng.choice([1, 2, 4]), heads_kv,
                8 * rng.randint(1, 16))


def tma_keys(seqlen_k: int, element_bytes: int) -> int:
    """``seqlen_k`` rounded up to a multiple of 16 bytes of ``element_bytes`` elements: the
    length of rows an operand of ``seqlen_k`` keys is sliced from, so that TMA reads it."""
    per_16_bytes = 16 // element_bytes
    return -(-seqlen_k // per_16_bytes) * per_16_bytes


def fuzzed_mask(rng, dims: Dims, device) -> torch.Tensor:
    """A random bool mask for a fuzz case: any batch and head broadcast (a stride-0 expand of
    a batch of one too), keep 0-100% (empty rows and key blocks no row sees), and odd key
    lengths as a slice of rows padded to 16 bytes, which TMA can read."""
    batch, heads = rng.choice(["1", "B"]), rng.choice(["1", "Hk", "Hq"])
    shape = dims.operand_shape(batch, heads, "Lq", "Lk")
    padded = tma_keys(dims.seqlen_k, 1)
    keep = rng.choice([0.0, 0.01, 0.3, 0.9, 1.0])
    mask = random_mask((*shape[:3], padded), device, keep)[..., :dims.seqlen_k]
    if batch == "1" and rng.random() < 0.3:
        mask = mask.expand(dims.batch, *mask.shape[1:])
    return mask


# The other three-warpgroup forward: 64-key blocks in a four-slot ring, each block's scores
# overlapping the former block's PV product (offline sm_90a: 0 spills, 115 KB).
OVERLAPPED_THREE = tuning.HopperTile(64, 64, 4, 160, 24, consumers=3)
