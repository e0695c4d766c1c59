"""The call planner: what a ``dmattn_func`` call's launches need, from its arguments.

``plan_call`` gives a ``CallPlan``: the forward plan (``planning.forward.ForwardPlan``, which
holds the Schedule and the launches), the query, key and value the kernels read (a copy where
the head dim was not contiguous), the call's mask operand and its activity map. A repeat call
signature takes its kept plan with no checks or planning, and the plan's ``MaskReader``, chosen
once by the mask's kind when the plan was made, turns the call's mask into what the kernels
read:

- no mask, or a ``PreparedMask`` (``kernels.prepare_mask``): the operand fixed at planning;
- a bool mask, unprepared: the mask itself, and one activity pass per call;
- ``KeyIntervals``, unprepared: their interleaved (start, end) words and activity, one pass;
- ``KeyIntervals`` read by the forward itself (``scan_keys``, the gather route): start and end
  as given;
- a bool mask read by the forward itself (the gather route): the mask, and no pass.

The autograd path (``kernels.interface``) and the custom ops (``kernels.ops``) both plan here.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch

from .masks.intervals import KeyIntervals
from .planning.activity import ActivityMap, IntervalActivityPass, TileActivityPass
from .planning.forward import ForwardPlan, plan_schedule
from .planning.inputs import BroadcastOperand, check_inputs, interval_words
from .planning.schedule import normalize_options
from .prepared import PreparedMask, prepared_intervals
from .runtime.launch import ensure_runnable
from .triton_device.forward_kernels import _attn_fwd_kernel

# What the kernels read for a call's mask: None, the bool mask, a KeyIntervals mask's interleaved
# (start, end) words viewed as a (B, H, Lq, Lk) operand, or (start, end) as given (scan_keys).
MaskOperand = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None


class CallPlan(NamedTuple):
    """What a call runs: its forward plan and the tensors the plan's launches read."""

    plan: ForwardPlan
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: MaskOperand
    activity: ActivityMap | None  # the call's own map, for a plan with lists per call
    # For intervals the gather route reads as given, the kept-key lists their selection wrote
    # (``KeyIntervals._kept_lists``), else None.
    kept_lists: tuple[torch.Tensor, torch.Tensor] | None
    # For unprepared KeyIntervals of packed documents (``KeyIntervals._documents``), their
    # offsets (cu_q, cu_k): a plan that walks the documents makes their tables per call.
    document_offsets: tuple[torch.Tensor, torch.Tensor] | None = None

    def run(self, bias: torch.Tensor | None, keep_lse: bool = True):
        """(out, lse, or None without ``keep_lse``) of the call's forward."""
        return self.plan.run(self.query, self.key, self.value, self.mask, bias,
                             keep_lse=keep_lse, activity=self.activity,
                             kept_lists=self.kept_lists, document_offsets=self.document_offsets)


# Forward plans of calls without a mask, by call signature (a prepared mask keeps its own).
MAX_PLANS = 64
_plans: dict = {}
# Forward plans of calls with a KeyIntervals mask that is not prepared (intervals used once,
# such as Doge's: new ones per layer and step), each with its ``IntervalReader``, by call
# signature and the intervals' form (``interval_form``), least recently used first. These
# plans take their tile lists per call (``ForwardPlan.lists_per_call``) and hold no tensor, so
# a kept one costs only its launch objects and the scratch its calls keep (``_scratch``). A
# model calls with one or two forms per layer shape (with and without gradients).
MAX_INTERVAL_PLANS = 8
_interval_plans: OrderedDict = OrderedDict()
# Forward plans of calls with a bool mask that is not prepared (a model's padding or causal
# mask, new each step), each with its ``BoolMaskReader``, by call signature and the mask's layout
# (``mask_form``): the mask's values are read per call (one activity pass), never kept.
MAX_MASK_PLANS = 8
_mask_plans: OrderedDict = OrderedDict()


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # The kernels need unit stride only on head_dim; any other strides are used as they are.
    return t if t.stride(-1) == 1 else t.contiguous()


def call_signature(query, key, value, attn_bias, is_causal, softmax_scale, deterministic=False,
                   bias_grad=False, options_key=()) -> tuple | None:
    """Everything a forward plan follows from, besides the mask: two calls with equal
    signatures pass or fail the input checks alike and get the same plan. None when the call
    cannot use a kept plan (an argument is not a tensor, or the scale not a plain number):
    such calls take the checked path, which reports the mistake."""
    tensors = (query, key, value) if attn_bias is None else (query, key, value, attn_bias)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    if softmax_scale is not None and type(softmax_scale) not in (float, int):
        return None
    return (is_causal, softmax_scale, deterministic, bias_grad, options_key,
            *[(t.shape, t.stride(), t.dtype, t.device) for t in tensors])


