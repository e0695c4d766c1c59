"""``dmattn_func`` as ``torch.library`` custom ops, the form ``torch.compile`` captures.

Two ops, both opaque to the compiler (Inductor calls them as they are):

* ``dmattn::fwd(query, key, value, is_causal, softmax_scale, deterministic, plan_backward,
  bias_needs_grad, max_kept, row_kept, documents_causal, attn_mask, mask_start, mask_end,
  cu_seqlens_q, cu_seqlens_k, attn_bias, bias_base) -> (out, lse)``
* ``dmattn::bwd(grad_out, query, key, value, out, lse, is_causal, softmax_scale,
  deterministic, bias_needs_grad, documents_causal, attn_mask, mask_start, mask_end,
  cu_seqlens_q, cu_seqlens_k, attn_bias, bias_base) -> (dq, dk, dv, dbias)``

Each has a fake implementation (output shapes, strides and dtypes without running a kernel, and
the eager input checks), and ``fwd`` has its autograd formula, which calls ``bwd``.

Only traced calls take these ops: ``interface.dmattn_func`` routes to :func:`dmattn_traced`
while ``torch.compiler.is_compiling()``, and eager calls keep their own autograd.Function.
Both reach the same host layer, through :func:`_forward_impl` and :func:`_backward_impl`, so
they give bitwise-equal results.

``torch.library.custom_op`` rather than ``triton_op``: the host layer launches its kernels
through planned launches (``launch.PlannedLaunch``), not ``kernel[grid](...)`` calls that
``triton_op``'s tracing could capture, so there is nothing for Inductor to look into.

What an op cannot carry, and what that costs:

* A forward plan is a Python object, so the backward op plans again from its inputs. Without a
  mask that is a lookup of the plan the forward kept for its signature. With a mask the
  backward reads the mask once more to find its active tiles (one pass over a bool mask, as an
  eager forward makes per call; a KeyIntervals mask's one read launch, with the plan
  kept for its form).
* A ``PreparedMask`` travels as its mask tensor: a compiled call reads the mask per call, in
  the forward and again in the backward, as an unprepared mask is read. Its prepared lists go
  unused, and so do its checks against the call's shapes and against writes since
  ``prepare_mask`` (the op reads the mask as it is now).
* An ``expand()``ed bias view crosses with its base (``bias_base_of``), which gets the
  gradient in its own shape, as eager calls do. Where the compiler cannot follow the view to
  its base (a view made outside the compiled function), the view gets a full-size gradient,
  which autograd sums down to the base: pass the base itself, which the kernels broadcast.
* The LSE is always an output of ``fwd`` (the backward needs it); a call that did not ask for
  it gets it allocated anyway.

The ops take tensors and scalars only. A mask crosses as the optional tensor arguments of its
carrier (``MASK_ARGS``), and each kind of ``attn_mask`` the public function accepts is a row of
``MASK_FORMS`` naming its carrier. A new mask form made of tensors is one more carrier, whose
argument names join the schemas through ``OPERANDS``, and one more row.

Importing ``kernels`` registers both ops in torch's process-wide operator registry: an op must
exist before ``torch.compile`` traces a call to it. Both ops plan through ``call_plan``, as
eager calls do; ``interface`` imports this module to route traced calls.

Neither op reads device memory back to the host (no synchronization), so a CUDA graph can
capture them.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import call_plan
from .masks.intervals import KeyIntervals
from .planning.backward import attention_backward
from .planning.inputs import check_flags, check_inputs, resolve_scale
from .prepared import PreparedMask
from .runtime.scratch import allocated_per_call

NAMESPACE = "dmattn"


@dataclass(frozen=True)
class MaskArgs:
    """A mask as the ops carry it: the optional tensor arguments it fills, and what the host
    layer is handed as ``attn_mask`` when they arrive."""

    names: tuple[str, ...]
    to_host: Callable


BOOL_MASK = MaskArgs(("attn_mask",), lambda mask: mask)
INTERVAL_MASK = MaskArgs(("mask_start", "mask_end"), KeyIntervals)
# Every way the ops carry a mask; their arguments come first among the optional ones.
MASK_ARGS = (BOOL_MASK, INTERVAL_MASK)
# Each kind of ``attn_mask`` the public function accepts: (its type, how the ops carry it, its
# tensors in that carrier's order). A ``PreparedMask`` travels as the mask it was made from:
# see the module docstring for what that costs.
MASK_FORMS = (
    (Tensor, BOOL_MASK, lambda mask: (mask,)),
    (KeyIntervals, INTERVAL_MASK, lambda mask: (mask.start, mask.end)),
)
# The offsets of KeyIntervals that are a packed batch's documents (``KeyIntervals._documents``,
# ``dmattn_varlen_func``'s), so that the Hopper kernels walk them in compiled calls too; their
# causality crosses as the ops' ``documents_causal``.
DOCUMENT_OFFSETS = ("cu_seqlens_q", "cu_seqlens_k")
# The ops' optional tensor arguments, in schema order, after the scalars. ``bias_base`` is the
# tensor ``attn_bias`` is an expand() of, where the traced call could tell (``bias_base_of``).
OPERANDS = (*(name for carrier in MASK_ARGS for name in carrier.names), *DOCUMENT_OFFSETS,
            "attn_bias", "bias_base")
Operands = namedtuple("Operands", OPERANDS)


def operands_of(attn_mask, attn_bias) -> Operands:
    """The ops' optional tensor arguments for a call's ``attn_mask`` and ``attn_bias``."""
    slots = dict.fromkeys(OPERANDS)
    slots["attn_bias"], slots["bias_base"] = attn_bias, bias_base_of(attn_bias)
    if isinstance(attn_mask, PreparedMask):
        attn_mask = attn_mask.mask
    if attn_mask is not None:
        for kind, carrier, tensors in MASK_FORMS:
            if isinstance(attn_mask, kind):
                slots.update(zip(carrier.names, tensors(attn_mask)))
                break
        else:  # eager's message (``_checks``), which names the tensor it would take
            raise TypeError(f"attn_mask must be a bool torch.Tensor, KeyIntervals or None, got "
                            f"{type(attn_mask).__name__}")
        documents = getattr(attn_mask, "_documents", None)
        if documents is not None:
            slots.update(zip(DOCUMENT_OFFSETS, documents[:2]))
    return Operands(**slots)


def host_mask(operands: Operands, documents_causal: bool = False, max_kept: int | None = None,
              row_kept: int | None = None):
    """The host layer's ``attn_mask``: from the first carrier whose tensors all arrived;
    KeyIntervals with their ``max_kept`` and ``_row_kept`` and, where their offsets arrived,
    naming their packed documents (of causality ``documents_causal``)."""
    for carrier in MASK_ARGS:
        tensors = [getattr(operands, name) for name in carrier.names]
        if all(t is not None for t in tensors):
            mask = carrier.to_host(*tensors)
            if isinstance(mask, KeyIntervals):
                documents = None
                if operands.cu_seqlens_q is not None and operands.cu_seqlens_k is not None:
                    documents = (operands.cu_seqlens_q, operands.cu_seqlens_k,
                                 bool(documents_causal))
                if documents is not None or max_kept is not None or row_kept is not None:
                    mask = KeyIntervals(mask.start, mask.end, max_kept=max_kept,
                                        _row_kept=row_kept, _documents=documents)
            return mask
    return None


def bias_base_of(attn_bias) -> Tensor | None:
    """What ``interface._compact_bias`` hands the kernel in eager calls, found in a traced one:
    the tensor an ``expand()``ed bias requiring grad is a view of, or None.

    The ops then make the bias gradient in the base's own shape and give it to the base, with
    no full-size gradient for autograd to sum down. Only sizes and strides are read: each size
    compared is a guard of the graph (a bias with no stride-0 axis, such as a slice to the
    call's key length, is left before any), a failed ``expand()`` cannot be caught in a traced
    call, and storage offsets cannot be read there: a view with the sizes and strides of an
    expand() of its base is taken to be one (another would have to be an ``as_strided()`` at
    another offset into a base whose storage reaches past its own elements). The view goes to
    the ops too: where the compiler cannot follow ``_base`` (a view that is an input of the
    compiled function, whose base reads as None when AOTAutograd traces), the ops take the
    view, and autograd sums its gradient.
    """
    if (not isinstance(attn_bias, Tensor) or not attn_bias.requires_grad
            or 0 not in attn_bias.stride()):
        return None
    base = attn_bias._base
    if base is None or base.dim() != 4:
        return None
    if any(b != 1 and b != s for b, s in zip(base.shape, attn_bias.shape)):
        return None
    # expand()'s strides, worked out rather than made: an expand() would be one more node.
    strides = tuple(0 if b == 1 and s != 1 else stride
                    for b, s, stride in zip(base.shape, attn_bias.shape, base.stride()))
    return base if strides == attn_bias.stride() else None


def bias_slot(optional: Operands) -> str:
    """The operand the kernels read the bias from and whose gradient they make."""
    return "bias_base" if optional.bias_base is not None else "attn_bias"


def host_bias(optional: Operands) -> Tensor | None:
    """The bias the host layer is handed: the base where the traced call found one. The real
    tensors are not checked against the trace's reading: tools that run an op on copies of its
    inputs (``torch.library.opcheck``) part a view from its base while keeping the values."""
    return optional.attn_bias if optional.bias_base is None else optional.bias_base


# -- the seam to the host layer: the only two functions here that launch kernels

def _forward_impl(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale,
                  deterministic, plan_backward, bias_needs_grad):
    """(out, lse) of one forward call, lse float32 (B, Hq, Lq), planned as the eager call
    plans it: for a backward (with its determinism and bias gradient) when one will follow."""
    call = call_plan.plan_call(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale,
                               plan_backward, deterministic and plan_backward,
                               bias_needs_grad and plan_backward)
    with allocated_per_call():  # see there: Inductor's CUDA graph pools
        return call.run(attn_bias)


def _backward_impl(grad_out, query, key, value, out, lse, attn_mask, attn_bias, is_causal,
                   softmax_scale, deterministic, bias_needs_grad):
    """(dq, dk, dv, dbias or None) of one backward call, on the forward's saved tensors."""
    call = call_plan.plan_call(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale,
                               True, deterministic, bias_needs_grad)
    with allocated_per_call():
        return attention_backward(call.plan, grad_out, call.query, call.key, call.value, out,
                                  lse, call.mask, attn_bias, deterministic,
                                  bias_needs_grad=bias_needs_grad, activity=call.activity,
                                  document_offsets=call.document_offsets)


# -- schemas

def _schema(params: tuple[tuple[str, str], ...], returns: str) -> str:
    return "(" + ", ".join(f"{kind} {name}" for kind, name in params) + f") -> {returns}"


_FLAGS = (("bool", "is_causal"), ("float?", "softmax_scale"), ("bool", "deterministic"))
_OPTIONAL = tuple(("Tensor?", name) for name in OPERANDS)
# ``plan_backward``: a backward will follow; ``bias_needs_grad``: it will make a bias gradient;
# ``max_kept``: a KeyIntervals mask's ``max_kept``, which decode's gather route sizes its lists
# by; ``row_kept``: its ``_row_kept``, which the Hopper forward's route reads, and the backward
# (``backward_schedule.split_heads``: key-ordered top-W walks). All steer the plan, as in eager
# calls.
_FWD_PARAMS = (("Tensor", "query"), ("Tensor", "key"), ("Tensor", "value"), *_FLAGS,
               ("bool", "plan_backward"), ("bool", "bias_needs_grad"), ("int?", "max_kept"),
               ("int?", "row_kept"), ("bool", "documents_causal"), *_OPTIONAL)
_BWD_PARAMS = (("Tensor", "grad_out"), ("Tensor", "query"), ("Tensor", "key"),
               ("Tensor", "value"), ("Tensor", "out"), ("Tensor", "lse"), *_FLAGS,
               ("bool", "bias_needs_grad"), ("int?", "row_kept"), ("bool", "documents_causal"),
               *_OPTIONAL)
FWD_SCHEMA = _schema(_FWD_PARAMS, "(Tensor, Tensor)")
BWD_SCHEMA = _schema(_BWD_PARAMS, "(Tensor, Tensor, Tensor, Tensor)")
_FWD_INPUTS = tuple(name for _, name in _FWD_PARAMS)  # the order of ``needs_input_grad``


def _no_dbias(query: Tensor) -> Tensor:
    # An op cannot return None where a tensor may be: an empty tensor stands for "no gradient".
    return query.new_empty(0)


@torch.library.custom_op(f"{NAMESPACE}::fwd", mutates_args=(), schema=FWD_SCHEMA)
def attention_fwd(query, key, value, is_causal, softmax_scale, deterministic, plan_backward,
                  bias_needs_grad, max_kept, row_kept, documents_causal, *operands):
    optional = Operands(*operands)
    mask = host_mask(optional, documents_causal, max_kept, row_kept)
    return _forward_impl(query, key, value, mask, host_bias(optional), is_causal,
                         softmax_scale, deterministic, plan_backward, bias_needs_grad)


@torch.library.custom_op(f"{NAMESPACE}::bwd", mutates_args=(), schema=BWD_SCHEMA)
def attention_bwd(grad_out, query, key, value, out, lse, is_causal, softmax_scale,
                  deterministic, bias_needs_grad, row_kept, documents_causal, *operands):
    optional = Operands(*operands)
    dq, dk, dv, dbias = _backward_impl(grad_out, query, key, value, out, lse,
                                       host_mask(optional, documents_causal, row_kept=row_kept),
                                       host_bias(optional), is_causal, softmax_scale,
                                       deterministic, bias_needs_grad)
    return dq, dk, dv, _no_dbias(query) if dbias is None else dbias


# -- fake implementations

def _hint(size):
    """A symbolic size's value in the call being traced (None for a data-dependent one)."""
    return size.node.hint if isinstance(size, torch.SymInt) else size


def _hinted(t: Tensor | None) -> Tensor | None:
    """``t`` with the plain sizes and strides of the call being traced, standing in for
    symbolic ones: the eager checks put sizes in sets, which symbolic sizes refuse."""
    if t is None or not any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride())):
        return t
    return torch.empty_strided([_hint(s) for s in t.shape], [_hint(s) for s in t.stride()],
                               dtype=t.dtype, device=t.device)


