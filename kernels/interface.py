"""Public entry points: one autograd.Function and the functions users call."""

from __future__ import annotations

from collections import OrderedDict

import torch

from . import ops
from .masks.intervals import KeyIntervals
from .masks.key_order import reorder_keys
from .planning.activity import ActivityMap, IntervalActivityPass, TileActivityPass
from .planning.backward import attention_backward
from .planning.forward import ForwardPlan, plan_schedule
from .planning.inputs import BroadcastOperand, check_flags, check_inputs
from .planning.schedule import normalize_options
from .prepared import PreparedMask, prepared_intervals
from .runtime.launch import ensure_runnable
from .triton_device.forward_kernels import _attn_fwd_kernel


# Bound once: the lookup through ``torch.compiler`` cost another ~40 ns per call (70 against
# 110 ns, CPU dev host, timeit). Dynamo folds the function under any name while tracing.
# ``torch.compiler.is_dynamo_compiling`` costs ~20 ns but is False under non-strict
# torch.export, whose calls would then launch kernels on fake tensors.
_is_compiling = torch.compiler.is_compiling

# Forward plans of calls without a mask, by call signature (a prepared mask keeps its own).
MAX_PLANS = 64
_plans: dict = {}
# Forward plans of calls with a KeyIntervals mask that is not prepared (intervals used once,
# such as Doge's: new ones per layer and step), each with its ``_IntervalReader``, by call
# signature and the intervals' form (``_interval_form``), least recently used first. These
# plans take their tile lists per call (``ForwardPlan.lists_per_call``) and hold no tensor, so
# a kept one costs only its launch objects and the scratch its calls keep (``_scratch``). A
# model calls with one or two forms per layer shape (with and without gradients).
MAX_INTERVAL_PLANS = 8
_interval_plans: OrderedDict = OrderedDict()
# Call forms of ordered KeyIntervals (``kernels.key_order``) whose inputs passed the checks, by
# call signature and the layouts of the intervals and their order, least recently used first.
# The checks read only layouts, so a repeat form skips them, and with them the intervals'
# kernel operand, which the checks build (two or three torch ops on the device).
MAX_ORDERED_FORMS = 8
_ordered_forms: OrderedDict = OrderedDict()
# The same for bool masks that are not prepared (a model's padding or causal mask, new each
# step), each with its ``_MaskReader``, by call signature and the mask's layout
# (``_mask_form``): the mask's values are read per call (one activity pass), never kept.
MAX_MASK_PLANS = 8
_mask_plans: OrderedDict = OrderedDict()


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # The kernels need unit stride only on head_dim; any other strides are used as they are.
    return t if t.stride(-1) == 1 else t.contiguous()


