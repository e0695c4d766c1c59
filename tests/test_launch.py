"""The launch path (kernels.runtime.launch): what decides whether a compiled kernel is reused, and
which way a launch runs (compile-only, Triton's JIT dispatch, the compiled launcher), for planned
launches and one-off ``launch`` calls alike. The launches themselves run in every kernel test;
on a GPU (``--device cuda``) repeat calls take the direct path, and
test_repeated_calls_with_one_shape repeats one shape with misaligned pointers."""

from __future__ import annotations

from concurrent.futures import Future
from typing import NamedTuple

import pytest
import torch

from kernels.runtime.forms import compiled_forms


def test_specialization_is_what_triton_compiles_for():
    from kernels.runtime.forms import specialization

    base = torch.zeros(8, dtype=torch.float16)
    shifted = base[1:]  # the same storage, 2 bytes further: not 16-byte aligned
    assert specialization((base, 16, 1.5)) == specialization((base.clone(), 32, 2.5))
    assert specialization((base, 16)) != specialization((shifted, 16))
    assert specialization((base, 16)) != specialization((base.float(), 16))
    assert specialization((base, 16)) != specialization((base, 17))
    assert specialization((base, 17)) == specialization((base, 1001))
    assert specialization((base, 1)) != specialization((base, 2))
    assert specialization(2**31) != specialization(2**31 - 16)  # int64 against int32


def test_compile_form_forgets_lengths_and_keeps_what_pays():
    """List strides and grid counts are compiled for as unknown (1 stays 1); a stride group is
    compiled for as all multiples of 16 or as unknown; kept fields (the lengths among them)
    stay as they are, which Triton then compiles for by class."""
    from kernels.runtime.forms import UNKNOWN_INT, compile_form, specialization
    from kernels.planning.operands import Layout, ListStrides, SeqStrides, Sizes

    unknown = UNKNOWN_INT
    assert compile_form(Sizes(16, 4, 1000, 1024)) == Sizes(16, 4, 1000, 1024)
    assert compile_form((7, 1, 4096)) == (unknown, 1, unknown)
    assert compile_form(ListStrides(0, 96, 32)) == ListStrides(unknown, unknown, unknown)
    # A (B, H, L, L) mask: aligned at L = 1024, not at 1000 (1000 * 1000 is a multiple of 16,
    # 1000 is not) nor at 1001; its unit key stride and head divisor are kept.
    aligned = Layout(4 * 1024 * 1024, 1024 * 1024, 1024, 1, 4)
    assert compile_form(aligned) == aligned
    for length in (1000, 1001):
        layout = Layout(4 * length * length, length * length, length, 1, 4)
        assert compile_form(layout) == Layout(unknown, unknown, unknown, 1, 4)
    # A stride past int32 (the batch stride of a (1, 4, 32768, 32768) mask) keeps its width and
    # leaves the group aligned.
    large = Layout(4 * 32768 * 32768, 32768 * 32768, 32768, 1, 4)
    assert compile_form(large) == large
    assert compile_form(Layout(2**32 + 8, 32768 * 32768, 32768, 1, 4)) == Layout(
        2**32 + 8, unknown, unknown, 1, 4)
    # KeyIntervals' (start, end) pairs (key stride 2) never load vectors along keys.
    assert compile_form(Layout(4 * 2048 * 2, 2048 * 2, 0, 2, 1)) == Layout(
        unknown, unknown, unknown, 2, 1)
    # A per-key bias broadcast over rows (row stride 0) at a multiple of 16 stays aligned.
    assert compile_form(Layout(4 * 2048, 2048, 0, 1, 1)) == Layout(4 * 2048, 2048, 0, 1, 1)
    # Lengths of one class compile once: 20 lengths, two forms (aligned or not).
    forms = {specialization(compile_form((SeqStrides(length * 2048, 2048, 128),
                                          Layout(4 * length, length, 0, 1, 1),
                                          Sizes(16, 4, length, length), length)))
             for length in range(1000, 1100, 5)}
    assert len(forms) == 2
    # Nested tuples are canonicalized item by item; int64 values keep their width.
    assert compile_form(((1000, 1), 2.5)) == ((unknown, 1), 2.5)
    assert compile_form(2**33) == 2**33


def test_launch_hooks_send_launches_through_triton():
    from kernels.runtime.launch import _hook_installed

    class Chain:  # Triton >= 3.5's HookChain: always present, empty when nothing listens
        def __init__(self, calls):
            self.calls = calls

    assert not _hook_installed(None)
    assert not _hook_installed(Chain([]))
    assert _hook_installed(Chain([print]))
    assert _hook_installed(print)


