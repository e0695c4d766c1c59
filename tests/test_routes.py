"""``kernels.record_routes``: the routes a call's launches took, as the launchers report them
(CPU, Triton's interpreter), and the harness rows that name them."""

from __future__ import annotations

import pytest
import torch

from attn_helpers import Dims, forcing, random_mask, random_qkv
from dmbench import runner
from dmbench.backends import make_backends
from dmbench.envinfo import collect
from dmbench.problem import make_problem
from dmbench.sweep import sweep_from_mapping
from kernels import dmattn_func, record_routes

pytestmark = pytest.mark.interpreter


def test_a_training_call_names_its_forward_and_backward():
    q, k, v = random_qkv(Dims(1, 17, 33, 4, 2, 40), torch.float32, "cpu")
    for t in (q, k, v):
        t.requires_grad_(True)
    with record_routes() as routes:
        dmattn_func(q, k, v, is_causal=True).sum().backward()
    assert routes.forward == ["triton"]
    assert len(routes.backward) == 1 and routes.backward[0] in ("fused", "dq+dkdv")
    assert routes.describe() == f"forward triton; backward {routes.backward[0]}"


def test_a_forced_backward_route_is_the_one_named():
    q, k, v = random_qkv(Dims(1, 17, 33, 2, 2, 16), torch.float32, "cpu")
    for t in (q, k, v):
        t.requires_grad_(True)
    with record_routes() as routes:
        forcing(backward="dq+dkdv")(q, k, v).sum().backward()
    assert routes.backward == ["dq+dkdv"]


def test_a_decode_step_over_a_sparse_mask_names_the_gather_route():
    q, k, v = random_qkv(Dims(2, 1, 300, 4, 2, 32), torch.float32, "cpu")
    mask = random_mask((2, 2, 1, 300), "cpu")
    with record_routes() as routes:
        forcing(forward_route="gather")(q, k, v, mask)
    assert routes.forward == ["gather"] and routes.backward == []
    assert routes.describe() == "forward gather"


def test_nothing_is_recorded_outside_a_block_and_nested_blocks_both_record():
    q, k, v = random_qkv(Dims(1, 5, 7, 2, 1, 16), torch.float32, "cpu")
    with record_routes() as outer:
        dmattn_func(q, k, v)
        with record_routes() as inner:
            dmattn_func(q, k, v)
    dmattn_func(q, k, v)
    assert outer.forward == ["triton", "triton"] and inner.forward == ["triton"]


def test_several_routes_are_all_named_in_the_order_taken():
    q, k, v = random_qkv(Dims(1, 1, 300, 2, 2, 32), torch.float32, "cpu")
    mask = random_mask((1, 2, 1, 300), "cpu")
    with record_routes() as routes:
        forcing(forward_route="gather")(q, k, v, mask)
        forcing(forward_route="triton")(q, k, v, mask)
        forcing(forward_route="gather")(q, k, v, mask)
    assert routes.describe() == "forward gather+triton"


def test_our_rows_name_the_routes_and_the_peers_rows_do_not():
    raw = {"name": "routes", "backends": ["triton", "reference"],
           "timing": {"warmup": 1, "repeats": 3, "budget_s": 1.0},
           "cases": [{"batch": 1, "heads": "2/1", "seqlen": 24, "head_dim": 16, "causal": True,
                      "dtype": "fp32"}]}
    sweep = sweep_from_mapping(raw, "routes.yaml", ("triton", "reference"))
    backends = {name: b for name, b in make_backends().items() if name in ("triton", "reference")}
    device = torch.device("cpu")
    rows = []
    units = runner.plan_units(sweep, sweep.cases, ("fwd", "bwd"), backends, device)
    runner.SweepRunner(sweep, backends, device, collect(device), False,
                       lambda row, unit: rows.append(row)).run(units)
    details = {(r.backend, r.mode): r.detail for r in rows if r.status == "ok"}
    assert details[("triton", "fwd")] == "routes: forward triton"
    assert details[("triton", "bwd")].startswith("routes: forward triton; backward ")
    assert "routes" not in details[("reference", "fwd")]


def test_a_row_names_the_routes_of_a_repeated_call_not_the_first(monkeypatch):
    """A first call may take another route than its repeats (packed documents walk their own
    tiles from the second call): the row names what a repeat took."""
    from dmbench.backends.base import Backend, Bound
    from kernels.runtime.routes import note_route

    class Settling(Backend):
        name = "settling"

        def __init__(self):
            self.calls = 0

        def adapt(self, problem):
            return {"q": problem.q}

        def bind(self, adapted, case, want_lse):
            def call():
                self.calls += 1
                note_route("forward", "triton" if self.calls == 1 else "hopper")
                return adapted["q"] * 2, None
            return Bound(call)

        def route_record(self):
            return record_routes()

    raw = {"name": "settle", "backends": ["triton"],
           "cases": [{"batch": 1, "heads": "2/1", "seqlen": 8, "head_dim": 16,
                      "dtype": "fp32"}]}
    sweep = sweep_from_mapping(raw, "settle.yaml", ("triton",))
    problem = make_problem(sweep.cases[0], torch.device("cpu"))
    for mode in ("fwd", "bwd"):
        _, setup = runner._timed_call(Settling(), problem, mode)
        assert setup.kernel.startswith("routes: forward hopper"), (mode, setup.kernel)
