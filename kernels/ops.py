"""``dmattn_func`` as ``torch.library`` custom ops, the form ``torch.compile`` captures.

Two ops, both opaque to the compiler (Inductor calls them as they are):

* ``dmattn::fwd(query, key, value, is_causal, softmax_scale, deterministic, attn_mask,
  attn_bias) -> (out, lse)``
* ``dmattn::bwd(grad_out, query, key, value, out, lse, is_causal, softmax_scale,
  deterministic, bias_needs_grad, attn_mask, attn_bias) -> (dq, dk, dv, dbias)``

Each has a fake implementation (output shapes, strides and dtypes without running a kernel, and
the eager input checks), and ``fwd`` has its autograd formula, which calls ``bwd``.

Only traced calls take these ops: ``interface.dmattn_func`` routes to :func:`dmattn_traced`
while ``torch.compiler.is_compiling()``, and eager calls keep their own autograd.Function.
Both reach the same host layer, through :func:`_forward_impl` and :func:`_backward_impl`, so
they give bitwise-equal results.

``torch.library.custom_op`` rather than ``triton_op``: the host layer launches its kernels
through planned launches (``_launch.PlannedLaunch``), not ``kernel[grid](...)`` calls that
``triton_op``'s tracing could capture, so there is nothing for Inductor to look into.

What an op cannot carry, and what that costs:

* A forward plan is a Python object, so the backward op plans again from its inputs. Without a
  mask that is a lookup of the plan the forward kept for its signature. With a mask, plans are
  not kept, so the backward reads the mask once more to find its active tiles (one pass over
  the mask, as an eager forward makes per call).
* A ``PreparedMask`` travels as its mask tensor: a compiled call reads the mask per call, in
  the forward and again in the backward, as an unprepared mask is read. Its prepared lists go
  unused, and so do its checks against the call's shapes and against writes since
  ``prepare_mask`` (the op reads the mask as it is now).
* The LSE is always an output of ``fwd`` (the backward needs it); a call that did not ask for
  it gets it allocated anyway.

The ops take tensors and scalars only. Each optional tensor argument is named in
``OPERANDS``; each form of ``attn_mask`` the public function accepts is a row of
``MASK_FORMS``, saying which of those arguments it travels in. A new mask form made of tensors
is one more row there, plus its argument names in ``OPERANDS``.

Neither op reads device memory back to the host (no synchronization), so a CUDA graph can
capture them.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Real

import torch
from torch import Tensor

from . import interface
from ._checks import check_inputs, resolve_scale
from .backward import attention_backward
from .prepared import PreparedMask

NAMESPACE = "dmattn"

# The ops' optional tensor arguments, in schema order, after the scalars: the tensors of every
# mask form, then the bias.
OPERANDS = ("attn_mask", "attn_bias")
Operands = namedtuple("Operands", OPERANDS)


@dataclass(frozen=True)
class MaskForm:
    """One kind of object ``attn_mask`` may be, and how it crosses the op boundary."""

    kind: type
    args: tuple[str, ...]  # the ``OPERANDS`` it travels in
    to_tensors: Callable  # the caller's mask -> its tensors, in ``args`` order
    to_host: Callable  # those tensors -> the host layer's ``attn_mask``


MASK_FORMS = (
    MaskForm(Tensor, ("attn_mask",), lambda mask: (mask,), lambda mask: mask),
    # Its mask tensor only: see the module docstring for what that costs.
    MaskForm(PreparedMask, ("attn_mask",), lambda mask: (mask.mask,), lambda mask: mask),
)


def operands_of(attn_mask, attn_bias) -> Operands:
    """The ops' optional tensor arguments for a call's ``attn_mask`` and ``attn_bias``."""
    slots = dict.fromkeys(OPERANDS)
    slots["attn_bias"] = attn_bias
    if attn_mask is not None:
        form = next((f for f in MASK_FORMS if isinstance(attn_mask, f.kind)), None)
        if form is None:
            raise TypeError(f"attn_mask must be a torch.Tensor, a PreparedMask or None, got "
                            f"{type(attn_mask).__name__}")
        slots.update(zip(form.args, form.to_tensors(attn_mask)))
    return Operands(**slots)


def host_mask(operands: Operands):
    """What the host layer takes as ``attn_mask``: the first form whose tensors are all given."""
    for form in MASK_FORMS:
        tensors = [getattr(operands, name) for name in form.args]
        if all(t is not None for t in tensors):
            return form.to_host(*tensors)
    return None


# -- the seam to the host layer: the only two functions here that launch kernels

def _forward_impl(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale):
    """(out, lse) of one forward call, lse float32 (B, Hq, Lq)."""
    plan, query, key, value, mask = interface._plan_call(
        query, key, value, attn_mask, attn_bias, is_causal, softmax_scale, for_backward=False)
    return plan.run(query, key, value, mask, attn_bias)


def _backward_impl(grad_out, query, key, value, out, lse, attn_mask, attn_bias, is_causal,
                   softmax_scale, deterministic, bias_needs_grad):
    """(dq, dk, dv, dbias or None) of one backward call, on the forward's saved tensors."""
    plan, query, key, value, mask = interface._plan_call(
        query, key, value, attn_mask, attn_bias, is_causal, softmax_scale, for_backward=True)
    return attention_backward(plan, grad_out, query, key, value, out, lse, mask, attn_bias,
                              deterministic, bias_needs_grad=bias_needs_grad)


