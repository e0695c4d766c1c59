"""The sdpa peers run as a competent user runs them: K/V at their own Hk heads with
``enable_gqa``, the float mask built once outside the call, and the kernel torch picked named
in the row's detail."""

from __future__ import annotations

import pytest
import torch

from dmbench.accuracy import check_backend, ground_truth
from dmbench.backends import make_backends
from dmbench.backends.sdpa_form import bind_sdpa, sdpa_call, sdpa_kernel_name
from dmbench.case import Case
from dmbench.problem import make_problem
from dmbench.runner import _timed_call

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
    assert sdpa_kernel_name(q, k, v, mask, is_causal=False) in KERNELS
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *args, **kwargs: 2)
    assert sdpa_kernel_name(q, k, v, mask, is_causal=False) == "efficient"
    monkeypatch.delattr(torch, "_fused_sdp_choice")
    assert sdpa_kernel_name(q, k, v, mask, is_causal=False) == "unknown"


def _gqa_operands(requires_grad: bool):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 8, generator=gen).requires_grad_(requires_grad)
    k = torch.randn(1, 2, 7, 8, generator=gen).requires_grad_(requires_grad)
    v = torch.randn(1, 2, 7, 8, generator=gen).requires_grad_(requires_grad)
    mask = torch.randn(1, 4, 5, 7, generator=gen).requires_grad_(requires_grad)
    return q, k, v, mask


@pytest.mark.parametrize("repeated_wins", (True, False))
def test_sdpa_binds_the_faster_form_and_says_which(repeated_wins):
    q, k, v, mask = _gqa_operands(requires_grad=True)
    seen = []

    def timer(call, leaves):
        seen.append(len(leaves))
        return 1.0 if (len(seen) == 2) == repeated_wins else 2.0  # the 2nd trial is repeated

    bound = bind_sdpa(q, k, v, mask, is_causal=False, timer=timer)
    assert seen == [4, 4]  # q, k, v and the mask need grad: each trial times the backward too
    if repeated_wins:
        assert "K/V repeated to Hq heads" in bound.kernel and "enable_gqa ran" in bound.kernel
    else:
        assert "repeated" not in bound.kernel
    native = sdpa_call(q, k, v, mask, False)()[0]
    out = bound.call()[0]
    torch.testing.assert_close(out, native)
    grads = torch.autograd.grad(out.sum(), (q, k, v, mask))
    expected = torch.autograd.grad(native.sum(), (q, k, v, mask))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


def test_sdpa_without_gqa_or_on_the_cpu_runs_no_trial():
    q, k, v, mask = _gqa_operands(requires_grad=False)
    assert "repeated" not in bind_sdpa(q, k, v, mask, False).kernel
    same = bind_sdpa(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), mask, False,
                     timer=lambda call, leaves: pytest.fail("timed without GQA"))
    assert same.kernel.removeprefix("sdpa kernel: ") in KERNELS


def test_decode_rows_call_sdpa_without_a_causal_mask():
    from dmbench.backends.torch_ops import _causal_mask_arg
    from torch.nn.attention.bias import CausalBias

    decode = Case(1, 4, 2, 1, 33, 16, None, True, "fp32", "none", bias="none", seed=0)
    assert _causal_mask_arg(decode, CPU) == (None, False)
    chunk = Case(1, 4, 2, 3, 33, 16, None, True, "fp32", "none", bias="none", seed=0)
    mask, is_causal = _causal_mask_arg(chunk, CPU)
    assert isinstance(mask, CausalBias) and not is_causal
    q = torch.randn(1, 4, 3, 16)
    k = v = torch.randn(1, 2, 33, 16)
    assert sdpa_kernel_name(q, k, v, mask, False) in KERNELS
