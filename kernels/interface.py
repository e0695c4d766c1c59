"""Public entry points: ``dmattn_func`` (with its autograd Function), ``triton_dmattn_func`` and
``schedule_for``. What a call runs is planned by ``call_plan``."""

from __future__ import annotations

from collections import OrderedDict

import torch

from . import ops
from .call_plan import call_signature, interval_form, needs_grad, plan_call, remember
from .masks.intervals import KeyIntervals
from .masks.key_order import KeyOrderReads, key_order_reads, reorder_keys
from .planning.backward import attention_backward
from .planning.inputs import check_flags, check_inputs
from .prepared import PreparedMask


# Bound once: the lookup through ``torch.compiler`` cost another ~40 ns per call (70 against
# 110 ns, CPU dev host, timeit). Dynamo folds the function under any name while tracing.
# ``torch.compiler.is_dynamo_compiling`` costs ~20 ns but is False under non-strict
# torch.export, whose calls would then launch kernels on fake tensors.
_is_compiling = torch.compiler.is_compiling

# Call forms of ordered KeyIntervals (``kernels.masks.key_order``) whose inputs passed the checks, by
# call signature and the layouts of the intervals and their order, least recently used first.
# The checks read only layouts, so a repeat form skips them, and with them the intervals'
# kernel operand, which the checks build (two or three torch ops on the device).
MAX_ORDERED_FORMS = 8
_ordered_forms: OrderedDict = OrderedDict()


def _run_and_save(ctx, call, attn_bias, deterministic, return_lse):
    """Runs ``call`` (a ``call_plan.CallPlan``) with ``attn_bias`` and saves on ``ctx`` what
    ``_attention_grads`` reads: the outputs of an autograd Function's forward."""
    out, lse = call.run(attn_bias)
    # The LSE is saved either way; it is an output only when asked for. Each output is one
    # more tensor for autograd to wrap and track on every call.
    ctx.save_for_backward(call.query, call.key, call.value, out, lse, call.mask, attn_bias)
    ctx.plan = call.plan
    ctx.activity = call.activity  # the call's own map, whose lists the backward walks too
    ctx.document_offsets = call.document_offsets  # unprepared packed documents' offsets
    ctx.deterministic = deterministic
    if not return_lse:
        return out
    ctx.mark_non_differentiable(lse)
    # The LSE's gradient is never used: without this, autograd fills a zero tensor for it on
    # every backward (a torch op of host time).
    ctx.set_materialize_grads(False)
    return out, lse


def _attention_grads(ctx, grad_out):
    """(dq, dk, dv, dbias or None) of what ``_run_and_save`` saved; the bias is the
    Function's fifth input."""
    query, key, value, out, lse, mask, attn_bias = ctx.saved_tensors
    return attention_backward(
        ctx.plan, grad_out, query, key, value, out, lse, mask, attn_bias, ctx.deterministic,
        bias_needs_grad=attn_bias is not None and ctx.needs_input_grad[4],
        activity=ctx.activity, document_offsets=ctx.document_offsets,
    )


