"""The direct launch path (kernels.runtime.launch.launch): what decides whether a compiled kernel is
reused. The launches themselves run in every kernel test; on a GPU (``--device cuda``) repeat
calls take the direct path, and test_repeated_calls_with_one_shape repeats one shape with
misaligned pointers."""

from __future__ import annotations

import torch


def test_specialization_is_what_triton_compiles_for():
    from kernels.runtime.launch import specialization

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
    from kernels.runtime.launch import UNKNOWN_INT, compile_form, specialization
    from kernels.triton_device.operands import Layout, ListStrides, SeqStrides, Sizes

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
    from kernels.triton_device.operands import BackwardLayouts, Layout, ListStrides, Sizes

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
