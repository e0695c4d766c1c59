"""What the Gluon modules here import that moved between Triton releases.

- ``aggregate`` (a class whose fields travel together through jit functions as one value):
  ``gluon.aggregate`` from Triton 3.7, ``triton.language.core._aggregate`` in 3.6.
- The TMA copies: ``tma.async_load`` / ``tma.async_store`` in newer releases, which refuse the
  3.6 names ``async_copy_global_to_shared`` / ``async_copy_shared_to_global`` (same arguments).
- ``tma_atomic_add`` (a TMA reduce-add of a shared tile into global memory): newer releases'
  ``tma.async_atomic_add``; 3.6 has the builder's operation but no Python name for it.
- ``thread_barrier`` (every thread of the partition reaches it before any goes on): 3.6's
  ``gl.thread_barrier``, ``gl.barrier`` in newer releases.
- ``store_wait_written`` (every TMA store and reduce this thread issued has been written to
  global memory, not only read from shared memory: before a release that another program
  acquires): newer releases' ``tma.store_wait(0, read_only=False)``; 3.6 waits only for the
  reads, so the wait is written in PTX.
- ``reinterpret`` (a shared tile seen with another dtype, shape and layout): the shared
  descriptor's ``reinterpret`` in newer releases, ``_reinterpret`` in 3.6.
"""

import inspect

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.language.core import _unwrap_if_constexpr
from triton.experimental.gluon.language.nvidia.hopper import tma

try:
    from triton.experimental.gluon import aggregate
except ImportError:  # Triton 3.6
    from triton.language.core import _aggregate as aggregate

thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
STORE_WAIT_READ_ONLY = gl.constexpr(
    "read_only" in inspect.signature(tma.store_wait).parameters)


@gluon.jit
def store_wait_written():
    """Wait until this thread's TMA stores and reduce-adds are written to global memory."""
    if STORE_WAIT_READ_ONLY:
        tma.store_wait(0, read_only=False)
    else:
        gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tmov.u32 $0, 0;", "=r", [],
                                   dtype=gl.int32, is_pure=False, pack=1)


tma_load = getattr(tma, "async_load", tma.async_copy_global_to_shared)
tma_store = getattr(tma, "async_store", tma.async_copy_shared_to_global)


@builtin
def _tma_atomic_add_36(tensor_desc, coord, src, _semantic=None):
    """Add the shared tile ``src`` into ``tensor_desc``'s box at ``coord`` (TMA reduce)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle,
                                              coord, src.handle)


tma_atomic_add = getattr(tma, "async_atomic_add", _tma_atomic_add_36)


@builtin
def reinterpret(tile, dtype, shape, layout, _semantic=None):
    """``tile`` seen as a shared tile of ``dtype``, ``shape`` and ``layout`` (its bytes)."""
    return _semantic.memdesc_reinterpret(tile, _unwrap_if_constexpr(dtype),
                                         [_unwrap_if_constexpr(s) for s in shape],
                                         _unwrap_if_constexpr(layout))


__all__ = ["aggregate", "reinterpret", "store_wait_written", "thread_barrier",
           "tma_atomic_add", "tma_load", "tma_store"]