def interval_form(intervals: KeyIntervals, for_backward: bool) -> tuple:
    """What a plan with lists per call follows from besides the signature: the intervals'
    layout (which axes collapse, the checks against the call's sizes and device), the
    activity map's tile (finer where a backward follows), the bounds on the kept keys that
    steer the routes (``max_kept``: the gather route; ``_row_kept``: the Hopper forward) and,
    for a packed batch's documents, how many there are and their causality (the Hopper
    kernels' grids); never their values."""
    start, end = intervals.start, intervals.end
    documents = intervals._documents
    packed = (documents[0].shape, documents[1].shape, documents[2]) if documents else None
    return (start.shape, start.stride(), start.dtype, end.stride(), end.dtype, start.device,
            intervals.max_kept, intervals._row_kept, for_backward, packed)


def mask_form(mask: torch.Tensor, for_backward: bool) -> tuple:
    """What a plan with lists per call follows from besides the signature, for a bool mask:
    its layout (broadcast axes, strides, dtype, device) and the activity map's tile; never
    its values."""
    return (mask.shape, mask.stride(), mask.dtype, mask.device, for_backward)


def remember(plans: dict, signature: tuple, plan, limit: int = MAX_PLANS) -> None:
    plans[signature] = plan
    while len(plans) > limit:
        del plans[next(iter(plans))]  # the oldest (the least recently used: interval plans)


_make_call_plan = tuple.__new__


class KeptPlan(NamedTuple):
    """A plan kept for a call signature, with the reader of its calls' masks."""

    plan: ForwardPlan
    read: MaskReader


class MaskReader:
    """What a kept plan's later calls do with their mask: ``reader(attn_mask)`` gives (the
    kernels' mask operand, the call's activity map or None, the kept-key lists the mask came
    with or None)."""

    def __call__(self, attn_mask) -> tuple[MaskOperand, ActivityMap | None, tuple | None]:
        raise NotImplementedError


class FixedMask(MaskReader):
    """No mask, or a prepared one: the operand was found at planning, and the plan's own lists
    serve every call."""

    def __init__(self, operand: torch.Tensor | None):
        self.operand = operand

    def __call__(self, attn_mask) -> tuple[MaskOperand, None, None]:
        return self.operand, None, None


NO_MASK = FixedMask(None)


class BoolMaskReader(MaskReader):
    """An unprepared bool mask of a kept form: the planned activity pass into a new map (the
    plan's lists are compacted from it per call)."""

    def __init__(self, mask: BroadcastOperand, activity: ActivityMap, shape, is_causal: bool):
        self.activity_pass = TileActivityPass(mask, shape, activity.sub_rows, activity.sub_cols,
                                              is_causal)

    def __call__(self, attn_mask: torch.Tensor) -> tuple[torch.Tensor, ActivityMap, None]:
        return attn_mask, self.activity_pass(attn_mask), None


class IntervalReader(MaskReader):
    """Unprepared ``KeyIntervals`` of a kept form, planned by the form's first call (which
    checked them): one launch (``IntervalActivityPass``) that reads start and end as given and
    writes both the kernels' mask operand (one int64 word per key, viewed with query stride 0)
    and a new activity map."""

    def __init__(self, mask: BroadcastOperand, activity: ActivityMap, shape, is_causal: bool):
        self.view_size, self.view_stride = tuple(mask.view.shape), mask.view.stride()
        pairs = mask.interval_pairs
        # The words' rows as the plan's operand holds them: an even number of keys apart.
        words_row = interval_words(pairs).stride(1)
        self.words_shape, self.device = (*pairs.shape[:2], words_row), pairs.device
        self.activity_pass = IntervalActivityPass(mask.interval_source, pairs.shape[0],
                                                  pairs.shape[1], words_row, shape,
                                                  activity.sub_rows, activity.sub_cols,
                                                  is_causal)

    def __call__(self, intervals: KeyIntervals) -> tuple[torch.Tensor, ActivityMap, None]:
        words = torch.empty(self.words_shape, dtype=torch.int64, device=self.device)
        view = words.as_strided(self.view_size, self.view_stride)
        return view, self.activity_pass(intervals.start, intervals.end, words), None


class IntervalScan(MaskReader):
    """``KeyIntervals`` that the forward reads itself (``scan_keys``, the gather route): their
    start and end as given (the plan holds their layout), and no activity map but the kept-key
    lists their selection wrote, where it did (the gather route reads them)."""

    def __call__(self, intervals: KeyIntervals) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                         None, tuple | None]:
        return (intervals.start, intervals.end), None, intervals._kept_lists


INTERVAL_SCAN = IntervalScan()


