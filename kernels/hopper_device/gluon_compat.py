"""What the Gluon modules here import that moved between Triton releases.

- ``aggregate`` (a class whose fields travel together through jit functions as one value):
  ``gluon.aggregate`` from Triton 3.7, ``triton.language.core._aggregate`` in 3.6.
- The TMA copies: ``tma.async_load`` / ``tma.async_store`` in newer releases, which refuse the
  3.6 names ``async_copy_global_to_shared`` / ``async_copy_shared_to_global`` (same arguments).
"""

from triton.experimental.gluon.language.nvidia.hopper import tma

try:
    from triton.experimental.gluon import aggregate
except ImportError:  # Triton 3.6
    from triton.language.core import _aggregate as aggregate

tma_load = getattr(tma, "async_load", tma.async_copy_global_to_shared)
tma_store = getattr(tma, "async_store", tma.async_copy_shared_to_global)

__all__ = ["aggregate", "tma_load", "tma_store"]
