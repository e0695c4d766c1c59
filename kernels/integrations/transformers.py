"""``attn_implementation="dmattn"``: transformers models on ``kernels.dmattn_func``.

``register()`` installs three things, all under the name ``"dmattn"``:

1. An attention function in transformers' ``AttentionInterface``. Llama-family models (Llama,
   Qwen2, Mistral, ...) call it with query (B, Hq, L, D), key and value (B, Hk, L, D), the mask
   their mask builder made, ``scaling``, ``dropout`` and, for sliding-window layers,
   ``sliding_window``. It hands ``dmattn_func`` (B, L, H, D) views of the same tensors (a
   transpose, no copy), with GQA left to the kernel; under autocast, in autocast's dtype.
2. A mask builder in ``AttentionMaskInterface``, so that the model's ``create_causal_mask`` /
   ``create_sliding_window_causal_mask`` never builds an (Lq, Lk) mask for the plain causal or
   sliding-window pattern. For those it returns None (no padding) or the 2-D (B, Lk) bool key
   padding mask, which reaches the kernel as key intervals (``masking``). Packed sequences
   (position ids that restart, no attention mask: transformers' packed-sequence mask over
   either pattern) get their documents as ``KeyIntervals`` (B, 1, L), O(L). Any other pattern
   (overlays such as bidirectional image tokens, chunked attention, static caches whose
   offsets are tensors) gets transformers' own 4-D bool mask, which the attention function
   takes as the whole truth.
3. A forward for Doge's attention module, used when the model's attention implementation is
   ``"dmattn"``. Doge turns a per-key bias computed from the values (``dt_proj``, ``A``) into a
   (B, H, Lq, Lk) float mask and keeps each row's ``keep_window_size`` largest entries. Its
   forward here passes the per-key bias to the kernel as ``attn_bias`` (B, Hk, 1, Lk), so the
   bias gradient flows back to ``dt_proj`` and ``A`` through the kernel, and the top-W selection
   as key intervals (``masking.doge_masking``; a bool mask only where transformers hands a 4-D
   mask or a sliding window hides keys). The (B, H, Lq, Lk) float mask is never built.

The pinned transformers version is the one this adapter was read against: the mask builder
recognizes transformers' causal and sliding-window mask functions, and Doge's forward follows
its attention module's layout.
"""

from __future__ import annotations

import functools

import torch
# Imported here, once, not inside the functions a compiled model traces: under torch 2.11
# Dynamo breaks the graph at every import from transformers' lazy modules (5 breaks per
# compiled Doge model).
from transformers import AttentionInterface
from transformers import masking_utils as mu
from transformers.utils.import_utils import is_tracing

from ..interface import dmattn_func
from .masking import Masking, causal_family_masking, document_intervals, doge_masking

IMPLEMENTATION = "dmattn"
_doge_rotary = None  # transformers' Doge rotary embedding, bound by register()


def register() -> None:
    """Make ``attn_implementation="dmattn"`` available to every transformers model.

    Safe to call more than once. Needs the ``hf`` extra (transformers).
    """
    AttentionInterface.register(IMPLEMENTATION, dmattn_attention_forward)
    mu.AttentionMaskInterface.register(IMPLEMENTATION, dmattn_mask)
    _route_doge_attention()


# -- the mask builder -------------------------------------------------------------------------

def dmattn_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                mask_function=None, attention_mask=None, allow_is_causal_skip: bool = True,
                use_vmap: bool = False, **kwargs):
    """transformers' mask-builder interface. Returns None or a (B, kv_length) bool key padding
    mask for the plain causal / sliding-window pattern, else transformers' 4-D bool mask.

    The plain result is exact only with the last query aligned to the last key (the kernel's
    causal rule is bottom-right aligned), so offsets that break that alignment, or that are
    tensors (a static cache), take the 4-D mask.
    """
    aligned = (isinstance(q_offset, int) and isinstance(kv_offset, int)
               and q_offset + q_length == kv_offset + kv_length)
    documents = _packed_documents(mask_function)
    if (documents is not None and not use_vmap and aligned and attention_mask is None
            and q_offset == kv_offset == 0 and documents.shape[-1] == kv_length):
        return document_intervals(documents)
    if allow_is_causal_skip and not use_vmap and aligned and _is_plain_causal(mask_function):
        if attention_mask is None:
            return None
        padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        padding = padding[:, kv_offset:kv_offset + kv_length].to(torch.bool)
        if not is_tracing(padding) and bool(padding.all()):
            return None
        return padding
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                        q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                        attention_mask=attention_mask, allow_is_causal_skip=False,
                        use_vmap=use_vmap, **kwargs)


def _is_plain_causal(mask_function) -> bool:
    """Whether ``mask_function`` is transformers' causal mask function, or its sliding-window
    causal one (an ``and_masks`` of the window overlay and the causal function). The window
    itself reaches the attention function as its ``sliding_window`` argument."""
    if mask_function is None or mask_function is mu.causal_mask_function:
        return True
    pair = _and_pair(mask_function)
    if pair is None:
        return False
    overlay, causal = pair
    overlay_name = mu.sliding_window_overlay(1).__qualname__
    return (causal is mu.causal_mask_function and callable(overlay)
            and getattr(overlay, "__qualname__", "") == overlay_name)


