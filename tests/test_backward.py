"""Backward of dmattn_func: dq, dk, dv and dbias against float64 autograd of the reference.

``run_backward`` checks every gradient's shape, dtype and finiteness, then applies the
project's accuracy rule against the float64 truth. For float32 inputs that rule is tight (the
eager float32 error plus 5e-5), which is the gradcheck-grade comparison: float64 is not a kernel
dtype, so ``torch.autograd.gradcheck`` itself cannot run on the kernels.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from attn_helpers import (BROADCAST_BATCH, BROADCAST_COLS, BROADCAST_DIMS, BROADCAST_HEADS,
                          BROADCAST_ROWS, CAUSAL, DTYPES, Dims, HEADS, HEAD_DIMS, LONG_SEQLEN_K,
                          MASKED, MASKED_BAND, OPERAND_FORMS, QKV_LAYOUTS,
                          assert_close_to_reference, assert_deterministic_grads,
                          assert_no_lq_lk_allocation, assert_same_bits, backward_schedule, forcing,
                          grads_of, in_form,
                          masked_band_problem, nan_in_band, random_bias, random_mask,
                          random_problem, random_qkv, run_backward)
from kernels import attention_reference, dmattn_func

# -- grids
SEQLENS_Q = (1, 17, 97)
SEQLENS_K = (1, 17, 97)
SCALES = (None, 0.0, 3.0)
EMPTY_PATTERNS = ("empty_rows", "no_keys", "key_band")
# Bias shapes whose gradient has several contributors per element (batch, head, row or column
# sums): the cases where atomics would make the default mode non-deterministic.
SHARED_BIASES = (
    pytest.param(("1", "1", "Lq", "Lk"), id="shared"),
    pytest.param(("1", "Hq", "Lq", "Lk"), id="batch_shared"),
    pytest.param(("B", "1", "Lq", "Lk"), id="head_shared"),
    pytest.param(("1", "Hk", "1", "Lk"), id="kv_row"),
    pytest.param(("1", "1", "Lq", "1"), id="q_col"),
)


@pytest.mark.parametrize("seqlen_q", SEQLENS_Q)
@pytest.mark.parametrize("seqlen_k", SEQLENS_K)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("masked", MASKED)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_lengths(seqlen_q, seqlen_k, causal, masked, dtype, device):
    """Odd and unequal lengths, decode (Lq = 1), Lq != Lk with causal; bias per KV head."""
    dims = Dims(1, seqlen_q, seqlen_k, heads_q=2, heads_kv=1, head_dim=40)
    q, k, v = random_qkv(dims, dtype, device)
    mask = random_mask(dims.full_operand_shape("Hk"), device) if masked else None
    bias = random_bias(dims.full_operand_shape("Hk"), dtype, device)
    run_backward(q, k, v, mask, bias, causal)


@pytest.mark.parametrize("seqlen_q", (1, 3))
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("masked", MASKED)
def test_grad_decode_key_split(seqlen_q, causal, masked, device):
    """Decode-sized grids split dq over the keys: every share must land in the sum. (Such
    calls take the packed backward by default; the general one is forced here.)"""
    dims = Dims(1, seqlen_q, 1031, heads_q=4, heads_kv=2, head_dim=40)
    q, k, v, mask, bias = random_problem(dims, torch.bfloat16, device, mask="BxHkxLqxLk",
                                         bias="BxHkx1xLk", keep=0.5)
    mask = mask if masked else None
    options = {"backward": "dq+dkdv"}
    bwd = backward_schedule(q, k, v, mask, bias, causal, kernel_options=options)
    assert bwd.general.dq_key_splits > 1, "this shape should take the split path"
    run_backward(q, k, v, mask, bias, causal, func=forcing(**options))


def test_decode_key_split_is_deterministic(device):
    """The split partials are summed in a fixed order: two runs give identical bits."""
    dims = Dims(1, 1, 1031, heads_q=4, heads_kv=2, head_dim=40)
    q, k, v, mask, bias = random_problem(dims, torch.float16, device, mask="BxHkxLqxLk",
                                         bias="BxHkx1xLk", keep=0.5)
    assert_deterministic_grads(q, k, v, mask, bias, True)


@pytest.mark.parametrize("batch,seqlen_q,heads,small_grid", [
    (1, 97, (4, 2), True),  # 1 x 2 x 2 key blocks of 64: a few programs, 16-key dkdv tiles
    (3, 17, (8, 8), False),  # 3 x 8 x 2 = 48 programs (over 132 / 4): the usual 64-key tiles
])
def test_grad_dkdv_tiles_follow_the_grid_size(batch, seqlen_q, heads, small_grid, device):
    """D128 picks its dkdv key block by how many programs the grid has; both must be right."""
    dims = Dims(batch, seqlen_q, 97, heads_q=heads[0], heads_kv=heads[1], head_dim=128)
    q, k, v, mask, bias = random_problem(dims, torch.bfloat16, device, mask="BxHkxLqxLk",
                                         bias="BxHkx1xLk", keep=0.5)
    if device.type == "cuda":  # the interpreter always takes its own small tiles
        assert backward_schedule(q, k, v, mask, bias, True).general.dkdv.block_n == \
            (16 if small_grid else 64)
    run_backward(q, k, v, mask, bias, causal=True)


@pytest.mark.slow
@pytest.mark.parametrize("causal", CAUSAL)
def test_grad_long_odd_key_length(causal, device):
    """Lk = 4095 with a (1, 1, 1, Lk) bias: dbias summed over rows, odd key length."""
    dims = Dims(1, 17, LONG_SEQLEN_K, heads_q=1, heads_kv=1, head_dim=16)
    q, k, v, mask, bias = random_problem(
        dims, torch.float16, device, mask="1x1xLqxLk", bias="1x1x1xLk", keep=0.5)
    run_backward(q, k, v, mask, bias, causal)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grad_head_dims(head_dim, dtype, device):
    dims = Dims(1, 33, 40, heads_q=2, heads_kv=1, head_dim=head_dim)
    q, k, v, mask, bias = random_problem(dims, dtype, device, mask="1x1xLqxLk", bias="BxHkx1xLk")
    run_backward(q, k, v, mask, bias, causal=True)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("causal", CAUSAL)
def test_grad_head_groups(heads, causal, device):
    """dk and dv sum over the query heads of each KV head's group."""
    heads_q, heads_kv = heads
    dims = Dims(2, 23, 37, heads_q, heads_kv, head_dim=16)
    q, k, v, mask, bias = random_problem(
        dims, torch.float32, device, mask="BxHkxLqxLk", bias="BxHqxLqxLk")
    run_backward(q, k, v, mask, bias, causal)