def test_planned_launch_hands_the_launcher_plain_tuples():
    """The compiled kernel's launcher reads tuple arguments by position; NamedTuples take its
    slow path (13 against 9 us per launch on the H100 host), so a plan passes plain tuples,
    with the same values in the same nesting."""
    from kernels.runtime.launch import _plain
    from kernels.planning.operands import BackwardLayouts, Layout, ListStrides, Sizes

    layouts = BackwardLayouts(Layout(1, 2, 3, 4, 5), Layout(6, 7, 8, 9, 10),
                              Layout(0, 0, 0, 0, 1), ListStrides(1, 2, 3), ListStrides(4, 5, 6))
    args = (layouts, Sizes(8, 2, 17, 33), 0.5, 7)
    plain = _plain(args)
    assert plain == args  # the same values, position by position

    def kinds(value):
        if isinstance(value, tuple):
            return (type(value).__name__, tuple(kinds(item) for item in value))
        return type(value).__name__

    assert "BackwardLayouts" not in str(kinds(plain)) and "Layout" not in str(kinds(plain))
    assert kinds(plain)[1][0][1][0] == ("tuple", ("int",) * 5)


def test_an_interpreter_that_cannot_run_the_kernels_is_named(monkeypatch):
    """Triton 3.6's interpreter with NumPy 2.4 fails inside the first kernel loop with a
    TypeError; the kernels say which versions to install instead."""
    import numpy
    import triton

    from kernels.runtime.launch import interpreter_problem

    check = interpreter_problem.__wrapped__  # uncached
    for triton_version, numpy_version, fails in (("3.6.0", "2.4.6", True),
                                                 ("3.5.1", "2.4.0", True),
                                                 ("3.6.0", "2.3.5", False),
                                                 ("3.7.0", "2.4.6", False),
                                                 ("3.9.0+git1a2b", "2.5.0rc1", False)):
        monkeypatch.setattr(triton, "__version__", triton_version)
        monkeypatch.setattr(numpy, "__version__", numpy_version)
        problem = check()
        assert (problem is not None) == fails, (triton_version, numpy_version)
        if fails:
            assert "triton>=3.7" in problem and "numpy<2.4" in problem


class _Compiled:
    function, packed_metadata = "function", "metadata"


class _Kernel:
    """A stand-in for a JITFunction: records its compiles and JIT launches."""

    __name__ = "_fake_kernel"
    arg_names = ["a", "b", "n", "pair", "BLOCK"]

    def __init__(self):
        self.compiles, self.jit = [], []

    def warmup(self, *args, grid, **options):
        self.compiles.append((args, grid, options))
        return _Compiled()

    def __getitem__(self, grid):
        return lambda *args, **options: self.jit.append((grid, args, options))


class _Pair(NamedTuple):
    x: int
    y: int


@pytest.fixture
def direct(monkeypatch):
    """The direct path on CPU: every launcher call recorded instead of made."""
    from kernels.runtime import forms
    from kernels.runtime import launch as module

    ran = []
    monkeypatch.setattr(forms, "_compiled_forms", set())
    monkeypatch.setattr(module, "_compiled", {})
    monkeypatch.setattr(module, "_direct_launch_available", lambda: True)
    monkeypatch.setattr(module, "_current_device", lambda: 0)
    monkeypatch.setattr(module, "_run_compiled",
                        lambda hit, grid, args, device: ran.append((hit[1], grid, args)))
    return module, ran


def test_launch_compiles_once_per_form_and_alignment(direct):
    """A one-off ``launch`` goes through a plan of its own; plans of one signature share their
    compiled kernels: another length or grid of the same form reuses it, a misaligned pointer,
    another dtype, a length of 1 or another constexpr does not."""
    module, ran = direct
    kernel = _Kernel()
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    module.launch(kernel, (3, 2), a, b, 1000, _Pair(7, 1), BLOCK=32)
    module.launch(kernel, (5,), a.clone(), b, 1001, _Pair(9, 1), BLOCK=32)
    assert len(kernel.compiles) == 1 and compiled_forms() == 1
    args, grid, options = kernel.compiles[0]
    assert args[2:] == (module.UNKNOWN_INT, _Pair(module.UNKNOWN_INT, 1)) and grid == (3, 2, 1)
    assert options == dict(num_warps=4, num_stages=3, BLOCK=32)
    # The launcher gets the real values, tuples plain, and the constexprs after them.
    assert [(tail, grid) for tail, grid, _ in ran] == [((32,), (3, 2, 1)), ((32,), (5, 1, 1))]
    assert ran[1][2][2:] == (1001, (9, 1)) and type(ran[1][2][3]) is tuple
    module.launch(kernel, (5,), a[1:], b, 1001, _Pair(9, 1), BLOCK=32)  # misaligned
    module.launch(kernel, (5,), a, b.long(), 1001, _Pair(9, 1), BLOCK=32)  # another dtype
    module.launch(kernel, (5,), a, b, 1024, _Pair(9, 1), BLOCK=32)  # another length: reused
    module.launch(kernel, (5,), a, b, 1, _Pair(9, 1), BLOCK=32)  # 1 is compiled in
    module.launch(kernel, (5,), a, b, 1001, _Pair(9, 1), BLOCK=64)  # another constexpr
    assert len(kernel.compiles) == 5 and compiled_forms() == 5 and len(ran) == 7


