"""One attention call as far as its schedule depends on it.

``Problem`` holds the sizes, dtype, device, the mask's and bias's broadcast layouts
(``OperandLayout``), causality, scale, what the backward must produce and the mask's counted
activity. ``problem_of`` makes it from checked inputs. ``kernels.schedule`` decides what runs for
a Problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..runtime.arith import padded_head_dim
from .inputs import AttnShape, CheckedInputs


@dataclass(frozen=True)
class OperandLayout:
    """A mask's or bias's broadcast layout: its own 4-D shape, and the divisor that maps a query
    head to its head (query head h reads head h // head_div)."""

    shape: tuple[int, int, int, int]
    head_div: int

    @property
    def one_row(self) -> bool:
        """Broadcast over queries (flash-dmattn's (B, Hk, 1, Lk) bias)."""
        return self.shape[2] == 1

    def shared_by(self, heads: int) -> bool:
        """Every one of ``heads`` consecutive query heads (a GQA group or part) reads one head."""
        return self.head_div % heads == 0


@dataclass(frozen=True)
class Problem:
    """One call, as far as the schedule depends on it. ``activity`` is the mask's activity map
    (``activity.ActivityMap``); only the shares it has counted are read."""

    shape: AttnShape
    dtype: torch.dtype
    device: torch.device
    interpreted: bool
    multiprocessors: int
    is_causal: bool
    softmax_scale: float
    mask: OperandLayout | None = None
    bias: OperandLayout | None = None
    deterministic: bool = False
    bias_grad: bool = False
    activity: object = field(default=None, compare=False, repr=False)
    # The mask is ``KeyIntervals`` that this call reads itself (not prepared), whose start and
    # end share one dtype and layout, so that the forward can read them as given.
    interval_pair: bool = False
    # No backward follows this call's forward (no gradient is wanted).
    forward_only: bool = False
    # The mask is ``KeyIntervals``: prepared, read by the call, or varlen's documents.
    intervals: bool = False
    # The GPU's compute capability (None under the interpreter), and whether q, k and v can
    # be read through TMA descriptors: the last dim contiguous, every other stride a multiple
    # of 16 bytes (``tma_strides``). Both choose between the device code families.
    capability: tuple[int, int] | None = None
    tma_operands: bool = False
    # The mask's bytes or interval words can be read by a TMA descriptor (``tma_mask``).
    tma_mask: bool = False
    # ``KeyIntervals.max_kept`` of the mask: at most this many distinct keys kept by all query
    # rows together, per (batch, mask head).
    max_kept: int | None = None
    # The mask is prepared (``prepare_mask``, or intervals a former call prepared): the call
    # brings its activity map, and a KeyIntervals mask arrives as its words.
    prepared: bool = False
    # The most keys that the query rows together keep in one (batch, mask head), where
    # ``prepare_mask`` counted them (decode-sized calls).
    kept_keys: int | None = None
    # The bias can be read by a TMA descriptor as (Bb, Hb, 1, Lk) rows or (Bb, Hb, Lq, Lk)
    # tiles (``tma_bias``).
    tma_bias: bool = False
    # The mask is the documents of a packed batch (``KeyIntervals._documents``), one batch: how
    # many sequences the offsets pack; else None. Their causality is their own (a packed call
    # over cross-attention offsets may be non-causal while each sequence is causal).
    documents: int | None = None
    # ``KeyIntervals._row_kept`` of the mask: at most this many keys kept by one query row.
    row_kept: int | None = None
    # The backward is being captured into a CUDA graph, whose replays carry no host time
    # (``tuning.HOPPER_BACKWARD_SPLIT_CAPTURED``); set by ``backward.attention_backward``.
    captured: bool = False

    @property
    def block_d(self) -> int:
        return padded_head_dim(self.shape.head_dim)


def tma_strides(*tensors: torch.Tensor) -> bool:
    """Whether a TMA descriptor can address each tensor as it is laid out: last dim contiguous,
    the other strides multiples of 16 bytes. (Its address must be 16-byte aligned too; that
    is a property of each call, tested where the descriptors are made.)"""
    for t in tensors:
        if t.stride(-1) != 1 or any(st * t.element_size() % 16 for st in t.stride()[:-1]):
            return False
    return True


def tma_mask(mask) -> bool:
    """Whether a TMA descriptor can read what the masked Hopper forward reads of a mask's
    broadcast view (``BroadcastOperand``): a bool mask's bytes as (Bm, Hm, Lq or 1, Lk), or
    KeyIntervals' words as (Bm, Hm, Lk) int64. The keys must be contiguous, and every stride
    of an axis longer than 1 that is not 0 a multiple of 16 bytes (a stride-0 or length-1 axis
    is read at index 0). Its address is each call's to check."""
    if mask is None:
        return False
    view = mask.view
    if mask.interval_pairs is None and view.dtype != torch.bool:
        return False
    if view.stride(3) != 1 and view.shape[3] != 1:
        return False
    if (mask.interval_pairs is None and mask.original_shape[2] > 1
            and view.stride(2) == 0):
        return False  # rows expanded with stride 0: neither one row nor a row per query row
    axes = (0, 1) if mask.interval_pairs is not None else (0, 1, 2)
    return all(view.stride(a) * view.element_size() % 16 == 0 for a in axes
               if view.shape[a] > 1)


def tma_bias(bias) -> bool:
    """Whether a TMA descriptor can read the bias (``bias``: its ``BroadcastOperand``) as the
    Hopper forward copies it: a bias of one row per (batch, head) as (Bb, Hb, 1, Lk) rows, a
    full bias as (Bb, Hb, Lq, Lk) tiles; the keys contiguous, and the strides of the other
    axes longer than 1 that are not 0 multiples of 16 bytes. Its address is each call's to
    check."""
    if bias is None:
        return False
    view = bias.view
    if view.stride(3) != 1:
        return False
    axes = (0, 1) if bias.original_shape[2] == 1 else (0, 1, 2)
    return all(view.stride(a) * view.element_size() % 16 == 0 for a in axes
               if view.shape[a] > 1 and view.stride(a) != 0)


def problem_of(checked: CheckedInputs, dtype: torch.dtype, device: torch.device,
               interpreted: bool, multiprocessors: int, is_causal: bool,
               deterministic: bool = False, bias_grad: bool = False,
               activity=None, intervals_per_call: bool = False,
               forward_only: bool = False, capability: tuple[int, int] | None = None,
               tma_operands: bool = False, kept_keys: int | None = None) -> Problem:
    """The Problem of checked inputs. ``intervals_per_call``: the mask is ``KeyIntervals`` that
    the call reads itself (not prepared); ``forward_only``: no backward follows;
    ``capability`` and ``tma_operands`` as ``Problem`` says."""
    def layout(op):
        return None if op is None else OperandLayout(tuple(op.original_shape), op.head_div)

    pair = (intervals_per_call and checked.mask is not None
            and checked.mask.interval_pair is not None)
    intervals = checked.mask is not None and checked.mask.interval_pairs is not None
    packed = checked.mask.documents if intervals else None
    documents = (packed[0].numel() - 1 if packed is not None and checked.shape.batch == 1
                 else None)
    return Problem(checked.shape, dtype, device, interpreted, multiprocessors, bool(is_causal),
                   checked.softmax_scale, layout(checked.mask), layout(checked.bias),
                   bool(deterministic), bool(bias_grad), activity, pair, bool(forward_only),
                   intervals, capability, bool(tma_operands), tma_mask(checked.mask),
                   checked.mask.max_kept if checked.mask is not None else None,
                   activity is not None, kept_keys, tma_bias(checked.bias), documents,
                   checked.mask.row_kept if checked.mask is not None else None)
