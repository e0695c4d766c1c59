"""Host integer arithmetic and constants shared by the planners and launchers."""

from __future__ import annotations


LOG2E = 1.4426950408889634
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)


def ceil_div(a: int, b: int) -> int:
    # Host arithmetic in plain Python: triton.cdiv and triton.next_power_of_2 are Triton
    # constexpr functions, and calling them from the host cost ~5 us each on the H100 host
    # (8 calls in a masked forward; profiled with cProfile, triton 3.6).
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def padded_head_dim(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16 and power-of-two tiles; loads mask the padding.
    return max(16, next_power_of_2(head_dim))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