@pytest.mark.parametrize("given", (["n"], [2]), ids=("by-name", "by-position"))
def test_an_unspecialized_int_of_1_is_no_new_form(direct, given):
    """Triton compiles a ``do_not_specialize`` int as an unknown int32, 1 included (the
    wavelet's block count is 1 below one block of positions): a launch with 1 there reuses the
    form of any other value, and the launcher gets the real value."""
    module, ran = direct
    kernel = _Kernel()
    kernel.do_not_specialize = given
    a, b = torch.zeros(64), torch.zeros(64, dtype=torch.int32)
    for n in (1001, 1, 1024):
        module.launch(kernel, (3,), a, b, n, _Pair(9, 1), BLOCK=32)
    assert len(kernel.compiles) == 1 and compiled_forms() == 1
    assert kernel.compiles[0][0][2] == module.UNKNOWN_INT
    assert [args[2] for _, _, args in ran] == [1001, 1, 1024]
    module.launch(kernel, (3,), a, b, 2**40, _Pair(9, 1), BLOCK=32)  # an int64 is another type
    assert len(kernel.compiles) == 2


def test_a_descriptor_launch_compiles_int_operands_as_unknown_ints(direct):
    """Plans of a Gluon kernel at other lengths pass other ints among a call's operands (a
    mask's list strides, a bias's strides; the kernel takes them unspecialized): one form,
    compiled for ``UNKNOWN_INT`` there, the launcher given the real values."""
    module, ran = direct
    kernel = _Kernel()
    kernel.arg_names = ["a", "stride", "n", "BLOCK"]
    operand = torch.zeros(64)
    for length, stride in ((4000, 2080), (8000, 8001), (3000, 1)):
        module.DescriptorLaunch(kernel, (4,), (length,), BLOCK=16)(operand, stride)
    assert compiled_forms() == 1
    assert {args[1:] for args, _, _ in kernel.compiles} == {(module.UNKNOWN_INT,) * 2}
    assert [args[1:] for _, _, args in ran] == [(2080, 4000), (8001, 8000), (1, 3000)]


def test_planned_and_one_off_launches_take_one_path(direct, monkeypatch):
    """Compile-only hands ``kernel.warmup`` and the form to the executor; with hooks installed
    a launch goes through ``kernel[grid]`` with the real values (a bool tensor as uint8); both
    for a plan and for ``launch``."""
    module, ran = direct
    mask, b = torch.zeros(64, dtype=torch.bool), torch.zeros(64, dtype=torch.int32)

    class Recorder:
        def __init__(self):
            self.submitted = []

        def submit(self, fn, *args, **kwargs):
            self.submitted.append((fn, args, kwargs))
            future = Future()
            future.set_result(None)
            return future

    kernel = _Kernel()
    plan = module.PlannedLaunch(kernel, (4,), None, (1000, _Pair(3, 1)), BLOCK=16)
    recorder = Recorder()
    with module.compile_only(recorder):
        for length in (1000, 1001):  # one form: the repeats start no compile
            plan(mask, b)
            module.launch(kernel, (4,), mask, b, length, _Pair(3, 1), BLOCK=16)
    assert not ran and not kernel.jit
    # The same compile from each (the plan notes its form with the mask as uint8, launch as
    # bool, as before they shared a path).
    assert len(recorder.submitted) == 2
    for fn, args, kwargs in recorder.submitted:
        assert fn == kernel.warmup and args[0].dtype == torch.uint8 and args[1] is b
        assert args[2:] == (module.UNKNOWN_INT, (module.UNKNOWN_INT, 1))
        assert kwargs == dict(grid=(4, 1, 1), num_warps=4, num_stages=3, BLOCK=16)

    monkeypatch.setattr(module, "_direct_launch_available", lambda: False)
    plan(mask, b)
    module.launch(kernel, (4,), mask, b, 1000, _Pair(3, 1), BLOCK=16)
    assert not ran and len(kernel.jit) == 2
    for grid, args, options in kernel.jit:
        assert grid == (4, 1, 1) and args[0].dtype == torch.uint8 and args[2:] == (
            1000, (3, 1))
        assert options == dict(num_warps=4, num_stages=3, BLOCK=16)
