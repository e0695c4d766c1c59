"""Adapters that plug ``kernels.dmattn_func`` into other libraries.

Each adapter is a module of its own, imported only by users who want it (``transformers``
needs the optional ``hf`` extra). Nothing here registers anything at import: each adapter
exposes a ``register()`` to call.
"""
