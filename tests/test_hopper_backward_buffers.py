"""The Hopper backward's buffers and its two Triton launches (``planning.hopper_backward_buffers``),
interpreted on a CPU (compiled with ``--device cuda``): the loader rows against torch with every
accumulator zeroed from poison, and the finishing launch's casts and bias sums against torch's
``dbias.finish_gradient``. The Gluon kernel between them runs in ``test_hopper_backward``."""

from __future__ import annotations

import pytest
import torch

from kernels.planning import hopper_backward_buffers
from kernels.planning.dbias import finish_gradient, per_query_head_rows, plan_dbias
from kernels.planning.hopper_backward_buffers import HopperBackwardBuffers, sums_bias_rows
from kernels.planning.inputs import AttnShape
from kernels.runtime.arith import LOG2E


def buffers_for(device, shape: AttnShape, split_heads=False, lock_count=0, dbias=None,
                dq_spread=False, block_m=64) -> HopperBackwardBuffers:
    return HopperBackwardBuffers(shape, block_m, split_heads, lock_count, dbias, dq_spread,
                                 torch.device(device))


def poisoned_views(buffers: HopperBackwardBuffers):
    views = buffers.views()
    views.rows.fill_(float("nan"))
    views.zeroed.fill_(float("nan"))
    return views


@pytest.mark.parametrize("sizes", [(2, 17, 3, 8), (1, 130, 2, 80), (2, 1, 1, 128)],
                         ids=["Lq17-D8", "Lq130-D80", "Lq1-D128"])
