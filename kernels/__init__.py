"""Flash dynamic-mask attention in Triton.

``dmattn_func(query, key, value, attn_mask=None, attn_bias=None, is_causal=False,
softmax_scale=None, return_lse=False, deterministic=False)``; ``triton_dmattn_func`` is the same
function under flash-dmattn's name. ``attention_reference`` is the eager ground truth.
"""

from .interface import dmattn_func, triton_dmattn_func
from .reference import attention_reference

__all__ = ["dmattn_func", "triton_dmattn_func", "attention_reference"]
