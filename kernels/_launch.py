"""Host-side helpers shared by the forward and backward launchers."""

from __future__ import annotations

from collections import OrderedDict
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


# -- launching with less host time
# ``kernel[grid](...)`` runs Triton's JIT dispatch on every call: it binds and specializes
# each argument, builds a cache key and looks the compiled kernel up. On the H100 benchmark
# host that is ~37 us per launch back to back and ~75 us inside a real call, against ~9 us for
# the compiled kernel's own launcher (results/notes.md, change 18), and the backward makes
# three launches. ``launch`` does the dispatch once per argument signature and then calls the
# compiled kernel's launcher directly.
#
# The signature holds every int argument's value, each tensor's dtype and 16-byte alignment,
# every constexpr, the launch options and the current device: everything Triton specializes
# on (ints on == 1 and divisibility by 16, pointers on alignment), so a hit always gets the
# kernel Triton itself would have chosen. Floats are specialized on type only, like Triton.
MAX_SIGNATURES = 256  # per kernel; a model or a sweep uses a handful of shapes
_compiled: dict = {}


try:  # the Triton internals the direct path needs (triton 3.x)
    from triton import knobs as _knobs
    from triton.runtime import driver as _driver
except ImportError:  # pragma: no cover - older Triton: every launch takes the JIT path
    _knobs = _driver = None


def _hook_installed(hook) -> bool:
    # Triton >= 3.5 keeps hooks in an always-present HookChain; older versions use None.
    return hook is not None and bool(getattr(hook, "calls", True))


def _direct_launch_available() -> bool:
    """The direct path needs Triton's driver and no launch hooks installed (profilers such as
    proton rely on them, and only the JIT path calls them)."""
    if _knobs is None:
        return False
    runtime = _knobs.runtime
    return not (_hook_installed(runtime.launch_enter_hook)
                or _hook_installed(runtime.launch_exit_hook))


def _arg_signature(args: tuple) -> tuple:
    return tuple([a if a.__class__ is int
                  else (a.dtype, a.data_ptr() & 15) if isinstance(a, torch.Tensor)
                  else a.__class__ if a.__class__ is float
                  else a for a in args])


def launch(kernel, grid: tuple, *args, num_warps: int = 4, num_stages: int = 3, **constexprs):
    """``kernel[grid](*args, num_warps=..., num_stages=..., **constexprs)``, with Triton's
    per-call dispatch skipped on repeat signatures. ``args`` are the runtime arguments in the
    kernel's order and ``constexprs`` name every remaining parameter."""
    if is_interpreted(kernel) or not _direct_launch_available():
        return kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **constexprs)
    driver = _driver.active
    device = driver.get_current_device()
    key = (device, num_warps, num_stages, tuple(constexprs.values()), _arg_signature(args))
    cache = _compiled.setdefault(kernel, OrderedDict())
    hit = cache.get(key)
    if hit is None:
        compiled = kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **constexprs)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        # Parameters after the runtime ones, in the kernel's order: the launcher takes them
        # all (and skips the constexprs itself).
        tail = tuple(constexprs[name] for name in kernel.arg_names[len(args):])
        cache[key] = (compiled, tail)
        if len(cache) > MAX_SIGNATURES:
            cache.popitem(last=False)
        return
    compiled, tail = hit
    grid = tuple(grid) + (1, 1)
    compiled.run(grid[0], grid[1], grid[2], driver.get_current_stream(device),
                 compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)