class _DMAttnFunction(torch.autograd.Function):
    """Saves what the backward needs and calls the launchers; nothing else lives here."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, attn_bias, is_causal, softmax_scale,
                deterministic, return_lse, kernel_options):
        bias_grad = attn_bias is not None and attn_bias.requires_grad
        call = plan_call(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale, True,
                         deterministic, bias_grad, kernel_options)
        return _run_and_save(ctx, call, attn_bias, deterministic, return_lse)

    @staticmethod
    def backward(ctx, grad_out, *grad_lse):
        if grad_out is None:  # only the LSE reached the loss: nothing depends on the inputs
            return (None,) * 10
        dq, dk, dv, dbias = _attention_grads(ctx, grad_out)
        return dq, dk, dv, None, dbias, None, None, None, None, None


class _KeyOrderedFunction(torch.autograd.Function):
    """``_DMAttnFunction`` of a call whose ordered intervals' key reads ``reads`` (a
    ``KeyOrderReads``) makes: K, V and the bias are read in key order in its forward, and
    their gradients go back through the inverse order in its backward, in this one node."""

    @staticmethod
    def forward(ctx, query, key, value, reads: KeyOrderReads, attn_bias, softmax_scale,
                deterministic, return_lse, kernel_options):
        bias_grad = attn_bias is not None and attn_bias.requires_grad
        ordered_key, ordered_value, ordered_bias = reads.read(key, value, attn_bias)
        call = plan_call(query, ordered_key, ordered_value, reads.reordered, ordered_bias,
                         False, softmax_scale, True, deterministic, bias_grad, kernel_options)
        ctx.reads = reads
        ctx.shapes = key.shape, value.shape, None if attn_bias is None else attn_bias.shape
        return _run_and_save(ctx, call, ordered_bias, deterministic, return_lse)

    @staticmethod
    def backward(ctx, grad_out, *grad_lse):
        if grad_out is None:  # only the LSE reached the loss: nothing depends on the inputs
            return (None,) * 9
        dq, dk, dv, dbias = _attention_grads(ctx, grad_out)
        dk, dv, dbias = ctx.reads.back(dk, dv, dbias if ctx.needs_input_grad[4] else None,
                                       *ctx.shapes)
        return dq, dk, dv, None, dbias, None, None, None, None


def _compact_bias(attn_bias):
    """The tensor an ``expand()``ed bias view was made from, when that is all it is.

    Autograd gives an expanded view a dense gradient of the view's full (B, H, Lq, Lk) shape
    before reducing it to the base. Handing the kernel the base itself (the broadcast rule
    covers it) lets the backward reduce over the broadcast axes with no such temporary.
    A traced call reads sizes and strides only (``ops.bias_base_of``): there a view's base
    may be known to the trace and absent from the graph it makes.
    """
    if _is_compiling():
        base = ops.bias_base_of(attn_bias)
        return attn_bias if base is None else base
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
    signature = call_signature(query, key, value, attn_bias, is_causal, softmax_scale)
    if signature is None:
        return None
    order = intervals.key_order
    return (signature, type(is_causal), interval_form(intervals, False),
            (order.shape, order.stride(), order.dtype, order.device))


def _check_ordered(query, key, value, intervals, attn_bias, is_causal, softmax_scale):
    """Checks an ordered call's inputs, once per form (``_ordered_forms``); traced calls are
    checked by the custom ops."""
    if _is_compiling():
        return
    form = _ordered_form(query, key, value, intervals, attn_bias, is_causal, softmax_scale)
    if form is not None and form in _ordered_forms:
        _ordered_forms.move_to_end(form)
    else:
        check_flags(is_causal=is_causal)
        check_inputs(query, key, value, intervals, attn_bias, softmax_scale)
        if form is not None:
            remember(_ordered_forms, form, True, MAX_ORDERED_FORMS)


def _in_key_order(query, key, value, intervals, attn_bias, is_causal, softmax_scale,
                  checked: bool = False):
    """The call's arguments with its keys read in ``intervals.key_order``
    (``kernels.masks.key_order``): the same attention, with causality folded into the intervals.
    The inputs are checked first, unless ``checked`` (``_key_ordered`` checked them)."""
    if not checked:
        _check_ordered(query, key, value, intervals, attn_bias, is_causal, softmax_scale)
    key, value, intervals, attn_bias = reorder_keys(query, key, value, intervals,
                                                    _compact_bias(attn_bias), is_causal)
    return query, key, value, intervals, attn_bias, False


def _key_ordered(query, key, value, intervals, attn_bias, is_causal, softmax_scale,
                 return_lse, deterministic, kernel_options, grads: bool):
    """An eager ordered call whose keys ``key_order_reads`` reads: with ``grads``, in one
    autograd node (``_KeyOrderedFunction``); without, K, V and the bias read in order (a
    bias of one row per (batch, head of the copies) in the row copies' launch, not a gather
    of its own) and the call run with no graph. None where ``key_order_reads`` leaves the
    call to ``reorder_keys``."""
    _check_ordered(query, key, value, intervals, attn_bias, is_causal, softmax_scale)
    if return_lse.__class__ is not bool or deterministic.__class__ is not bool:
        check_flags(return_lse=return_lse, deterministic=deterministic)
    attn_bias = _compact_bias(attn_bias)
    reads = key_order_reads(query, key, value, intervals, attn_bias, is_causal, grads=grads)
    if reads is None:
        return None
    if grads:
        return _KeyOrderedFunction.apply(query, key, value, reads, attn_bias, softmax_scale,
                                          deterministic, return_lse, kernel_options)
    ordered_key, ordered_value, ordered_bias = reads.read(key, value, attn_bias)
    return _without_graph(query, ordered_key, ordered_value, reads.reordered, ordered_bias,
                          False, softmax_scale, return_lse, kernel_options)


def _without_graph(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale,
                   return_lse, kernel_options):
    """A call that records no graph: planned and run, skipping autograd.Function's own host
    time."""
    call = plan_call(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale, False,
                     kernel_options=kernel_options)
    out, lse = call.run(attn_bias, keep_lse=return_lse)
    return (out, lse) if return_lse else out


def dmattn_func(query, key, value, attn_mask=None, attn_bias=None, is_causal=False,
                softmax_scale=None, return_lse=False, deterministic=False, kernel_options=None):
    """Flash dynamic-mask attention.

    Args:
        query: (batch, seqlen_q, heads_q, head_dim), float16 / bfloat16 / float32.
        key, value: (batch, seqlen_k, heads_kv, head_dim) with heads_q % heads_kv == 0
            (MHA, GQA, MQA). Query head h reads KV head h // (heads_q // heads_kv).
        attn_mask: optional bool, True = keep, or ``KeyIntervals`` (each key's run of query
            rows, O(Lk) memory; see ``kernels.masks.intervals``). A bool mask is 4-D, each axis
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
    if attn_mask.__class__ is PreparedMask and attn_mask.intervals is not None:
        attn_mask = attn_mask.intervals_for(query, key, is_causal)  # the same pairs
    if isinstance(attn_mask, KeyIntervals) and attn_mask.key_order is not None:
        if not _is_compiling():
            result = _key_ordered(query, key, value, attn_mask, attn_bias, is_causal,
                                  softmax_scale, return_lse, deterministic, kernel_options,
                                  needs_grad(query, key, value, attn_bias))
            if result is not None:
                return result
        # Checked by ``_key_ordered``, or (traced) by the custom ops.
        query, key, value, attn_mask, attn_bias, is_causal = _in_key_order(
            query, key, value, attn_mask, attn_bias, is_causal, softmax_scale, checked=True)
    # A call torch.compile or torch.export traces becomes the custom ops; eager calls never
    # reach them (nor their host time).
    if _is_compiling():
        return ops.dmattn_traced(query, key, value, attn_mask, attn_bias, is_causal,
                                 softmax_scale, return_lse, deterministic, kernel_options)
    if (is_causal.__class__ is not bool or return_lse.__class__ is not bool
            or deterministic.__class__ is not bool):  # the test alone: ~1 us less per call
        check_flags(is_causal=is_causal, return_lse=return_lse, deterministic=deterministic)
    attn_bias = _compact_bias(attn_bias)
    if needs_grad(query, key, value, attn_bias):
        return _DMAttnFunction.apply(query, key, value, attn_mask, attn_bias, is_causal,
                                     softmax_scale, deterministic, return_lse, kernel_options)
    return _without_graph(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale,
                          return_lse, kernel_options)


