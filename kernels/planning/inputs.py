"""Input validation and broadcast normalization shared by the kernels and the reference.

Every user mistake is reported as ``TypeError`` (wrong kind of object or dtype) or ``ValueError``
(wrong shape or value) with a message that names the argument and says what was expected.
Plain ``if ... raise`` is used throughout: ``assert`` vanishes under ``python -O``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch

from ..masks.intervals import KeyIntervals
from .operands import ABSENT, Layout

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class AttnShape:
    """Problem sizes. Query is (batch, seqlen_q, heads_q, head_dim); key/value use heads_kv."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 for MHA, heads_q for MQA)."""
        return self.heads_q // self.heads_kv


@dataclass(frozen=True)
class BroadcastOperand:
    """A mask or bias seen as a 4-D (batch, heads, seqlen_q, seqlen_k) view without copies.

    Batch and sequence axes of size 1 are expanded to stride 0. The head axis keeps its own size
    (1, heads_kv or heads_q); query head ``h`` reads head ``h // head_div`` of it, which is the
    same formula for all three sizes.
    """

    view: torch.Tensor
    head_div: int
    original_shape: tuple[int, ...]
    # A mask given as ``KeyIntervals``: their int32 (start, end) pairs interleaved per key,
    # (Bm', Hm', Lk, 2); ``view`` addresses them as one int64 word per key with query stride 0
    # (``_check_intervals``); ``interval_source`` is the (start, end) tensors they came from.
    interval_pairs: torch.Tensor | None = None
    interval_source: tuple[torch.Tensor, torch.Tensor] | None = None
    # The same intervals' start and end as given, each viewed as a (B, Hm', Lq, Lk) operand
    # with query stride 0, where both have one dtype and layout (None otherwise): a forward
    # that reads them itself (``forward_schedule.ForwardSchedule.scan_keys``) reads these.
    interval_pair: tuple[torch.Tensor, torch.Tensor] | None = None
    # ``KeyIntervals.max_kept``: at most this many distinct keys kept by all query rows
    # together, per (batch, head), where known.
    max_kept: int | None = None
    # ``KeyIntervals._documents``: (cu_seqlens_q, cu_seqlens_k, causal) of intervals that are
    # exactly a packed batch's documents, else None.
    documents: tuple | None = None
    # ``KeyIntervals._row_kept``: at most this many keys kept by any one query row, where known.
    row_kept: int | None = None


def _check_qkv(query, key, value) -> AttnShape:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}"
            )
        if t.numel() == 0:
            raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}")
    if query.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"query dtype must be float16, bfloat16 or float32, got {query.dtype}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise TypeError(f"{name} dtype must match query dtype {query.dtype}, got {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name} must be on query's device {query.device}, got {t.device}")
    b, lq, hq, d = query.shape
    bk, lk, hk, dk = key.shape
    if bk != b:
        raise ValueError(f"key batch must equal query batch {b}, got {bk}")
    if dk != d:
        raise ValueError(f"key head_dim must equal query head_dim {d}, got {dk}")
    if tuple(value.shape) != tuple(key.shape):
        raise ValueError(
            f"value shape must equal key shape {tuple(key.shape)}, got {tuple(value.shape)}"
        )
    if d > MAX_HEAD_DIM:
        raise ValueError(f"query head_dim must be at most {MAX_HEAD_DIM}, got {d}")
    if hq % hk != 0:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of key/value heads ({hk}) for MHA/GQA/MQA"
        )
    return AttnShape(b, lq, lk, hq, hk, d)


