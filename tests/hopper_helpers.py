"""Helpers of the Hopper route's tests (``test_hopper_route``, ``test_hopper_masks``): a problem
the route covers, the forced call that fails on a silent fallback, and a band mask."""

from __future__ import annotations

from dataclasses import replace

import torch

from attn_helpers import Dims, forcing
from kernels import record_routes
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


def band(dims: Dims, window: int, device) -> torch.Tensor:
    """A sliding window of ``window`` keys ending at each row's diagonal: mostly full tiles,
    partial ones on its two edges."""
    rows = torch.arange(dims.seqlen_q, device=device)[:, None]
    keys = torch.arange(dims.seqlen_k, device=device)[None, :]
    last = rows + dims.seqlen_k - dims.seqlen_q
    return ((keys <= last) & (keys > last - window))[None, None]

