"""Masks prepared once for many calls.

Every call with a mask first reads the whole mask to find its active tiles (``_blocks``): one
bandwidth-bound pass plus a list compaction per kernel. When one mask serves several calls (the
layers of a model, or a forward and its backward run again), ``prepare_mask`` does that work
once and the calls only walk the lists. This is what FlexAttention's ``create_block_mask`` is
to ``flex_attention``.

A prepared mask describes the mask's contents when it was prepared. Writing to the mask in
place afterwards would leave it stale, so the calls check the tensor's version counter and
refuse a mask that changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .masks.found_documents import find_documents
from .masks.intervals import KeyIntervals, most_kept_in_a_row
from .masks.key_runs import BLOCK_KEYS, key_runs, order_that_pays
from .planning.activity import ActivityMap
from .planning.backward import prepare_backward_lists
from .planning.forward import call_problem, mask_activity
from .planning import tuning
from .planning.forward_schedule import forward_list_tiles
from .planning.hopper_forward import list_tile as hopper_list_tile, may_take_masks
from .planning.gather_decode import count_kept_keys
from .planning.inputs import AttnShape, check_flags, check_inputs
from .planning.schedule import schedule
from .runtime.launch import ensure_runnable
from .runtime.scratch import graph_capturing, tensor_version
from .triton_device.forward_kernels import _attn_fwd_kernel


@dataclass(frozen=True)
class PreparedMask:
    """A mask (bool, or ``KeyIntervals``) with its active-tile lists built, for calls whose
    query and key have the shapes, dtype and device it was prepared with, and the same
    ``is_causal``. Pass it as ``attn_mask``. Build it with :func:`prepare_mask`."""

    mask: object  # the bool tensor or KeyIntervals given
    kernel_mask: torch.Tensor  # what the kernels read (KeyIntervals: their interleaved pairs)
    shape: AttnShape
    dtype: torch.dtype
    device: torch.device
    is_causal: bool
    activity: ActivityMap
    version: int | None
    # Decode-sized calls (``tuning.GATHER_MAX_ROWS`` query rows at most): the most keys the
    # rows keep in one (batch, head), which sizes the gather route's lists.
    kept_keys: int | None = None
    # Forward plans of the calls made with this mask, by call signature (see interface).
    plans: dict = field(default_factory=dict, compare=False, repr=False)
    # A bool mask whose keys are each kept by one run of rows (``tuning.BOOL_MASK_RUNS``):
    # the same pairs as KeyIntervals (with a key order where it pays), which calls read in
    # its place (``intervals_for``); its own activity is then None.
    intervals: KeyIntervals | None = field(default=None, compare=False, repr=False)

    def check_fresh(self) -> None:
        """Refuse a mask written in place since it was prepared: its lists would be stale."""
        version = tensor_version(self.mask)
        if version is not None and self.version is not None and version != self.version:
            raise ValueError("attn_mask: the mask was written in place after prepare_mask, so "
                             "its prepared tile lists are stale; call prepare_mask again")

    def intervals_for(self, query, key, is_causal) -> KeyIntervals:
        """The intervals a call with this query and key reads in the mask's place, after
        checking that it is a call the mask was prepared for (shapes, dtype, device,
        causality; a ValueError says what differs) and that the mask was not written since.
        The call's own checks follow. A traced call (torch.compile) skips these checks, as it
        does for any prepared mask (``kernels.ops``): a version counter is not traceable."""
        if torch.compiler.is_compiling():
            return self.intervals
        if is_causal.__class__ is not bool:
            check_flags(is_causal=is_causal)
        if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key)):
            check_inputs(query, key, key, self.intervals, None, None)  # its TypeError
        batch, seqlen_q, heads_q, head_dim = query.shape
        shape = AttnShape(batch, seqlen_q, key.shape[1], heads_q, key.shape[2], head_dim)
        self.activity_for(shape, query.dtype, query.device, is_causal, check_map=False)
        return self.intervals

    def activity_for(self, shape: AttnShape, dtype: torch.dtype, device: torch.device,
                     is_causal: bool, check_map: bool = True) -> ActivityMap:
        """The prepared activity map, after checking that the call (its checked ``shape`` and
        the query's dtype and device) is one it was made for; a ValueError says what differs."""
        expected = (self.shape, self.dtype, self.device, self.is_causal)
        actual = (shape, dtype, device, bool(is_causal))
        for name, want, got in zip(("shapes", "dtype", "device", "is_causal"), expected, actual):
            if want != got:
                raise ValueError(f"attn_mask: the mask was prepared for {name} {want}, but the "
                                 f"call has {got}; call prepare_mask for this call")
        self.check_fresh()
        if check_map and self.activity is None:  # read as intervals (``intervals_for``)
            raise ValueError("attn_mask: this prepared mask is read as its KeyIntervals; pass it "
                             "to dmattn_func")
        return self.activity


def prepare_mask(attn_mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                 is_causal: bool = False) -> PreparedMask:
    """Read ``attn_mask`` once and build the active-tile lists that ``dmattn_func`` and its
    backward walk, for calls with ``query`` and ``key`` of these shapes, dtype and device.

    ``attn_mask`` follows ``dmattn_func``'s broadcast rule and is kept, not copied. Only
    shapes, dtype and device of ``query`` and ``key`` are used, not their values. Do not write
    to the mask afterwards: calls refuse a mask changed in place.
    """
    if not isinstance(attn_mask, (torch.Tensor, KeyIntervals)):
        raise TypeError(f"attn_mask must be a bool torch.Tensor or KeyIntervals to prepare, got "
                        f"{type(attn_mask).__name__}")
    return _prepare(attn_mask, query, key, is_causal, count_shares=True)


def _as_intervals(attn_mask, checked, query, is_causal) -> KeyIntervals | None:
    """A bool mask as the KeyIntervals of the same pairs (``masks.key_runs``), with a key
    order where it cuts the rows its key blocks span by ``tuning.BOOL_MASK_RUNS_ORDER_GAIN``
    and the pairs walked by ``tuning.BOOL_MASK_RUNS_ORDER_LEAST_SAVED_PAIRS``, or None: only
    with ``tuning.BOOL_MASK_RUNS``, for calls of more than ``tuning.GATHER_MAX_ROWS`` query
    rows (decode keeps its prepared bool mask), a mask whose key axis is not broadcast and
    whose every key is kept by one run of rows; never during a CUDA graph capture (the test
    reads back)."""
    shape = checked.shape
    if (not tuning.BOOL_MASK_RUNS or not isinstance(attn_mask, torch.Tensor)
            or shape.seqlen_q <= tuning.GATHER_MAX_ROWS or graph_capturing(query.device)):
        return None
    if attn_mask.shape[3] != shape.seqlen_k:  # one key broadcast along the key axis
        return None
    runs = key_runs(attn_mask, shape.seqlen_q, shape.seqlen_k, is_causal)
    if runs is None:
        return None
    # Each mask head's intervals serve this many (batch, query head) pairs of the call.
    served = shape.batch * shape.heads_q / (runs[0].shape[0] * runs[0].shape[1])
    order = order_that_pays(*runs, tuning.BOOL_MASK_RUNS_ORDER_GAIN,
                            tuning.BOOL_MASK_RUNS_ORDER_LEAST_SAVED_PAIRS / (BLOCK_KEYS * served))
    return KeyIntervals(*runs, order, _row_kept=most_kept_in_a_row(*runs, shape.seqlen_q),
                        _runs_of_prepared_mask=True)


def _named_documents(intervals: KeyIntervals, seqlen_q: int, is_causal: bool) -> KeyIntervals:
    """``intervals``, or the same start and end naming the packed documents they are
    (``masks.found_documents``; only with ``tuning.FIND_DOCUMENTS``): the calls with the
    preparation then see them as ``dmattn_varlen_func``'s own."""
    if (not tuning.FIND_DOCUMENTS or intervals._documents is not None
            or intervals.key_order is not None or intervals._kept_lists is not None):
        return intervals
    documents = find_documents(intervals, seqlen_q, is_causal)
    if documents is None:
        return intervals
    return intervals.keeping_subset(intervals.start, intervals.end, documents=documents)


# Call forms whose preparations one KeyIntervals keeps (a model calls with one or two).
MAX_INTERVAL_PREPARATIONS = 4


def prepared_intervals(intervals: KeyIntervals, query: torch.Tensor, key: torch.Tensor,
                       is_causal: bool) -> PreparedMask | None:
    """The preparation of ``intervals`` for a call with this query and key, made by the second
    such call and kept on the intervals, so that later calls with the same intervals (a
    model's layers, repeated steps) run as with ``prepare_mask``, with no mask work and a kept
    plan. A first call only notes its form and reads the intervals itself: intervals used once
    (Doge builds one set per layer) pay no preparation beside their own checks and plan.
    Unlike ``prepare_mask`` it counts no tile shares (a device sync inside a call), so dkdv's
    pipeline depth takes the uncounted default. A write into start or end (their version
    counters) makes a new form. During a CUDA graph capture, whose tensors must not outlive
    it, none is made, and the call reads the intervals itself (its replays follow what start
    and end hold then), except the runs of a bool mask ``prepare_mask`` read as intervals:
    their counted preparation, made before the capture, serves it."""
    form = _call_form(intervals, query, key, is_causal)
    kept = intervals._preparations
    if graph_capturing(query.device):
        return kept.get(form) if intervals._runs_of_prepared_mask else None
    if form not in kept:  # the first call of this form
        kept[form] = None
        if len(kept) > MAX_INTERVAL_PREPARATIONS:
            del kept[next(iter(kept))]  # the oldest
        return None
    if kept[form] is None:
        kept[form] = _prepare(intervals, query, key, is_causal, count_shares=False)
    return kept[form]


def _call_form(intervals: KeyIntervals, query, key, is_causal) -> tuple:
    """What a preparation kept on ``intervals`` is for: the call's shapes, dtype, device,
    causality, and the versions of start and end."""
    return (tuple(query.shape), tuple(key.shape), query.dtype, query.device, is_causal,
            tensor_version(intervals.start), tensor_version(intervals.end))


def _prepare(attn_mask, query, key, is_causal, count_shares: bool) -> PreparedMask:
    check_flags(is_causal=is_causal)
    # The key stands in for the value: same shape by contract, and only shapes are read.
    checked = check_inputs(query, key, key, attn_mask, None, None)
    runs = _as_intervals(attn_mask, checked, query, is_causal)
    if runs is not None:
        # The intervals keep their own preparation, made here with its shares counted (this
        # is prepare_mask, which reads the mask back anyway): the calls reading them walk
        # prepared lists from the first, and the Hopper forward's default can weigh their
        # partial tiles (``few_partial_tiles``) as it does the bool mask's.
        runs._preparations[_call_form(runs, query, key, is_causal)] = _prepare(
            runs, query, key, is_causal, count_shares)
        return PreparedMask(attn_mask, attn_mask, checked.shape, query.dtype, query.device,
                            bool(is_causal), None, tensor_version(attn_mask), intervals=runs)
    if isinstance(attn_mask, KeyIntervals):
        named = _named_documents(attn_mask, checked.shape.seqlen_q, is_causal)
        if named is not attn_mask:  # the same start and end, now naming their documents
            attn_mask = named
            checked = check_inputs(query, key, key, attn_mask, None, None)
    ensure_runnable(_attn_fwd_kernel, query.device)
    # The map serves the tiles of any bias and backward options (``activity_tiles``); the
    # forward's lists are built here for each tile a call's bias may pick.
    problem = call_problem(checked, query, is_causal)
    sched = schedule(problem)
    activity = mask_activity(checked, sched, with_backward=True)
    for list_tile in forward_list_tiles(problem, sched.forward):
        activity.lists(*list_tile, transposed=False)
    if count_shares:  # otherwise the backward builds its lists from the map on first use
        prepare_backward_lists(activity, problem)
        if may_take_masks(problem) and not graph_capturing(query.device):
            # The masked Hopper forward's default reads it (``few_partial_tiles``); a sync.
            activity.count_partial_share(*hopper_list_tile(), transposed=False)
    kernel_mask = checked.mask.view if checked.mask.interval_pairs is not None else attn_mask
    kept_keys = None
    shape = checked.shape
    if count_shares and shape.seqlen_q <= tuning.GATHER_MAX_ROWS:
        kept_keys = count_kept_keys(checked.mask, shape.seqlen_q, shape.seqlen_k, is_causal)
    return PreparedMask(attn_mask, kernel_mask, checked.shape, query.dtype, query.device,
                        is_causal, activity, tensor_version(attn_mask), kept_keys=kept_keys)