def _signature(query, key, value, attn_bias, is_causal, softmax_scale, deterministic=False,
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


def _interval_form(intervals: KeyIntervals, for_backward: bool) -> tuple:
    """What a plan with lists per call follows from besides the signature: the intervals'
    layout (which axes collapse, the checks against the call's sizes and device) and the
    activity map's tile (finer where a backward follows); never their values."""
    start, end = intervals.start, intervals.end
    return (start.shape, start.stride(), start.dtype, end.stride(), end.dtype, start.device,
            for_backward)


def _mask_form(mask: torch.Tensor, for_backward: bool) -> tuple:
    """What a plan with lists per call follows from besides the signature, for a bool mask:
    its layout (broadcast axes, strides, dtype, device) and the activity map's tile; never
    its values."""
    return (mask.shape, mask.stride(), mask.dtype, mask.device, for_backward)


def _remember(plans: dict, signature: tuple, plan, limit: int = MAX_PLANS) -> None:
    plans[signature] = plan
    while len(plans) > limit:
        del plans[next(iter(plans))]  # the oldest (the least recently used: interval plans)


class _IntervalReader:
    """What a call with unprepared ``KeyIntervals`` of a kept form does with them, planned by
    the form's first call (which checked them): one launch (``IntervalActivityPass``) that
    reads start and end as given and writes both the kernels' mask operand (one int64 word
    per key, viewed with query stride 0) and a new activity map. Everything after that (the
    lists, the launches) is the plan's."""

    def __init__(self, mask: BroadcastOperand, activity: ActivityMap, shape, is_causal: bool):
        self.view_size, self.view_stride = tuple(mask.view.shape), mask.view.stride()
        pairs = mask.interval_pairs
        self.words_shape, self.device = tuple(pairs.shape[:-1]), pairs.device
        self.activity_pass = IntervalActivityPass(mask.interval_source, pairs.shape[0],
                                                  pairs.shape[1], shape, activity.sub_rows,
                                                  activity.sub_cols, is_causal)

    def __call__(self, intervals: KeyIntervals) -> tuple[torch.Tensor, ActivityMap]:
        """(the kernels' mask operand, the activity map) of ``intervals``."""
        words = torch.empty(self.words_shape, dtype=torch.int64, device=self.device)
        view = words.as_strided(self.view_size, self.view_stride)
        return view, self.activity_pass(intervals.start, intervals.end, words)


def _pair_read(intervals: KeyIntervals) -> tuple[tuple[torch.Tensor, torch.Tensor], None]:
    """What a call whose forward reads unprepared intervals itself (``scan_keys``) hands the
    plan: their start and end as given (the plan holds their layout), and no activity map."""
    return (intervals.start, intervals.end), None


class _MaskReader:
    """What a call with an unprepared bool mask of a kept form does with it: the planned
    activity pass into a new map (the plan's lists are compacted from it per call)."""

    def __init__(self, mask: BroadcastOperand, activity: ActivityMap, shape, is_causal: bool):
        self.activity_pass = TileActivityPass(mask, shape, activity.sub_rows, activity.sub_cols,
                                              is_causal)

    def __call__(self, mask: torch.Tensor) -> tuple[torch.Tensor, ActivityMap]:
        """(the kernels' mask operand, the activity map) of ``mask``."""
        return mask, self.activity_pass(mask)


def _plan_call(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale,
               for_backward: bool, deterministic: bool = False, bias_grad: bool = False,
               kernel_options=None):
    """(forward plan, query, key, value, mask tensor or None, activity map or None) for this
    call. A repeat signature reuses its plan with no checks or planning; otherwise the inputs
    are checked (errors first), scheduled (``kernels.schedule``) and a plan is made and kept.
    ``for_backward``: a backward will follow (an unprepared mask's activity map is then made
    fine enough for the backward's tiles too). The activity map is the call's own, read from
    an unprepared mask (``KeyIntervals`` or bool) for a plan that takes its lists per call;
    None where the plan's own lists serve."""
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
        kernel_mask = prepared.kernel_mask
    elif intervals is not None:
        plans, per_call = _interval_plans, intervals
    elif isinstance(attn_mask, torch.Tensor):
        plans, per_call = _mask_plans, attn_mask
    else:
        plans = _plans if attn_mask is None else None
    options_key = tuple(sorted(kernel_options.items())) if kernel_options else ()
    signature = None
    if plans is not None:
        signature = _signature(query, key, value, attn_bias, is_causal, softmax_scale,
                               deterministic, bias_grad, options_key)
        if signature is not None and intervals is not None:
            signature = (signature, _interval_form(intervals, for_backward))
        elif signature is not None and per_call is not None:
            signature = (signature, _mask_form(per_call, for_backward))
        plan = plans.get(signature) if signature is not None else None
        if plan is not None:
            if per_call is not None:  # kept with its reader
                plans.move_to_end(signature)
                plan, read = plan
                return (plan, query, key, value, *read(per_call))
            return (plan, query, key, value, kernel_mask if prepared is not None else attn_mask,
                    None)

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
    sched = plan_schedule(checked, query, is_causal, deterministic, bias_grad, options,
                          activity, with_backward=for_backward,
                          intervals_per_call=intervals is not None)
    if per_call is not None:  # the map this call read, handed to the call, not to the plan
        activity = sched.problem.activity
    plan = ForwardPlan(checked, query, key, value, sched, options,
                       lists_per_call=per_call is not None)
    if signature is not None and not copied:
        if plan.scan_keys:
            _remember(plans, signature, (plan, _pair_read), MAX_INTERVAL_PLANS)
        elif intervals is not None:
            kept = (plan, _IntervalReader(checked.mask, activity, checked.shape, is_causal))
            _remember(plans, signature, kept, MAX_INTERVAL_PLANS)
        elif per_call is not None:
            kept = (plan, _MaskReader(checked.mask, activity, checked.shape, is_causal))
            _remember(plans, signature, kept, MAX_MASK_PLANS)
        else:
            _remember(plans, signature, plan)
    # What the kernels read: the mask tensor, or a KeyIntervals mask's interleaved pairs (with
    # ``scan_keys``, its start and end as given).
    if plan.scan_keys:
        return (plan, query, key, value, *_pair_read(attn_mask))
    if checked.mask is not None and checked.mask.interval_pairs is not None:
        attn_mask = checked.mask.view
    return plan, query, key, value, attn_mask, (activity if per_call is not None else None)


class _DMAttnFunction(torch.autograd.Function):
    """Saves what the backward needs and calls the launchers; nothing else lives here."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, attn_bias, is_causal, softmax_scale,
                deterministic, return_lse, kernel_options):
        bias_grad = attn_bias is not None and attn_bias.requires_grad
        plan, query, key, value, mask, activity = _plan_call(
            query, key, value, attn_mask, attn_bias, is_causal, softmax_scale, True,
            deterministic, bias_grad, kernel_options)
        out, lse = plan.run(query, key, value, mask, attn_bias, activity=activity)
        # The LSE is saved either way; it is an output only when asked for. Each output is
        # one more tensor for autograd to wrap and track on every call.
        ctx.save_for_backward(query, key, value, out, lse, mask, attn_bias)
        ctx.plan = plan
        ctx.activity = activity  # the call's own map, whose lists the backward walks too
        ctx.deterministic = deterministic
        if not return_lse:
            return out
        ctx.mark_non_differentiable(lse)
        # The LSE's gradient is never used: without this, autograd fills a zero tensor for it
        # on every backward (a torch op of host time).
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, *grad_lse):
        if grad_out is None:  # only the LSE reached the loss: nothing depends on the inputs
            return (None,) * 10
        query, key, value, out, lse, mask, attn_bias = ctx.saved_tensors
        dq, dk, dv, dbias = attention_backward(
            ctx.plan, grad_out, query, key, value, out, lse, mask, attn_bias,
            ctx.deterministic, bias_needs_grad=attn_bias is not None and ctx.needs_input_grad[4],
            activity=ctx.activity,
        )
        return dq, dk, dv, None, dbias, None, None, None, None, None


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)


def _compact_bias(attn_bias):
    """The tensor an ``expand()``ed bias view was made from, when that is all it is.

    Autograd gives an expanded view a dense gradient of the view's full (B, H, Lq, Lk) shape
    before reducing it to the base. Handing the kernel the base itself (the broadcast rule
    covers it) lets the backward reduce over the broadcast axes with no such temporary.
    """
    base = getattr(attn_bias, "_base", None)
    if base is None or base.dim() != 4 or not attn_bias.requires_grad:
        return attn_bias
    try:
        same = base.expand(attn_bias.shape)
    except RuntimeError:
        return attn_bias
    if same.stride() == attn_bias.stride() and same.data_ptr() == attn_bias.data_ptr():
        return base
    return attn_bias


def _ordered_form(query, key, value, intervals, attn_bias, is_causal, softmax_scale):
    """What the checks of an ordered call read: the call's signature (``is_causal`` with its
    type, which ``check_flags`` reads), the intervals' layout and the order's. None where the
    call has no signature (it is checked every time)."""
    signature = _signature(query, key, value, attn_bias, is_causal, softmax_scale)
    if signature is None:
        return None
    order = intervals.key_order
    return (signature, type(is_causal), _interval_form(intervals, False),
            (order.shape, order.stride(), order.dtype, order.device))


def _in_key_order(query, key, value, intervals, attn_bias, is_causal, softmax_scale):
    """The call's arguments with its keys read in ``intervals.key_order``
    (``kernels.key_order``): the same attention, with causality folded into the intervals.
    The inputs are checked first, once per form (``_ordered_forms``)."""
    if not _is_compiling():  # traced calls are checked by the custom ops
        form = _ordered_form(query, key, value, intervals, attn_bias, is_causal, softmax_scale)
        if form is not None and form in _ordered_forms:
            _ordered_forms.move_to_end(form)
        else:
            check_flags(is_causal=is_causal)
            check_inputs(query, key, value, intervals, attn_bias, softmax_scale)
            if form is not None:
                _remember(_ordered_forms, form, True, MAX_ORDERED_FORMS)
    key, value, intervals, attn_bias = reorder_keys(query, key, value, intervals,
                                                    _compact_bias(attn_bias), is_causal)
    return query, key, value, intervals, attn_bias, False


def dmattn_func(query, key, value, attn_mask=None, attn_bias=None, is_causal=False,
                softmax_scale=None, return_lse=False, deterministic=False, kernel_options=None):
    """Flash dynamic-mask attention.

    Args:
        query: (batch, seqlen_q, heads_q, head_dim), float16 / bfloat16 / float32.
        key, value: (batch, seqlen_k, heads_kv, head_dim) with heads_q % heads_kv == 0
            (MHA, GQA, MQA). Query head h reads KV head h // (heads_q // heads_kv).
        attn_mask: optional bool, True = keep, or ``KeyIntervals`` (each key's run of query
            rows, O(Lk) memory; see ``kernels.intervals``). A bool mask is 4-D, each axis
            broadcastable: batch {1, B},
            heads {1, heads_kv, heads_q}, query {1, seqlen_q}, key {1, seqlen_k}. Never copied.
            Or a ``PreparedMask`` from ``prepare_mask``: the same mask with its active-tile
            lists built ahead, for calls that share one mask.
        attn_bias: optional additive bias, query's dtype, same broadcast rule as the mask.
            Trainable: it receives a gradient in its own (broadcast) shape.
        is_causal: bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q.
        softmax_scale: None means 1/sqrt(head_dim); any finite float, 0.0 included, is used.
        return_lse: also return the float32 natural-log LSE of shape (batch, heads_q, seqlen_q).
        deterministic: make the gradients bitwise reproducible from run to run.
        kernel_options: None, or a dict forcing schedule decisions (``kernels.schedule``'s
            ``OPTION_NAMES``: the backward route, key splits, dkdv head shares); for tests
            and tuning. ``kernels.schedule_for`` shows what a call will run.

    Scores are ``softmax_scale * q.k + bias``, masked pairs are -inf. Rows that see no key give
    output 0, LSE -inf and zero gradients.

    Under ``torch.compile`` a call is the custom ops ``dmattn::fwd`` and ``dmattn::bwd``
    (``kernels.ops``): one graph, no breaks, bit for bit the eager results.
    """
    if isinstance(attn_mask, KeyIntervals) and attn_mask.key_order is not None:
        query, key, value, attn_mask, attn_bias, is_causal = _in_key_order(
            query, key, value, attn_mask, attn_bias, is_causal, softmax_scale)
    # A call torch.compile or torch.export traces becomes the custom ops; eager calls never
    # reach them (nor their host time).
    if _is_compiling():
        return ops.dmattn_traced(query, key, value, attn_mask, attn_bias, is_causal,
                                 softmax_scale, return_lse, deterministic, kernel_options)
    if (is_causal.__class__ is not bool or return_lse.__class__ is not bool
            or deterministic.__class__ is not bool):  # the test alone: ~1 us less per call
        check_flags(is_causal=is_causal, return_lse=return_lse, deterministic=deterministic)
    attn_bias = _compact_bias(attn_bias)
    if _needs_grad(query, key, value, attn_bias):
        return _DMAttnFunction.apply(query, key, value, attn_mask, attn_bias, is_causal,
                                     softmax_scale, deterministic, return_lse, kernel_options)
    # No graph to record: skip autograd.Function's own host time.
    plan, query, key, value, mask, activity = _plan_call(
        query, key, value, attn_mask, attn_bias, is_causal, softmax_scale, False,
        kernel_options=kernel_options)
    out, lse = plan.run(query, key, value, mask, attn_bias, keep_lse=return_lse,
                        activity=activity)
    return (out, lse) if return_lse else out


def triton_dmattn_func(query, key, value, attn_mask=None, attn_bias=None, is_causal=False,
                       softmax_scale=None, return_lse=False, deterministic=False):
    """flash-dmattn's name and parameter order, so switching is a change of import."""
    return dmattn_func(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale,
                       return_lse, deterministic)


def schedule_for(query, key, value, attn_mask=None, attn_bias=None, is_causal=False,
                 softmax_scale=None, deterministic=False, bias_requires_grad=None,
                 kernel_options=None):
    """The ``kernels.schedule.Schedule`` a ``dmattn_func`` call with these arguments runs:
    ``print(schedule_for(q, k, v, ...))`` names its tiles, splits, backward route and bias
    gradient mode. Nothing is launched except, for an unprepared mask, the pass that reads it.
    ``bias_requires_grad`` defaults to the bias's ``requires_grad``."""
    check_flags(is_causal=is_causal, deterministic=deterministic)
    if bias_requires_grad is None:
        bias_requires_grad = attn_bias is not None and attn_bias.requires_grad
    if isinstance(attn_mask, KeyIntervals) and attn_mask.key_order is not None:
        query, key, value, attn_mask, attn_bias, is_causal = _in_key_order(
            query, key, value, attn_mask, attn_bias, is_causal, softmax_scale)
    plan, *_ = _plan_call(query, key, value, attn_mask, _compact_bias(attn_bias), is_causal,
                          softmax_scale, True, deterministic,
                          attn_bias is not None and bool(bias_requires_grad), kernel_options)
    return plan.schedule