def _packed_documents(mask_function) -> torch.Tensor | None:
    """The (B, L) document indices of transformers' packed-sequence mask (position ids that
    restart, no attention mask): an ``and_masks`` of a plain causal or sliding-window causal
    function (``_is_plain_causal``) and ``packed_sequence_mask_function``'s; else None."""
    pair = _and_pair(mask_function)
    if pair is None:
        return None
    pattern, packed = pair
    packed_name = mu.packed_sequence_mask_function(None).__qualname__
    if not _is_plain_causal(pattern) or getattr(packed, "__qualname__", "") != packed_name:
        return None
    (documents,) = _closure_values(packed)
    return documents if isinstance(documents, torch.Tensor) and documents.dim() == 2 else None


def _and_pair(mask_function) -> tuple | None:
    """The two mask functions of transformers' ``and_masks`` of two, or None."""
    if getattr(mask_function, "__qualname__", "") != mu.and_masks().__qualname__:
        return None
    parts = _closure_values(mask_function)
    if len(parts) != 1 or not isinstance(parts[0], tuple) or len(parts[0]) != 2:
        return None
    return parts[0]


def _closure_values(fn) -> list:
    return [cell.cell_contents for cell in (getattr(fn, "__closure__", None) or ())]


# -- the Llama family -------------------------------------------------------------------------

def dmattn_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             dropout: float = 0.0, scaling: float | None = None,
                             sliding_window: int | None = None, is_causal: bool | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: (B, H, L, D) in, (B, L, Hq, D) out."""
    _reject_unsupported(dropout=dropout, softcap=kwargs.get("softcap"),
                        s_aux=kwargs.get("s_aux"), position_bias=kwargs.get("position_bias"))
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    masking = causal_family_masking(attention_mask, query.shape[2], key.shape[2], bool(causal),
                                    sliding_window, query.dtype, query.device)
    return _attend(query, key, value, masking, scaling), None


def _reject_unsupported(**options) -> None:
    """The kernel has no attention dropout, softcap, sinks or extra position bias."""
    for name, value in options.items():
        if name == "dropout":
            if value:
                raise ValueError(f"dropout: dmattn has no attention dropout, got {value}; set "
                                 f"the config's attention_dropout to 0 or call model.eval()")
        elif value is not None:
            raise ValueError(f"{name}: not supported by attn_implementation='dmattn'")


def _attend(query, key, value, masking: Masking, scaling) -> torch.Tensor:
    """(B, H, L, D) inputs as (B, L, H, D) views; the output is (B, Lq, Hq, D). Under autocast
    query, key and value take autocast's dtype (transformers' sdpa attention runs in it too);
    the bias takes the query's."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    bias = masking.attn_bias
    if bias is not None:
        bias = bias.to(query.dtype)
    return dmattn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                       attn_mask=masking.attn_mask, attn_bias=bias,
                       is_causal=masking.is_causal, softmax_scale=scaling)


# -- Doge -------------------------------------------------------------------------------------

def doge_attention_forward(module: torch.nn.Module, hidden_states: torch.Tensor,
                           position_embeddings: tuple[torch.Tensor, torch.Tensor],
                           attention_mask: torch.Tensor | None = None, past_key_values=None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """Doge's attention with the per-key bias and the top-W mask going to the kernel."""
    batch, seqlen = hidden_states.shape[:-1]
    per_head = (batch, seqlen, -1, module.head_dim)
    query = module.q_norm(module.q_proj(hidden_states).view(per_head)).transpose(1, 2)
    key = module.k_norm(module.k_proj(hidden_states).view(per_head)).transpose(1, 2)
    value = module.v_proj(hidden_states).view(per_head).transpose(1, 2)
    query, key = _doge_rotary(query, key, *position_embeddings)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, module.layer_idx)

    _reject_unsupported(dropout=module.attention_dropout if module.training else 0.0)
    # Ranked in its own dtype, as Doge's eager mask is; _attend casts it for the kernel.
    bias = doge_key_bias(module, value)
    masking = doge_masking(attention_mask, bias, seqlen_q=seqlen,
                           is_causal=getattr(module, "is_causal", True),
                           sliding_window=module.config.sliding_window,
                           keep_window=module.keep_window_size)
    out = _attend(query, key, value, masking, module.scaling)
    return module.o_proj(out.reshape(batch, seqlen, -1)), None


def doge_key_bias(module: torch.nn.Module, value: torch.Tensor) -> torch.Tensor:
    """Doge's per-key bias exp(A * softplus(dt_proj(values))), as (B, Hk, 1, Lk) with unit key
    stride: the key stride is part of a kernel's compile form (a strided bias compiles kernels
    that ``kernels.warmup``'s "kv_row" bias does not) and only unit-stride keys load as
    vectors. The copy is B * Hk * Lk elements."""
    batch, _, seqlen_k, _ = value.shape
    dt = module.dt_proj(value.transpose(1, 2).reshape(batch, seqlen_k, -1))
    bias = torch.exp(module.A * torch.nn.functional.softplus(dt)).transpose(1, 2).contiguous()
    return bias[:, :, None, :]


def _route_doge_attention() -> None:
    """Wrap ``DogeAttention.forward`` once: modules whose config selects ``"dmattn"`` take
    ``doge_attention_forward``, every other module its original forward."""
    global _doge_rotary
    try:
        from transformers.models.doge.modeling_doge import DogeAttention, apply_rotary_pos_emb
    except ImportError:  # a transformers without Doge: nothing to route
        return
    # Bound here, not imported in the forward (see the imports at the top).
    _doge_rotary = apply_rotary_pos_emb
    original = DogeAttention.forward
    if getattr(original, "dmattn_original", None) is not None:
        return

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if self.config._attn_implementation == IMPLEMENTATION:
            return doge_attention_forward(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    forward.dmattn_original = original
    DogeAttention.forward = forward