class MaskAsGiven(MaskReader):
    """An unprepared bool mask that the forward reads itself (the gather route): the mask,
    and no activity map."""

    def __call__(self, attn_mask: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return attn_mask, None, None


MASK_AS_GIVEN = MaskAsGiven()


def plan_call(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale,
              for_backward: bool, deterministic: bool = False, bias_grad: bool = False,
              kernel_options=None) -> CallPlan:
    """The ``CallPlan`` of this call. A repeat signature reuses its plan and reader with no
    checks or planning; otherwise the inputs are checked (errors first), scheduled
    (``kernels.schedule``) and a plan is made and kept with its reader. ``for_backward``: a
    backward will follow (an unprepared mask's activity map is then made fine enough for the
    backward's tiles too)."""
    prepared = attn_mask if isinstance(attn_mask, PreparedMask) else None
    intervals = None  # an unprepared KeyIntervals mask, read by this call
    if (isinstance(attn_mask, KeyIntervals) and isinstance(query, torch.Tensor)
            and isinstance(key, torch.Tensor)):
        prepared = prepared_intervals(attn_mask, query, key, is_causal)
        intervals = attn_mask if prepared is None else None
    per_call = None  # an unprepared mask (KeyIntervals or bool) that this call reads
    if prepared is not None:
        prepared.check_fresh()
        attn_mask, plans = prepared.mask, prepared.plans
    elif intervals is not None:
        plans, per_call = _interval_plans, intervals
    elif isinstance(attn_mask, torch.Tensor):
        plans, per_call = _mask_plans, attn_mask
    else:
        plans = _plans if attn_mask is None else None
    options_key = tuple(sorted(kernel_options.items())) if kernel_options else ()
    signature = None
    if plans is not None:
        signature = call_signature(query, key, value, attn_bias, is_causal, softmax_scale,
                               deterministic, bias_grad, options_key)
        if signature is not None and intervals is not None:
            signature = (signature, interval_form(intervals, for_backward))
        elif signature is not None and per_call is not None:
            signature = (signature, mask_form(per_call, for_backward))
        kept = plans.get(signature) if signature is not None else None
        if kept is not None:
            if per_call is not None:
                plans.move_to_end(signature)
            plan, read = kept
            # tuple.__new__ skips the NamedTuple's Python-level __new__: 0.25 us of the kept
            # path's ~3 us on the development CPU (timeit).
            return _make_call_plan(CallPlan, (plan, query, key, value, *read(per_call),
                                              document_offsets(intervals)))

    checked = check_inputs(query, key, value, attn_mask, attn_bias, softmax_scale)
    options = normalize_options(kernel_options)
    copied = any(t.stride(-1) != 1 for t in (query, key, value))
    if copied:  # rare: copies never match the signature, so their plan is not kept
        query, key, value = (_last_dim_contiguous(t) for t in (query, key, value))
        checked = check_inputs(query, key, value, attn_mask, attn_bias, softmax_scale)
    ensure_runnable(_attn_fwd_kernel, query.device)
    activity = None
    if prepared is not None:
        activity = prepared.activity_for(checked.shape, query.dtype, query.device, is_causal)
    sched = plan_schedule(checked, query, key, value, is_causal, deterministic, bias_grad,
                          options, activity, with_backward=for_backward,
                          intervals_per_call=intervals is not None,
                          kept_keys=prepared.kept_keys if prepared is not None else None)
    if per_call is not None:  # the map this call read, handed to the call, not to the plan
        activity = sched.problem.activity
    plan = ForwardPlan(checked, query, key, value, sched, options,
                       lists_per_call=per_call is not None)
    if signature is not None and not copied:  # kept: with the reader of its later calls' masks
        if plan.mask_as_given and intervals is not None:
            reader = INTERVAL_SCAN
        elif plan.mask_as_given and per_call is not None:
            reader = MASK_AS_GIVEN
        elif intervals is not None:
            reader = IntervalReader(checked.mask, activity, checked.shape, is_causal)
        elif per_call is not None:
            reader = BoolMaskReader(checked.mask, activity, checked.shape, is_causal)
        elif prepared is not None:
            reader = FixedMask(prepared.kernel_mask)
        else:
            reader = NO_MASK
        limit = (MAX_INTERVAL_PLANS if intervals is not None else
                 MAX_MASK_PLANS if per_call is not None else MAX_PLANS)
        remember(plans, signature, KeptPlan(plan, reader), limit)
    # What the kernels read: the mask tensor, or a KeyIntervals mask's interleaved pairs (with
    # ``scan_keys``, its start and end as given).
    if plan.mask_as_given and intervals is not None:
        return CallPlan(plan, query, key, value, *INTERVAL_SCAN(attn_mask))
    mask = attn_mask
    if checked.mask is not None and checked.mask.interval_pairs is not None:
        mask = checked.mask.view
    return CallPlan(plan, query, key, value, mask, activity if per_call is not None else None,
                    None, document_offsets(intervals))


def document_offsets(intervals: KeyIntervals | None) -> tuple | None:
    """The offsets (cu_q, cu_k) of unprepared ``intervals`` that are a packed batch's
    documents, else None."""
    documents = intervals._documents if intervals is not None else None
    return documents[:2] if documents is not None else None


def needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)