@pytest.mark.parametrize("batch", BROADCAST_BATCH)
@pytest.mark.parametrize("heads", BROADCAST_HEADS)
@pytest.mark.parametrize("rows", BROADCAST_ROWS)
@pytest.mark.parametrize("cols", BROADCAST_COLS)
@pytest.mark.parametrize("form", OPERAND_FORMS)
def test_bias_grad_broadcast(batch, heads, rows, cols, form, device):
    """dbias arrives in the bias leaf's own shape, summed over every broadcast axis. In the
    expanded form the leaf is the small tensor and the kernel sees a stride-0 view of it."""
    dims = BROADCAST_DIMS
    q, k, v = random_qkv(dims, torch.float32, device)
    bias = random_bias(dims.operand_shape(batch, heads, rows, cols), torch.float32, device)
    mask = random_mask(dims.operand_shape("B", "1", "Lq", "Lk"), device)
    run_backward(q, k, v, mask, bias, causal=True,
                 bias_view=partial(in_form, dims=dims, form=form))


@pytest.mark.parametrize("batch", BROADCAST_BATCH)
@pytest.mark.parametrize("heads", BROADCAST_HEADS)
@pytest.mark.parametrize("rows", BROADCAST_ROWS)
@pytest.mark.parametrize("cols", BROADCAST_COLS)
def test_grad_mask_broadcast(batch, heads, rows, cols, device):
    """The backward's active-tile lists follow every broadcast shape of the mask. (The
    expand() form of the mask is covered by the forward, which builds the same lists.)"""
    dims = BROADCAST_DIMS
    q, k, v = random_qkv(dims, torch.float32, device)
    mask = random_mask(dims.operand_shape(batch, heads, rows, cols), device)
    bias = random_bias(dims.operand_shape("1", "Hk", "1", "Lk"), torch.float32, device)
    run_backward(q, k, v, mask, bias, causal=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_shape", SHARED_BIASES)
def test_bias_grad_low_precision(dtype, bias_shape, device):
    """dbias in fp16/bf16 is summed in fp32 and rounded once, for every kind of sharing."""
    dims = BROADCAST_DIMS
    q, k, v = random_qkv(dims, dtype, device)
    bias = random_bias(dims.operand_shape(*bias_shape), dtype, device)
    run_backward(q, k, v, None, bias, causal=False)


@pytest.mark.parametrize("pattern", EMPTY_PATTERNS)
@pytest.mark.parametrize("causal", CAUSAL)
def test_grad_empty_rows(pattern, causal, device):
    """Rows that see no key have zero dq and contribute nothing; keys no row sees get zero dk,
    dv and dbias. Nothing is NaN."""
    dims = Dims(2, 70, 80, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    mask = random_mask(dims.full_operand_shape("Hk"), device)
    if pattern == "empty_rows":
        mask[:, :, [0, 33, dims.seqlen_q - 1]] = False
    elif pattern == "no_keys":
        mask.zero_()
    else:  # keys 32..63: whole tiles for any tile width up to 32
        mask[..., 32:64] = False
    bias = random_bias(dims.operand_shape("1", "Hq", "Lq", "Lk"), torch.float32, device)
    run = run_backward(q, k, v, mask, bias, causal)

    seen = mask.any(dim=1)  # (B, Lq, Lk) over the single KV head
    if causal:
        rows = torch.arange(dims.seqlen_q, device=device)[:, None]
        cols = torch.arange(dims.seqlen_k, device=device)[None, :]
        seen = seen & (cols <= rows + dims.seqlen_k - dims.seqlen_q)
    empty_rows = ~seen.any(-1)  # (B, Lq)
    unseen_keys = ~seen.any(-2)  # (B, Lk)
    assert empty_rows.any() or unseen_keys.any(), "the pattern was meant to empty something"
    grads = run.grads
    assert (grads.dq[empty_rows] == 0).all()
    assert (grads.dk[unseen_keys] == 0).all() and (grads.dv[unseen_keys] == 0).all()
    assert (grads.dbias[..., ~seen.any(0).any(-2)] == 0).all()


@pytest.mark.parametrize("causal", CAUSAL)
def test_grad_full_and_partial_tiles(causal, device):
    """Masks whose tiles are a mix of all-True (run without reading the mask) and partial ones,
    at lengths that leave partial edge blocks, so full, interior and edge spans all occur."""
    dims = Dims(1, 70, 97, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    rows = torch.arange(dims.seqlen_q, device=device)[:, None]
    cols = torch.arange(dims.seqlen_k, device=device)[None, :]
    mask = random_mask(dims.full_operand_shape("Hk"), device)
    mask |= ((rows // 32 + cols // 32) % 2 == 0)
    bias = random_bias(dims.operand_shape("1", "Hk", "1", "Lk"), torch.float32, device)
    run_backward(q, k, v, mask, bias, causal)


def test_grad_masked_tiles_read_no_keys_or_values(device):
    """Tiles whose mask block is all False are skipped in both backward passes: keys 128..255
    are masked for every row and hold NaN, and no gradient may turn NaN."""
    q, k, v, mask = masked_band_problem(torch.float32, device)
    band = MASKED_BAND
    grad_out = torch.randn(q.shape, device=device)
    clean = grads_of(dmattn_func, q, k, v, mask, None, False, None, grad_out)
    poisoned = grads_of(dmattn_func, q, nan_in_band(k), nan_in_band(v), mask, None, False, None,
                        grad_out)
    assert torch.equal(poisoned.dq, clean.dq)
    assert torch.equal(poisoned.dk[:, band.stop:], clean.dk[:, band.stop:])
    assert torch.equal(poisoned.dv[:, band.stop:], clean.dv[:, band.stop:])
    assert torch.equal(poisoned.dk[:, : band.start], clean.dk[:, : band.start])
    assert torch.equal(poisoned.dv[:, : band.start], clean.dv[:, : band.start])
    assert (clean.dk[:, band] == 0).all() and (clean.dv[:, band] == 0).all()


@pytest.mark.parametrize("layout", QKV_LAYOUTS)
def test_grad_qkv_layouts(layout, device):
    """Non-contiguous inputs and a non-contiguous output gradient."""
    dims = Dims(2, 33, 29, heads_q=4, heads_kv=2, head_dim=40)
    q, k, v = random_qkv(dims, torch.float32, device, layout)
    grad_out = torch.randn(dims.batch, dims.heads_q, dims.seqlen_q, dims.head_dim,
                           device=device).transpose(1, 2)
    bias = random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), torch.float32, device)
    run_backward(q, k, v, None, bias, causal=True, grad_out=grad_out)


@pytest.mark.parametrize("scale", SCALES)
def test_grad_softmax_scale(scale, device):
    dims = Dims(1, 17, 40, heads_q=2, heads_kv=2, head_dim=24)
    q, k, v, mask, bias = random_problem(
        dims, torch.float32, device, mask="BxHqxLqxLk", bias="1x1xLqxLk")
    run_backward(q, k, v, mask, bias, scale=scale)


def test_bias_without_grad_gets_none(device):
    """A bias that does not require grad gets no gradient; q, k and v still do."""
    dims = Dims(1, 17, 33, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    bias = random_bias(dims.operand_shape("1", "Hq", "Lq", "Lk"), torch.float32, device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dmattn_func(q, k, v, attn_bias=bias).sum().backward()
    assert bias.grad is None
    assert all(t.grad is not None for t in (q, k, v))


def test_grads_with_and_without_returned_lse_agree(device):
    """With ``return_lse=True`` the graph has a second, non-differentiable output; the output's
    gradients are the same bits as without it, and the LSE equals the no-grad call's."""
    dims = Dims(1, 17, 33, heads_q=4, heads_kv=2, head_dim=24)
    q, k, v, mask, bias = random_problem(
        dims, torch.float16, device, mask="BxHkxLqxLk", bias="1xHkx1xLk")
    grad_out = torch.randn(q.shape, device=device).to(q.dtype)

    def with_lse(*args, **kwargs):
        out, lse = dmattn_func(*args, return_lse=True, **kwargs)
        assert out.requires_grad and not lse.requires_grad
        assert torch.equal(lse, dmattn_func(*(a.detach() if isinstance(a, torch.Tensor) else a
                                              for a in args), return_lse=True)[1])
        return out

    plain = grads_of(dmattn_func, q, k, v, mask, bias, True, None, grad_out)
    returned = grads_of(with_lse, q, k, v, mask, bias, True, None, grad_out)
    assert all(torch.isfinite(g).all() for _, g in plain.named())
    assert_same_bits(plain, returned)


def test_bias_grad_alone(device):
    """Only the bias requires grad: it still gets the right gradient."""
    dims = Dims(1, 17, 33, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    bias = random_bias(dims.operand_shape("1", "Hq", "Lq", "Lk"), torch.float16, device)
    grad_out = torch.randn(q.shape, device=device).to(q.dtype)
    leaf = bias.clone().requires_grad_()
    (dbias,) = torch.autograd.grad(dmattn_func(q, k, v, attn_bias=leaf), leaf, grad_out)
    ref = grads_of(attention_reference, q.float(), k.float(), v.float(), None, bias.float(),
                   False, None, grad_out.double())
    eager = grads_of(attention_reference, q, k, v, None, bias, False, None, grad_out,
                     upcast=False)
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
    assert_close_to_reference("dbias", dbias, ref.dbias, eager.dbias, torch.float16)


@pytest.mark.parametrize("bias_shape", SHARED_BIASES)
def test_deterministic_grads_are_bitwise_reproducible(bias_shape, device):
    """deterministic=True: two runs give identical bits, GQA with B = 2 and a shared bias."""
    dims = Dims(2, 40, 50, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    mask = random_mask(dims.operand_shape("1", "Hk", "Lq", "Lk"), device)
    bias = random_bias(dims.operand_shape(*bias_shape), torch.float16, device)
    grad_out = torch.randn(q.shape, device=device).to(q.dtype)
    first = run_backward(q, k, v, mask, bias, causal=True, deterministic=True, grad_out=grad_out)
    second = grads_of(dmattn_func, q, k, v, mask, bias, True, None, grad_out, deterministic=True)
    assert_same_bits(first.grads, second)


# -- memory: a broadcast bias never gets an Lq * Lk gradient temporary
# As in test_forward: Lq and Lk are recognizable sizes, and Lk is several times D.
ALLOC_DIMS = Dims(1, 33, 129, heads_q=8, heads_kv=1, head_dim=16)
ALLOC_BIASES = (
    pytest.param(("B", "Hk", "1", "Lk"), id="kv_row"),
    pytest.param(("1", "1", "Lq", "1"), id="q_col"),
)


@pytest.mark.parametrize("bias_shape", ALLOC_BIASES)
@pytest.mark.parametrize("form", OPERAND_FORMS)
def test_backward_allocates_nothing_of_size_lq_lk(bias_shape, form, device):
    """Besides the gradients, the backward may allocate O(B * Hq * Lq) and one fp32
    accumulator of a gradient's size: never an (Lq, Lk) temporary, also not when the bias is
    passed as an expand() view of its broadcast shape."""
    dims = ALLOC_DIMS
    q, k, v = random_qkv(dims, torch.float16, device)
    mask = random_mask(dims.operand_shape("1", "1", "1", "Lk"), device)
    bias = random_bias(dims.operand_shape(*bias_shape), torch.float16, device)
    run = run_backward(q, k, v, mask, bias, causal=True,
                       bias_view=partial(in_form, dims=dims, form=form))
    assert_no_lq_lk_allocation(run.watch, dims)


def test_repeated_calls_with_one_shape(device):
    """Repeats of one shape reuse Triton's compiled kernels; they must not reuse wrong ones.

    Repeats with new data, with views whose pointers lose 16-byte alignment (which Triton
    compiles differently), and with another scale must each match the reference.
    """
    dims = Dims(2, 45, 70, heads_q=4, heads_kv=2, head_dim=40)
    mask = random_mask(dims.operand_shape("B", "Hk", "Lq", "Lk"), device)
    for repeat, scale in enumerate((None, None, None, 0.5)):
        q, k, v = random_qkv(dims, torch.bfloat16, device)
        bias = random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), torch.bfloat16, device)
        if repeat == 2:  # same shapes and strides, pointers off by one element
            q, k, v = (torch.cat([t.flatten(), t.new_zeros(1)])[1:].view(t.shape)
                       for t in (q, k, v))
            assert q.data_ptr() % 16 != 0
        run_backward(q, k, v, mask, bias, causal=True, scale=scale)