def triton_dmattn_func(query, key, value, attn_mask=None, attn_bias=None, is_causal=False,
                       softmax_scale=None, return_lse=False, deterministic=False):
    """flash-dmattn's name and parameter order, so switching is a change of import."""
    return dmattn_func(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale,
                       return_lse, deterministic)


def schedule_for(query, key, value, attn_mask=None, attn_bias=None, is_causal=False,
                 softmax_scale=None, deterministic=False, bias_requires_grad=None,
                 kernel_options=None, for_backward=True):
    """The ``kernels.planning.schedule.Schedule`` a ``dmattn_func`` call with these arguments runs:
    ``print(schedule_for(q, k, v, ...))`` names its tiles, splits, backward route and bias
    gradient mode. Nothing is launched except, for an unprepared mask, the pass that reads it.
    ``bias_requires_grad`` defaults to the bias's ``requires_grad``. ``for_backward``: the call
    is followed by a backward (as when an input requires grad); False gives the schedule of a
    call without gradients (inference: the forward may read its mask itself, decode may take
    the gather route)."""
    check_flags(is_causal=is_causal, deterministic=deterministic)
    if bias_requires_grad is None:
        bias_requires_grad = attn_bias is not None and attn_bias.requires_grad
    if isinstance(attn_mask, PreparedMask) and attn_mask.intervals is not None:
        attn_mask = attn_mask.intervals_for(query, key, is_causal)
    if isinstance(attn_mask, KeyIntervals) and attn_mask.key_order is not None:
        query, key, value, attn_mask, attn_bias, is_causal = _in_key_order(
            query, key, value, attn_mask, attn_bias, is_causal, softmax_scale)
    call = plan_call(query, key, value, attn_mask, _compact_bias(attn_bias), is_causal,
                     softmax_scale, bool(for_backward), deterministic,
                     attn_bias is not None and bool(bias_requires_grad), kernel_options)
    return call.plan.schedule