def _check_fake(query, key, value, optional: Operands, softmax_scale) -> None:
    """The eager checks, so that a traced call with bad inputs fails with eager's message while
    it is traced, on the sizes it is traced with. The real op checks again when it runs,
    whatever sizes it gets (and skips nothing: sizes only known from data are checked there)."""
    tensors = (query, key, value, optional.attn_mask, optional.attn_bias)
    sizes = [s for t in tensors if t is not None for s in (*t.shape, *t.stride())]
    if any(_hint(s) is None for s in sizes):
        return
    check_inputs(*(_hinted(t) for t in tensors), softmax_scale)


@attention_fwd.register_fake
def _attention_fwd_fake(query, key, value, is_causal, softmax_scale, deterministic,
                        plan_backward, bias_needs_grad, max_kept, row_kept, documents_causal,
                        *operands):
    _check_fake(query, key, value, Operands(*operands), softmax_scale)
    batch, seqlen_q, heads_q, head_dim = query.shape
    out = query.new_empty((batch, seqlen_q, heads_q, head_dim))
    lse = query.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    return out, lse


def _grad_like(t: Tensor) -> Tensor:
    # The kernels read a contiguous copy of an input whose last stride is not 1 (``call_plan``'s
    # ``_last_dim_contiguous``) and make its gradient like that copy.
    return torch.empty_like(t if t.stride(-1) == 1 else t.contiguous())


