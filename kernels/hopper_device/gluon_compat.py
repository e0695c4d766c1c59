"""What the Gluon modules here import that moved between Triton releases.

- ``aggregate`` (a class whose fields travel together through jit functions as one value):
  ``gluon.aggregate`` from Triton 3.7, ``triton.language.core._aggregate`` in 3.6.
- The TMA copies: ``tma.async_load`` / ``tma.async_store`` in newer releases, which refuse the
  3.6 names ``async_copy_global_to_shared`` / ``async_copy_shared_to_global`` (same arguments).
- ``tma_atomic_add`` (a TMA reduce-add of a shared tile into global memory): newer releases'
  ``tma.async_atomic_add``; 3.6 has the builder's operation but no Python name for it.
- ``thread_barrier`` (every thread of the partition reaches it before any goes on): 3.6's
  ``gl.thread_barrier``, ``gl.barrier`` in newer releases.
- ``reinterpret`` (a shared tile seen with another dtype, shape and layout): the shared
  descriptor's ``reinterpret`` in newer releases, ``_reinterpret`` in 3.6.
"""

from triton._C.libtriton import ir
from triton.experimental.gluon.language._core import builtin
from triton.language.core import _unwrap_if_constexpr
from triton.experimental.gluon.language.nvidia.hopper import tma

try:
    from triton.experimental.gluon import aggregate
except ImportError:  # Triton 3.6
    from triton.language.core import _aggregate as aggregate

from triton.experimental.gluon import language as _gl

thread_barrier = getattr(_gl, "thread_barrier", None) or _gl.barrier
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


__all__ = ["aggregate", "reinterpret", "thread_barrier", "tma_atomic_add", "tma_load",
           "tma_store"]
