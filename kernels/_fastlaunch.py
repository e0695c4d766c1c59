"""Kernel launches with less host work per call.

Triton's ``JITFunction.run`` binds and specializes every argument in Python on every call. For
the forward kernel's ~55 arguments that cost about 80 us of host time per launch on the H100
host (triton 3.6), against 7 us of GPU time for a B1 H16/4 L256 D128 forward: small problems
were bounded by the launch path, not by the GPU (measurements in results/notes.md).

A compiled kernel depends only on the constexpr values, the launch options, each tensor's dtype
and 16-byte alignment, and each scalar's specialization (for integers: divisibility by 16,
equality to 1, 32- or 64-bit). ``launch`` keys its own cache on a superset of that (tensors by
dtype and alignment, every other argument by type and exact value), so a hit can only reuse a
kernel Triton itself would have picked. A hit calls the ``CompiledKernel``'s launcher directly;
a miss goes through ``JITFunction.run`` as before and remembers the kernel it returns.

Under the interpreter (CPU) there is no compiled kernel: every call takes Triton's own path.
"""

from __future__ import annotations

import torch

from ._launch import is_interpreted

# Distinct argument signatures remembered per kernel. Benchmarks and training loops repeat a
# handful of shapes; a workload with endlessly new shapes just starts the cache over.
MAX_ENTRIES_PER_KERNEL = 1024


def _argument_key(arg):
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    # type() too: True == 1 == 1.0 hash alike but specialize differently.
    return type(arg), arg


class _Launcher:
    def __init__(self, kernel):
        self.kernel = kernel
        self.arg_names = tuple(kernel.arg_names)
        self.interpreted = is_interpreted(kernel)
        self.compiled = {}
        self.fast_path_works = True

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args, kwargs):
        if self.interpreted or not self.fast_path_works:
            return self.kernel[grid](*args, **kwargs)
        options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages")
                   if name in kwargs}
        try:
            ordered = args + tuple(kwargs[name] for name in self.arg_names[len(args):])
        except KeyError:  # a parameter left to its default: only Triton's binder knows it
            return self.kernel[grid](*args, **kwargs, **options)
        key = (torch.cuda.current_device(), tuple(options.items()),
               tuple(map(_argument_key, ordered)))
        compiled = self.compiled.get(key)
        if compiled is not None:
            compiled[tuple(grid) + (1,) * (3 - len(grid))](*ordered)  # it wants all three axes
            return compiled
        compiled = self.kernel[grid](*args, **kwargs, **options)
        if hasattr(compiled, "result"):  # triton's asynchronous compile mode returns a future
            compiled = compiled.result()
        if not hasattr(compiled, "__getitem__"):
            # Another Triton version's return value: keep to its own launch path from now on.
            self.fast_path_works = False
            return compiled
        if len(self.compiled) >= MAX_ENTRIES_PER_KERNEL:
            self.compiled.clear()
        self.compiled[key] = compiled
        return compiled


_LAUNCHERS: dict[int, _Launcher] = {}


def launcher(kernel) -> _Launcher:
    """``launcher(kernel)[grid](*args, **kwargs)`` launches like ``kernel[grid](...)``."""
    found = _LAUNCHERS.get(id(kernel))
    if found is None or found.kernel is not kernel:
        found = _LAUNCHERS[id(kernel)] = _Launcher(kernel)
    return found
