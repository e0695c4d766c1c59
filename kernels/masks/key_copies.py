"""K and V read in a key order by row copies, and their gradients back through the inverse
order: the launches of ``triton_device.key_order_kernels`` for ``masks.key_order``, which
decides what a call reads in which order. A bias of one row per (batch, head of the copies)
may ride in the same launches, both ways.
"""

from __future__ import annotations

import torch

from ..runtime.arith import ceil_div, next_power_of_2
from ..runtime.launch import PlannedLaunch, is_interpreted
from ..triton_device.key_order_kernels import (_keys_in_order_grad_kernel,
                                               _keys_in_order_kernel)


def _vector_width(tensors, head_dims) -> int:
    """The elements per vector of the row copies' loads and stores: 16 bytes' worth, halved
    until every tensor's address and non-unit strides and every head dim are multiples of
    it."""
    vec = 16 // tensors[0].element_size()
    while vec > 1:
        widths = [t.data_ptr() // t.element_size() for t in tensors]
        widths += [s for t in tensors for s in t.stride()[:3]] + list(head_dims)
        if all(w % vec == 0 for w in widths):
            break
        vec //= 2
    return vec


# Positions per program of the row copies, and warps. H200, bf16 D128, K and V (B2 L8192 Hk4,
# 67 MB read and written) forward / gradient: 8 rows on 1 warp 20 / 20 us (3.3 TB/s), 16 on 2
# 23 / 21, 32 on 2 32 / 26, 64 on 4 63 / 30, 128 on 8 73 / 41; torch.gather's forward and
# scatter_add gradient 98 us together. Under the interpreter, whose cost is per program, 128.
ROWS_PER_PROGRAM = 8
COPY_WARPS = 1
INTERPRETED_ROWS_PER_PROGRAM = 128
# Row-copy launches planned per form (kernel, layouts, heads, addresses' 16-byte alignment):
# a model's calls use a few. A plan's launch skips Triton's per-call dispatch.
MAX_COPY_PLANS = 32
_copy_plans: dict = {}


def _copy_plan(kernel, sources, copies, order, heads: int, biases=None) -> PlannedLaunch:
    """The planned launch of ``kernel`` for ``sources`` (K and V, or their gradients: (B, Lk,
    Hk, D)), ``copies`` (the (B, Lk, heads, D) reads in order, or their gradients) and
    ``order`` (Bm, Hm, Lk), stride 1 on keys: the order, or its inverse. ``biases``: None, or
    the (read, written) bias rows of the launch, each (B, heads, 1, Lk)."""
    tensors = (*sources, *copies)
    form = (kernel, order.shape, order.stride(), heads,
            *((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16) for t in tensors),
            None if biases is None else tuple((t.shape, t.stride(), t.dtype) for t in biases))
    plan = _copy_plans.get(form)
    if plan is not None:
        return plan
    key, value = sources
    batch, seqlen_k, heads_kv = key.shape[:3]
    bm, hm = order.shape[:2]
    k_dim, v_dim = key.shape[3], value.shape[3]
    bias_strides = (0,) * 6 if biases is None else tuple(
        stride for t in biases for stride in (t.stride(0), t.stride(1), t.stride(3)))
    scalars = (seqlen_k, *key.stride()[:3], *value.stride()[:3], *copies[0].stride()[:3],
               *copies[1].stride()[:3], order.stride(0) if bm > 1 else 0, order.stride(1),
               *bias_strides, heads // heads_kv, heads // hm)
    rows = INTERPRETED_ROWS_PER_PROGRAM if is_interpreted(kernel) else ROWS_PER_PROGRAM
    grid = (ceil_div(seqlen_k, rows), heads if kernel is _keys_in_order_kernel else heads_kv,
            batch)
    plan = PlannedLaunch(kernel, grid, None, scalars, num_warps=COPY_WARPS, num_stages=1,
                         K_DIM=k_dim, V_DIM=v_dim, BLOCK_K=next_power_of_2(k_dim),
                         BLOCK_V=next_power_of_2(v_dim), BLOCK_L=rows,
                         VEC=_vector_width(tensors, (k_dim, v_dim)),
                         HAS_BIAS=biases is not None)
    _copy_plans[form] = plan
    while len(_copy_plans) > MAX_COPY_PLANS:
        del _copy_plans[next(iter(_copy_plans))]  # the oldest
    return plan


def _copy_rows(kernel, sources, copies, order, heads: int, biases=None) -> None:
    """Launches ``kernel``'s ``_copy_plan``: the sources read into the copies in ``order``, or
    (the gradient kernel) the copies read back into the sources through the inverse order;
    ``biases`` (read, written) ride along."""
    plan = _copy_plan(kernel, sources, copies, order, heads, biases)
    read, written = (sources, copies) if kernel is _keys_in_order_kernel else (copies, sources)
    bias_read, bias_written = (read[0], written[0]) if biases is None else biases
    plan(*read, *written, order, bias_read, bias_written)


class KeysInOrder(torch.autograd.Function):
    """K and V (B, Lk, Hk, D) read in ``order`` (Bm, Hm, Lk) and widened to ``heads`` (a
    multiple of Hk and of Hm): (B, Lk, heads, D) each, by row copies
    (``triton_device.key_order_kernels``); the gradient a copy through ``inverse``."""

    @staticmethod
    def forward(ctx, key, value, order, inverse, heads):
        ctx.save_for_backward(inverse)
        ctx.shapes = key.shape, value.shape, heads
        return copy_in_order(key, value, order, heads)[:2]

    @staticmethod
    def backward(ctx, dk_out, dv_out):
        (inverse,) = ctx.saved_tensors
        key_shape, value_shape, heads = ctx.shapes
        dk, dv, _ = copy_back(dk_out, dv_out, None, key_shape, value_shape, None, inverse,
                               heads)
        return dk, dv, None, None, None


def copy_in_order(key, value, order, heads, bias=None):
    """(K, V, bias or None) read in ``order`` and widened to ``heads``: the bias, of one row
    per (batch, output head), only read in order."""
    batch, seqlen_k = key.shape[:2]
    k_out = key.new_empty(batch, seqlen_k, heads, key.shape[3])
    v_out = value.new_empty(batch, seqlen_k, heads, value.shape[3])
    bias_out = None if bias is None else bias.new_empty(bias.shape)
    _copy_rows(_keys_in_order_kernel, (key, value), (k_out, v_out), order, heads,
               None if bias is None else (bias, bias_out))
    return k_out, v_out, bias_out


def copy_back(dk_out, dv_out, dbias_out, key_shape, value_shape, bias_shape, inverse, heads):
    """(dK, dV, dbias or None) from the gradients of ``copy_in_order``'s reads."""
    # a gradient with its head dim strided (none the attention backward makes) is copied
    dk_out = dk_out if dk_out.stride(3) == 1 else dk_out.contiguous()
    dv_out = dv_out if dv_out.stride(3) == 1 else dv_out.contiguous()
    dk = dk_out.new_empty(key_shape)
    dv = dv_out.new_empty(value_shape)
    dbias = None if dbias_out is None else dbias_out.new_empty(bias_shape)
    _copy_rows(_keys_in_order_grad_kernel, (dk, dv), (dk_out, dv_out), inverse, heads,
               None if dbias is None else (dbias_out, dbias))
    return dk, dv, dbias
