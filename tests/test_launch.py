"""The direct launch path (kernels._launch.launch): what decides whether a compiled kernel is
reused. The launches themselves run in every kernel test; on a GPU (``--device cuda``) repeat
calls take the direct path, and test_repeated_calls_with_one_shape repeats one shape with
misaligned pointers."""

from __future__ import annotations

import torch


def test_launch_signature_keeps_what_triton_specializes_on():
    from kernels._launch import _arg_signature

    base = torch.zeros(8, dtype=torch.float16)
    shifted = base[1:]  # the same storage, 2 bytes further: not 16-byte aligned
    assert _arg_signature((base, 16, 1.5)) == _arg_signature((base.clone(), 16, 2.5))
    assert _arg_signature((base, 16)) != _arg_signature((shifted, 16))
    assert _arg_signature((base, 16)) != _arg_signature((base.float(), 16))
    assert _arg_signature((base, 16)) != _arg_signature((base, 17))
    assert _arg_signature((base, 1)) != _arg_signature((base, 2))


def test_launch_hooks_send_launches_through_triton():
    from kernels._launch import _hook_installed

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
    from kernels._launch import _plain
    from kernels._operands import BackwardLayouts, Layout, ListStrides, Sizes

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