@attention_bwd.register_fake
def _attention_bwd_fake(grad_out, query, key, value, out, lse, is_causal, softmax_scale,
                        deterministic, bias_needs_grad, row_kept, documents_causal, *operands):
    optional = Operands(*operands)
    dq, dk, dv = (_grad_like(t) for t in (query, key, value))
    if not bias_needs_grad:
        return dq, dk, dv, _no_dbias(query)
    bias = getattr(optional, bias_slot(optional))
    return dq, dk, dv, bias.new_empty(bias.shape)


# -- autograd

def _setup_context(ctx, inputs, output):
    (query, key, value, is_causal, softmax_scale, deterministic, _, _, _, row_kept,
     documents_causal, *operands) = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, *operands)
    ctx.flags = (is_causal, softmax_scale, deterministic)
    ctx.row_kept, ctx.documents_causal = row_kept, documents_causal
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, *operands = ctx.saved_tensors
    optional = Operands(*operands)
    slot = bias_slot(optional)
    bias_needs_grad = (getattr(optional, slot) is not None
                       and ctx.needs_input_grad[_FWD_INPUTS.index(slot)])
    dq, dk, dv, dbias = attention_bwd(grad_out, query, key, value, out, lse, *ctx.flags,
                                      bias_needs_grad, ctx.row_kept, ctx.documents_causal,
                                      *operands)
    grads = dict.fromkeys(_FWD_INPUTS)
    grads.update(query=dq, key=dk, value=dv)
    grads[slot] = dbias if bias_needs_grad else None
    return tuple(grads.values())


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _scale_arg(softmax_scale) -> float | None:
    """The schema's ``float?``: eager's TypeError or ValueError for anything but a finite real
    number (``resolve_scale``; the head dim it takes only matters for None)."""
    return None if softmax_scale is None else resolve_scale(softmax_scale, head_dim=1)