def _check_broadcast(name: str, t: torch.Tensor, shape: AttnShape, device) -> BroadcastOperand:
    if t.dim() != 4:
        raise ValueError(
            f"{name} must be 4-D (batch, heads, seqlen_q, seqlen_k), got shape {tuple(t.shape)}"
        )
    if t.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on query's device {device}, got {t.device}")
    allowed = (
        ("batch", {1, shape.batch}),
        ("heads", {1, shape.heads_kv, shape.heads_q}),
        ("seqlen_q", {1, shape.seqlen_q}),
        ("seqlen_k", {1, shape.seqlen_k}),
    )
    for axis, (axis_name, sizes) in enumerate(allowed):
        if t.shape[axis] not in sizes:
            raise ValueError(
                f"{name} dimension {axis} ({axis_name}) must be one of {sorted(sizes)}, "
                f"got shape {tuple(t.shape)}"
            )
    heads = t.shape[1]
    view = t.expand(shape.batch, heads, shape.seqlen_q, shape.seqlen_k)
    return BroadcastOperand(view, shape.heads_q // heads, tuple(t.shape))


def interval_words(pairs: torch.Tensor) -> torch.Tensor:
    """The int64 (Bm', Hm', Lk) view of int32 (start, end) pairs (Bm', Hm', Lk, 2) whose last
    two axes are contiguous (``KeyIntervals.kernel_operand``: rows of an even number of
    keys): one word per key, its start in the low half and its end in the high half
    (little-endian, as every CUDA device and CPU torch runs on). No copy."""
    return pairs.view(torch.int64).squeeze(-1)


def _check_intervals(intervals, shape: AttnShape, device) -> BroadcastOperand:
    """A ``KeyIntervals`` mask as the kernels read it: (start, end) int32 pairs interleaved per
    key (``KeyIntervals.kernel_operand``), (Bm', Hm', Lk, 2) with broadcast batch or head axes
    cut to one (O(Bm' Hm' Lk) bytes, never O(Lq Lk)), read as one int64 word per key
    (``interval_words``) and viewed as a (B, Hm', Lq, Lk) operand whose query stride is 0."""
    intervals.check_against(shape.batch, shape.heads_q, shape.heads_kv, shape.seqlen_q,
                            shape.seqlen_k, device=device)
    pairs = intervals.kernel_operand()  # (Bm', Hm', Lk, 2)
    words = interval_words(pairs)
    batch, heads = words.shape[0], words.shape[1]
    size = (shape.batch, heads, shape.seqlen_q, shape.seqlen_k)
    view = words.as_strided(size, (0 if batch == 1 else words.stride(0), words.stride(1), 0, 1))
    return BroadcastOperand(view, shape.heads_q // heads, size, pairs,
                            (intervals.start, intervals.end), _pair_views(intervals, size),
                            intervals.max_kept, intervals._documents, intervals._row_kept)


def _pair_views(intervals, size: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``BroadcastOperand.interval_pair`` of intervals whose broadcast axes collapse to
    ``size``'s (B, Hm', Lq, Lk): None unless start and end share a dtype and their strides."""
    start, end = intervals.start, intervals.end
    if start.dtype != end.dtype:
        return None
    strides = []
    for axis, kept in ((0, size[0] > 1 and start.shape[0] > 1), (1, size[1] > 1)):
        if kept and start.stride(axis) != end.stride(axis):
            return None
        strides.append(start.stride(axis) if kept else 0)
    if size[3] > 1 and start.stride(2) != end.stride(2):
        return None
    strides = (*strides, 0, start.stride(2) if size[3] > 1 else 1)
    return start.as_strided(size, strides), end.as_strided(size, strides)


@dataclass(frozen=True)
class CheckedInputs:
    shape: AttnShape
    mask: BroadcastOperand | None
    bias: BroadcastOperand | None
    softmax_scale: float


def check_inputs(query, key, value, attn_mask, attn_bias, softmax_scale) -> CheckedInputs:
    """Validate everything and return the normalized views. Raises TypeError/ValueError."""
    shape = _check_qkv(query, key, value)
    mask = bias = None
    if isinstance(attn_mask, KeyIntervals):
        mask = _check_intervals(attn_mask, shape, query.device)
    elif attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a bool torch.Tensor, KeyIntervals or None, "
                            f"got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool:
            raise TypeError(f"attn_mask dtype must be torch.bool (True = keep), got {attn_mask.dtype}")
        mask = _check_broadcast("attn_mask", attn_mask, shape, query.device)
    if attn_bias is not None:
        if not isinstance(attn_bias, torch.Tensor):
            raise TypeError(f"attn_bias must be a torch.Tensor or None, got {type(attn_bias).__name__}")
        if attn_bias.dtype != query.dtype:
            raise TypeError(
                f"attn_bias dtype must equal query dtype {query.dtype}, got {attn_bias.dtype}"
            )
        bias = _check_broadcast("attn_bias", attn_bias, shape, query.device)
    return CheckedInputs(shape, mask, bias, resolve_scale(softmax_scale, shape.head_dim))


def resolve_scale(softmax_scale, head_dim: int) -> float:
    """None means 1/sqrt(head_dim); any finite real number (0.0 included) is used as given."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, Real):
        raise TypeError(
            f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}"
        )
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {scale}")
    return scale


def check_flags(**flags) -> None:
    """Boolean arguments must be bools: a string such as "yes" is truthy and would otherwise be
    taken silently."""
    for name, value in flags.items():
        if value.__class__ is not bool:
            raise TypeError(f"{name} must be a bool (True or False), got "
                            f"{type(value).__name__} {value!r}")


def operand_args(op: BroadcastOperand | None) -> Layout:
    """The ``Layout`` of a broadcast view; ``ABSENT`` for an absent operand, whose pointer is a
    placeholder that the kernel never dereferences (HAS_MASK / HAS_BIAS are compile-time
    False)."""
    if op is None:
        return ABSENT
    return Layout(*op.view.stride(), op.head_div)


def operand_pointer(t: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """What a mask or bias passes as its pointer argument: the tensor itself (its broadcast
    view has the same address), or ``placeholder`` when absent. A bool mask stays bool here;
    Triton is handed its uint8 view (``_kernel_arg``) only where it reads the dtype."""
    return placeholder if t is None else t
