"""Flash dynamic-mask attention in Triton.

``dmattn_func(query, key, value, attn_mask=None, attn_bias=None, is_causal=False,
softmax_scale=None, return_lse=False, deterministic=False)``; ``triton_dmattn_func`` is the same
function under flash-dmattn's name. ``prepare_mask`` reads a mask once for every call that
shares it. ``KeyIntervals`` is a mask in O(Lk) memory (each key's run of query rows);
``topk_intervals`` builds flash-dmattn's top-W dynamic mask as one; ``dmattn_func`` takes
either as ``attn_mask``. ``dmattn_varlen_func`` takes flash-attn's packed (varlen) layout.
``schedule_for`` shows what a call will run (``kernels.schedule``). ``attention_reference`` is
the eager ground truth and ``tolerance`` the accuracy rule. ``warmup`` compiles ahead the
kernels a model's calls will need; ``compiled_forms`` counts the compiles so far.
``record_routes`` names the kernels (forward and backward routes) the calls inside it took.
"""

from . import tolerance
from .interface import dmattn_func, schedule_for, triton_dmattn_func
from .masks.intervals import KeyIntervals
from .planning import schedule
from .prepared import PreparedMask, prepare_mask
from .reference import attention_reference, attention_varlen_reference
from .runtime.forms import compiled_forms
from .runtime.routes import RouteLog, record_routes
from .topk_ops import topk_intervals
from .varlen import dmattn_varlen_func
from .warmup import WarmupReport, warmup

__all__ = ["dmattn_func", "triton_dmattn_func", "dmattn_varlen_func", "prepare_mask",
           "PreparedMask", "KeyIntervals", "topk_intervals", "attention_reference",
           "attention_varlen_reference", "schedule_for", "schedule", "tolerance", "warmup",
           "WarmupReport", "compiled_forms", "record_routes", "RouteLog"]