def dmattn_traced(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale,
                  return_lse, deterministic, kernel_options=None):
    """``dmattn_func`` through the custom ops; what ``torch.compile`` traces."""
    flags = dict(is_causal=is_causal, return_lse=return_lse, deterministic=deterministic)
    # isinstance, which Dynamo traces in every torch version here; check_flags' own test
    # (``value.__class__ is bool``) fails for a real bool under torch 2.11's Dynamo.
    if not all(isinstance(value, bool) for value in flags.values()):
        check_flags(**flags)  # eager's TypeError
    if kernel_options:
        raise ValueError("kernel_options: not taken under torch.compile (the ops run the "
                         "default schedule); pass it in eager calls")
    optional = operands_of(attn_mask, attn_bias)
    bias = getattr(optional, bias_slot(optional))
    plan_backward = call_plan.needs_grad(query, key, value, bias)
    given = attn_mask.mask if isinstance(attn_mask, PreparedMask) else attn_mask
    max_kept = given.max_kept if isinstance(given, KeyIntervals) else None
    row_kept = given._row_kept if isinstance(given, KeyIntervals) else None
    documents = given._documents if isinstance(given, KeyIntervals) else None
    documents_causal = bool(documents[2]) if documents is not None else False
    out, lse = attention_fwd(query, key, value, is_causal, _scale_arg(softmax_scale),
                             deterministic, plan_backward,
                             getattr(bias, "requires_grad", False), max_kept, row_kept,
                             documents_causal, *optional)
    return (out, lse) if return_lse else out
