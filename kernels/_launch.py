"""Host-side helpers shared by the forward and backward launchers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import BroadcastOperand, CheckedInputs


def is_interpreted(kernel) -> bool:
    # triton.jit returns an InterpretedFunction instead of a JITFunction when TRITON_INTERPRET=1
    # was set before the decorator ran (true for triton 3.2 through 3.9).
    return type(kernel).__name__ == "InterpretedFunction"


def ensure_runnable(kernel, device: torch.device) -> None:
    """CPU tensors only work under Triton's interpreter; say how to turn it on."""
    if device.type == "cpu" and not is_interpreted(kernel):
        raise RuntimeError(
            "dmattn on CPU tensors needs Triton's interpreter: set the environment variable "
            "TRITON_INTERPRET=1 before importing kernels (or triton), e.g. "
            "`TRITON_INTERPRET=1 python your_script.py`, or move the tensors to a CUDA device"
        )


def dot_options(dtype: torch.dtype, interpreted: bool) -> dict:
    """Compile-time dot settings shared by every kernel (see ``_score.mma``)."""
    return dict(
        # fp32 inputs are for tight gradient checks: keep the dots in true fp32, not tf32.
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        WIDEN_DOTS=interpreted and dtype == torch.bfloat16,
    )


LOG2E = 1.4426950408889634


def ceil_div(a: int, b: int) -> int:
    # Host arithmetic in plain Python: triton.cdiv and triton.next_power_of_2 are Triton
    # constexpr functions, and calling them from the host cost ~5 us each on the H100 host
    # (8 calls in a masked forward; profiled with cProfile, triton 3.6).
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def edge_slots(loop_rows: int, step_rows: int) -> int:
    """List entries read from each end by ``interior_span``: a loop over ``step_rows``-sized
    blocks crosses the causal diagonal of a ``loop_rows``-sized block in at most
    ceil(loop_rows / step_rows) + 1 blocks; a partial last block is one of those or one more."""
    return next_power_of_2(ceil_div(loop_rows, step_rows) + 2)


def padded_head_dim(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16 and power-of-two tiles; loads mask the padding.
    return max(16, next_power_of_2(head_dim))


@dataclass(frozen=True)
class OperandArgs:
    """Pointer, four strides and head divisor of an optional mask or bias, as kernel args."""

    tensor: torch.Tensor
    stride_b: int
    stride_h: int
    stride_m: int
    stride_n: int
    head_div: int

    def as_args(self) -> tuple:
        return (self.tensor, self.stride_b, self.stride_h, self.stride_m, self.stride_n,
                self.head_div)


def operand_args(op: BroadcastOperand | None, placeholder: torch.Tensor) -> OperandArgs:
    """Kernel arguments for a broadcast view. Absent operands pass a placeholder pointer that
    the kernel never dereferences (HAS_MASK / HAS_BIAS are compile-time False)."""
    if op is None:
        return OperandArgs(placeholder, 0, 0, 0, 0, 1)
    view = op.view
    if view.dtype == torch.bool:
        # Same bytes, viewed as uint8: no copy, and a plain integer load in every Triton version.
        view = view.view(torch.uint8)
    sb, sh, sm, sn = view.stride()
    return OperandArgs(view, sb, sh, sm, sn, op.head_div)


def bias_has_one_row(checked: CheckedInputs) -> bool:
    """The bias is broadcast over queries (flash-dmattn's default kv_row shape)."""
    return checked.bias is not None and checked.bias.original_shape[2] == 1


def multiprocessors(device: torch.device, interpreted: bool) -> int:
    """Multiprocessor count, which sizes split-K. The interpreter pretends to have 16, so that
    small CPU test shapes (decode rows over a few hundred keys) take the split path too."""
    if interpreted:
        return 16
    return torch.cuda.get_device_properties(device).multi_processor_count


def key_splits(programs: int, key_blocks: int, multiprocessor_count: int) -> int:
    """How many ways to split the key axis so that a small grid (decode) fills the GPU.

    Splits only when the grid has fewer programs than multiprocessors, aims at two programs
    per multiprocessor, and keeps at least 4 key blocks per split so the merge stays cheap.
    """
    if programs >= multiprocessor_count:
        return 1
    return max(1, min(ceil_div(2 * multiprocessor_count, programs), key_blocks // 4, 128))