@pytest.mark.parametrize("layout", ["contiguous", "bhld"])
def test_the_loader_rows_hold_scaled_lse_and_delta_padded_to_whole_query_blocks(device, sizes,
                                                                                 layout):
    """LSE x log2 e, +inf where it is -inf and past Lq; delta = sum over D of dO * O in
    float32, 0 past Lq; dQ's accumulator zeroed in the same launch."""
    batch, seqlen_q, heads, head_dim = sizes
    grad_out, out = (torch.randn(batch, seqlen_q, heads, head_dim, device=device)
                     .to(torch.bfloat16) for _ in range(2))
    if layout == "bhld":  # dO as a (B, H, L, D) tensor's transposed view
        grad_out = grad_out.transpose(1, 2).contiguous().transpose(1, 2)
    lse = torch.randn(batch, heads, seqlen_q, device=device)
    lse[0, 0, seqlen_q // 2] = float("-inf")  # a row that saw no key
    buffers = buffers_for(device, AttnShape(batch, seqlen_q, 5, heads, 1, head_dim))
    views = poisoned_views(buffers)
    buffers.fill_rows(grad_out, out, lse, views)
    rows = views.rows
    padded = -(-seqlen_q // 64) * 64
    assert rows.shape == (2, batch * heads, padded) and rows.stride(1) * 4 % 16 == 0
    scaled = (lse * LOG2E).masked_fill(lse == float("-inf"), float("inf"))
    torch.testing.assert_close(rows[0, :, :seqlen_q], scaled.reshape(batch * heads, seqlen_q))
    delta = (grad_out.float() * out.float()).sum(-1).transpose(1, 2)
    torch.testing.assert_close(rows[1, :, :seqlen_q], delta.reshape(batch * heads, seqlen_q))
    assert (rows[0, :, seqlen_q:] == float("inf")).all() and (rows[1, :, seqlen_q:] == 0).all()
    assert (views.dq_acc == 0).all()


@pytest.mark.parametrize("words_per_program", [16 * 1024, 1024], ids=["rows-grid", "widened"])
def test_the_loader_launch_zeroes_every_accumulator_and_lock(device, monkeypatch,
                                                             words_per_program):
    """Split heads' dK and dV accumulators and the deterministic locks start at zero, also
    where the zeroes need more programs than the rows (a long key axis, few query rows)."""
    monkeypatch.setattr(hopper_backward_buffers, "ZERO_WORDS_PER_PROGRAM", words_per_program)
    shape = AttnShape(batch=2, seqlen_q=3, seqlen_k=301, heads_q=2, heads_kv=1, head_dim=16)
    buffers = buffers_for(device, shape, split_heads=True, lock_count=7)
    views = poisoned_views(buffers)
    grad_out, out = (torch.randn(2, 3, 2, 16, device=device) for _ in range(2))
    buffers.fill_rows(grad_out, out, torch.randn(2, 2, 3, device=device), views)
    assert views.zeroed.numel() >= 2 * 2 * 301 * 16 + 2 * 3 * 2 * 16 + 7
    assert not views.zeroed.isnan().any() and (views.zeroed == 0).all()
    for acc in (views.dq_acc, views.dk_acc, views.dv_acc, views.locks):
        assert (acc == 0).all()
    assert views.locks.dtype == torch.int32 and views.locks.numel() == 7


def spread_columns(dq: torch.Tensor) -> torch.Tensor:
    """``hopper_device.dq_columns.spread_columns`` in torch: every 32 columns' column
    8j + 4a + b moved to a * 16 + j * 4 + b."""
    *lead, head_dim = dq.shape
    quarters = dq.reshape(*lead, head_dim // 32, 4, 2, 4)
    return quarters.transpose(-3, -2).reshape(*lead, head_dim)


def gradient_like(shape: tuple, dtype, layout: str, device) -> torch.Tensor:
    """An empty (B, L, H, D) gradient, contiguous or a (B, H, L, D) tensor's transposed view."""
    if layout == "bhld":
        batch, length, heads, head_dim = shape
        return torch.empty(batch, heads, length, head_dim, dtype=dtype,
                           device=device).transpose(1, 2)
    return torch.empty(shape, dtype=dtype, device=device)


def assert_cast(result: torch.Tensor, expected: torch.Tensor):
    """float32 exactly; 16 bits within one rounding (the interpreter truncates the cast where
    the GPU rounds to nearest)."""
    if result.dtype == torch.float32:
        assert torch.equal(result, expected)
    else:
        torch.testing.assert_close(result.float(), expected,
                                   rtol=torch.finfo(result.dtype).eps, atol=1e-4)


@pytest.mark.parametrize("head_dim, spread", [(128, True), (128, False), (80, False)])
@pytest.mark.parametrize("split_heads", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("layout", ["contiguous", "bhld"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_finishing_launch_casts_the_accumulators_into_the_gradients(
        device, head_dim, spread, split_heads, layout, dtype):
    """dQ from its accumulator (its columns spread or not) and, with split heads, dK and dV
    from theirs, each into the gradient's own strides; whole groups leave dK and dV alone."""
    shape = AttnShape(batch=2, seqlen_q=37, seqlen_k=21, heads_q=3, heads_kv=1,
                      head_dim=head_dim)
    buffers = buffers_for(device, shape, split_heads=split_heads, dq_spread=spread)
    views = buffers.views()
    expected_dq = torch.randn(views.dq_acc.shape, device=device)
    views.dq_acc.copy_(spread_columns(expected_dq) if spread else expected_dq)
    q_shape, kv_shape = (2, 37, 3, head_dim), (2, 21, 1, head_dim)
    dq = gradient_like(q_shape, dtype, layout, device)
    dk, dv = (gradient_like(kv_shape, dtype, layout, device).fill_(7) for _ in range(2))
    if split_heads:
        views.dk_acc.copy_(torch.randn(kv_shape, device=device))
        views.dv_acc.copy_(torch.randn(kv_shape, device=device))
    assert buffers.finish(views, dq, dk, dv, None) is None
    assert_cast(dq, expected_dq)
    if split_heads:
        assert_cast(dk, views.dk_acc)
        assert_cast(dv, views.dv_acc)
    else:
        assert (dk == 7).all() and (dv == 7).all()


@pytest.mark.parametrize("bias_shape", [(2, 2, 1, 50), (1, 2, 1, 50), (1, 1, 1, 50),
                                        (2, 4, 1, 50), (1, 4, 1, 50)],
                         ids=["kv-heads", "kv-heads-one-batch", "one-head", "query-heads",
                              "query-heads-one-batch"])
@pytest.mark.parametrize("split_heads", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_finishing_launch_sums_the_bias_rows_as_torch_does(device, bias_shape,
                                                               split_heads, dtype):
    """The gradient of a one-row bias from the kernel's float32 rows (a row per query head
    with split heads, per group otherwise): summed over the heads and the batch the bias
    broadcasts along and cast, as ``dbias.finish_gradient`` does in torch; where the rows
    are the gradient itself, it is returned as written."""
    shape = AttnShape(batch=2, seqlen_q=9, seqlen_k=50, heads_q=4, heads_kv=2, head_dim=16)
    head_div = shape.heads_q // bias_shape[1]
    dbias = plan_dbias(bias_shape, head_div, shape, dtype, False)
    if split_heads and dbias.sum_group:
        dbias = per_query_head_rows(dbias, shape)
    buffers = buffers_for(device, shape, split_heads=split_heads, dbias=dbias)
    views = buffers.views()
    buffer = buffers.bias_buffer(views, torch.device(device))
    assert buffer.shape == dbias.buffer_shape and buffer.dtype == dbias.buffer_dtype
    buffer.copy_(torch.randn(buffer.shape, device=device))
    expected = finish_gradient(buffer.clone(), bias_shape, dtype)
    dq = torch.empty(2, 9, 4, 16, device=device)
    dk, dv = (torch.empty(2, 50, 2, 16, device=device) for _ in range(2))
    grad = buffers.finish(views, dq, dk, dv, buffer)
    assert grad.shape == bias_shape and grad.dtype == dtype
    if sums_bias_rows(dbias, shape):
        torch.testing.assert_close(grad.float(), expected.float(),
                                   rtol=torch.finfo(dtype).eps, atol=1e-5)
    else:
        assert grad.data_ptr() == buffer.data_ptr()


def test_a_kept_buffer_s_views_are_made_once(device):
    """Where the scratch buffer is kept (CUDA, below its cap) a call gets the views of the
    last call on its stream; a buffer made per call gets views of its own."""
    shape = AttnShape(batch=1, seqlen_q=5, seqlen_k=7, heads_q=2, heads_kv=1, head_dim=16)
    buffers = buffers_for(device, shape, split_heads=True, lock_count=3)
    first, second = buffers.views(), buffers.views()
    same = torch.device(device).type == "cuda"
    assert (first is second) == same
    assert buffers.keeps(second) == same and not buffers.keeps(first._replace())
    assert (first.dq_acc.data_ptr() == second.dq_acc.data_ptr()) == same
    for views in (first, second):
        start = views.rows.data_ptr()
        assert views.dq_acc.data_ptr() == views.zeroed.data_ptr() > start
        assert views.locks.data_ptr() < views.zeroed.data_ptr() + views.zeroed.numel() * 4
        assert all(v.data_ptr() % 256 == start % 256 for v in views if v is not None)
