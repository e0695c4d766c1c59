"""``runtime.tma``: the Gluon launches' TMA operands, and the encoded descriptors a compiled
kernel's launcher is handed (checked against a stand-in launcher of triton 3.6's form)."""

from __future__ import annotations

import types

import pytest
import torch

from kernels.runtime.tma import MAX_ENCODED, EncodedDescriptors, TmaOperand, TmaSpec, as_descriptor

nvidia = pytest.importorskip("triton.backends.nvidia.driver")
from triton.runtime import driver  # noqa: E402

BOX = [1, 64, 1, 128]
META = dict(swizzle=128, elem_size=2, elem_type=10, block_size=BOX, fp4_padded=False)


def _closure_launch(launcher, tensordesc_meta):
    """A ``CompiledKernel.run.launch`` of triton 3.6's form: a closure over the raw launcher
    and the descriptors' metadata."""
    def launch(*args):
        return launcher, tensordesc_meta
    return launch


@pytest.fixture
def launcher(monkeypatch):
    """A compiled kernel whose launcher records its calls, over a driver whose descriptor fill
    records each encoding."""
    fills, calls = [], []

    def fill(address, swizzle, elem_size, elem_type, block, shape, strides, padding):
        fills.append((address, tuple(shape), tuple(strides)))
        return ("map", address, tuple(block))

    monkeypatch.setattr(nvidia, "_BASE_ARGS_FORMAT", "iiiKKppOOOOOO", raising=False)
    monkeypatch.setattr(nvidia, "TMA_DTYPE_DEVICE_TO_HOST", {10: 10}, raising=False)
    utils = types.SimpleNamespace(fill_tma_descriptor=fill)
    monkeypatch.setattr(driver, "_active", types.SimpleNamespace(utils=utils))
    run = types.SimpleNamespace(launch=_closure_launch(lambda *a: calls.append(a), [META, META]),
                                global_scratch_size=0, profile_scratch_size=0,
                                launch_cooperative_grid=False, launch_pdl=False)
    compiled = types.SimpleNamespace(run=run, function=7, packed_metadata="packed")
    return compiled, fills, calls


def test_an_address_seen_again_is_not_encoded_again(launcher):
    """Each descriptor operand is encoded once per (position, address, shape, strides); the
    launcher gets the base arguments, each map followed by its shape and strides (a spec's own
    where it names them), the other operands in place, then the tail."""
    compiled, fills, calls = launcher
    encoded = EncodedDescriptors.of(compiled)
    assert encoded is not None
    q, k, lse = torch.zeros(1, 256, 2, 128), torch.zeros(1, 256, 2, 128), torch.zeros(4)
    plain, viewed = TmaSpec(BOX, "L"), TmaSpec(BOX, "M", [1, 2, 3, 4], [9, 8, 7, 1])
    for _ in range(3):
        encoded.launch((5, 1, 1), 99, (plain(q), lse, viewed(k), 3), (64,))
    assert len(fills) == 2 and len(calls) == 3
    args = calls[-1]
    assert args[:13] == (5, 1, 1, 99, 7, False, False, None, None, "packed", None, None, None)
    assert args[13:] == (("map", q.data_ptr(), tuple(BOX)), 1, 256, 2, 128, *q.stride(), lse,
                         ("map", k.data_ptr(), tuple(BOX)), 1, 2, 3, 4, 9, 8, 7, 1, 3, 64)
    other = torch.zeros(1, 256, 2, 128)
    encoded.launch((5, 1, 1), 99, (plain(other), lse, viewed(k), 3), (64,))
    assert fills[-1][0] == other.data_ptr() and calls[-1][13][1] == other.data_ptr()
    encoded.launch((5, 1, 1), 99, (plain(q[:, :128]), lse, viewed(k), 3), (64,))
    assert fills[-1] == (q.data_ptr(), (1, 128, 2, 128), q.stride())  # same address, other shape


def test_the_kept_encodings_are_bounded(launcher):
    compiled, fills, _ = launcher
    encoded = EncodedDescriptors.of(compiled)
    tensors = [torch.zeros(1, 64, 1, 128) for _ in range(MAX_ENCODED + 8)]
    for t in tensors:
        encoded.launch((1, 1, 1), 0, (TmaSpec(BOX, "L")(t), t), ())
    assert len(encoded.cache) == MAX_ENCODED and len(fills) == MAX_ENCODED + 8


@pytest.mark.parametrize("change", ("scratch", "format", "no_closure", "fp4"))
def test_another_launcher_form_takes_the_usual_path(launcher, monkeypatch, change):
    compiled, _, _ = launcher
    if change == "scratch":
        compiled.run.global_scratch_size = 256
    elif change == "format":
        monkeypatch.setattr(nvidia, "_BASE_ARGS_FORMAT", "iiiKKOOOO", raising=False)
    elif change == "no_closure":
        compiled.run.launch = lambda *args: None
    else:
        compiled.run.launch = _closure_launch(lambda *a: None, [dict(META, fp4_padded=True)])
    assert EncodedDescriptors.of(compiled) is None


def test_the_jit_path_gets_descriptors():
    """Anything but a ``TmaOperand`` passes through; an operand's descriptor reads its tensor
    with the spec's shape and strides where the spec names them."""
    lse = torch.zeros(4)
    assert as_descriptor(lse) is lse and as_descriptor(3) == 3
    operand = TmaOperand(torch.zeros(2, 8), TmaSpec([1, 8], "L", [4, 4], [4, 1]))
    assert operand.geometry() == ([4, 4], [4, 1])
    assert TmaSpec([1, 8], "L")(torch.zeros(2, 8)).geometry() == ([2, 8], [8, 1])