# -- schemas

_OPTIONAL = ", ".join(f"Tensor? {name}" for name in OPERANDS)
_FLAGS = "bool is_causal, float? softmax_scale, bool deterministic"
FWD_SCHEMA = f"(Tensor query, Tensor key, Tensor value, {_FLAGS}, {_OPTIONAL}) -> (Tensor, Tensor)"
BWD_SCHEMA = (f"(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
              f"Tensor lse, {_FLAGS}, bool bias_needs_grad, {_OPTIONAL}) "
              f"-> (Tensor, Tensor, Tensor, Tensor)")


def _no_dbias(query: Tensor) -> Tensor:
    # An op cannot return None where a tensor may be: an empty tensor stands for "no gradient".
    return query.new_empty(0)


@torch.library.custom_op(f"{NAMESPACE}::fwd", mutates_args=(), schema=FWD_SCHEMA)
def attention_fwd(query, key, value, is_causal, softmax_scale, deterministic, *operands):
    ops = Operands(*operands)
    return _forward_impl(query, key, value, host_mask(ops), ops.attn_bias, is_causal,
                         softmax_scale)


@torch.library.custom_op(f"{NAMESPACE}::bwd", mutates_args=(), schema=BWD_SCHEMA)
def attention_bwd(grad_out, query, key, value, out, lse, is_causal, softmax_scale,
                  deterministic, bias_needs_grad, *operands):
    ops = Operands(*operands)
    dq, dk, dv, dbias = _backward_impl(grad_out, query, key, value, out, lse, host_mask(ops),
                                       ops.attn_bias, is_causal, softmax_scale, deterministic,
                                       bias_needs_grad)
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


def _check_fake(query, key, value, ops: Operands, softmax_scale) -> None:
    """The eager checks, so that a traced call with bad inputs fails with eager's message while
    it is traced, on the sizes it is traced with. The real op checks again when it runs,
    whatever sizes it gets (and skips nothing: sizes only known from data are checked there)."""
    tensors = (query, key, value, ops.attn_mask, ops.attn_bias)
    sizes = [s for t in tensors if t is not None for s in (*t.shape, *t.stride())]
    if any(_hint(s) is None for s in sizes):
        return
    check_inputs(*(_hinted(t) for t in tensors), softmax_scale)


@attention_fwd.register_fake
def _attention_fwd_fake(query, key, value, is_causal, softmax_scale, deterministic,
                        *operands):
    _check_fake(query, key, value, Operands(*operands), softmax_scale)
    batch, seqlen_q, heads_q, head_dim = query.shape
    out = query.new_empty((batch, seqlen_q, heads_q, head_dim))
    lse = query.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    return out, lse


@attention_bwd.register_fake
def _attention_bwd_fake(grad_out, query, key, value, out, lse, is_causal, softmax_scale,
                        deterministic, bias_needs_grad, *operands):
    ops = Operands(*operands)
    dq, dk, dv = (torch.empty_like(t) for t in (query, key, value))
    if not bias_needs_grad:
        return dq, dk, dv, _no_dbias(query)
    return dq, dk, dv, ops.attn_bias.new_empty(ops.attn_bias.shape)


# -- autograd

_BIAS_INDEX = 6 + OPERANDS.index("attn_bias")  # fwd's inputs: query, key, value, 3 scalars


def _setup_context(ctx, inputs, output):
    query, key, value, is_causal, softmax_scale, deterministic, *operands = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, *operands)
    ctx.flags = (is_causal, softmax_scale, deterministic)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, *operands = ctx.saved_tensors
    ops = Operands(*operands)
    bias_needs_grad = ops.attn_bias is not None and ctx.needs_input_grad[_BIAS_INDEX]
    dq, dk, dv, dbias = attention_bwd(grad_out, query, key, value, out, lse, *ctx.flags,
                                      bias_needs_grad, *operands)
    grads = dict.fromkeys(OPERANDS)
    grads["attn_bias"] = dbias if bias_needs_grad else None
    return dq, dk, dv, None, None, None, *grads.values()


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _scale_arg(softmax_scale) -> float | None:
    # The schema's ``float?``: eager's type and finiteness errors for anything else.
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, Real):
        resolve_scale(softmax_scale, 1)  # raises eager's TypeError
    return float(softmax_scale)


def dmattn_traced(query, key, value, attn_mask, attn_bias, is_causal, softmax_scale,
                  return_lse, deterministic):
    """``dmattn_func`` through the custom ops; what ``torch.compile`` traces."""
    out, lse = attention_fwd(query, key, value, bool(is_causal), _scale_arg(softmax_scale),
                             bool(deterministic), *operands_of(attn_mask, attn_bias))
    return (out, lse) if return_lse else out
