"""The sdpa peers run as a competent user runs them: K/V at their own Hk heads with
``enable_gqa``, the float mask built once outside the call, and the kernel torch picked named
in the row's detail."""

from __future__ import annotations

import pytest
import torch

from dmbench.accuracy import check_backend, ground_truth
from dmbench.backends import make_backends
from dmbench.backends.torch_ops import sdpa_kernel_name
from dmbench.problem import make_problem
from dmbench.runner import _timed_call
from dmbench.sweep import Case

CPU = torch.device("cpu")
KERNELS = {"cudnn", "flash", "efficient", "math"}
# (mask, bias): a float mask carrying the bias, one without a bias, and no float mask at all.
OPERANDS = (("topk", "kv_row"), ("sliding", "none"), ("none", "none"))


def _case(mask: str, bias: str, heads=(4, 2), causal=True) -> Case:
    return Case(1, heads[0], heads[1], 17, 33, 16, 8, causal, "fp32", mask, bias=bias, seed=5)


@pytest.mark.parametrize("backend", ("sdpa", "sdpa-dense"))
@pytest.mark.parametrize("operands", OPERANDS)
def test_sdpa_keeps_kv_heads_and_names_its_kernel(backend, operands):
    case = _case(*operands)
    peer = make_backends()[backend]
    problem = make_problem(case, CPU)
    adapted = peer.adapt(problem)
    assert adapted["k"].shape[1] == case.heads_kv and adapted["v"].shape[1] == case.heads_kv
    assert adapted["k"].data_ptr() == problem.k.data_ptr()  # a view, never a repeat
    _, setup = _timed_call(peer, problem, "fwd")
    assert setup.kernel.removeprefix("sdpa kernel: ") in KERNELS
    assert setup.detail()[1].endswith(setup.kernel)


@pytest.mark.parametrize("operands", OPERANDS)
@pytest.mark.parametrize("heads", ((4, 2), (4, 1)))
def test_sdpa_with_enable_gqa_matches_the_reference(operands, heads):
    problem = make_problem(_case(*operands, heads=heads), CPU, requires_grad=True)
    truth = ground_truth(problem, with_grad=True)
    result = check_backend(make_backends()["sdpa"], problem, truth, with_grad=True)
    assert result.error is None
    assert {"out", "dq", "dk", "dv"} <= set(result.checks)
    assert all(check.passed for check in result.checks.values()), result.checks


def test_sdpa_kernel_name_is_the_dispatchers_choice(monkeypatch):
    q = torch.randn(1, 4, 5, 8)
    k = v = torch.randn(1, 2, 7, 8)
    mask = torch.zeros(1, 4, 5, 7)
    assert sdpa_kernel_name(q, k, v, mask, is_causal=False, gqa=True) in KERNELS
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *args, **kwargs: 2)
    assert sdpa_kernel_name(q, k, v, mask, is_causal=False, gqa=True) == "efficient"
    monkeypatch.delattr(torch, "_fused_sdp_choice")
    assert sdpa_kernel_name(q, k, v, mask, is_causal=False, gqa=True) == "unknown"
