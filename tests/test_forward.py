"""Forward of dmattn_func: output and LSE against the fp64 reference, on awkward shapes.

Each test compares with ``run_forward``, which applies the project's accuracy rule to out and
LSE, checks that rows seeing no key give exactly 0 and -inf, that nothing else is NaN or Inf,
and that every output element was written (fresh allocations are NaN-poisoned).
"""

from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attn_helpers import (AllocationWatch, BROADCAST_BATCH, BROADCAST_COLS, BROADCAST_DIMS,
                          BROADCAST_HEADS, BROADCAST_ROWS, CAUSAL, DTYPES, Dims, HEADS, HEAD_DIMS,
                          LONG_SEQLEN_K, MASKED, OPERAND_FORMS, QKV_LAYOUTS,
                          assert_forward_skips_masked_band, assert_no_lq_lk_allocation,
                          expand_operand, in_form, random_bias, random_mask, random_problem,
                          random_qkv, run_forward)
import kernels
from kernels import attention_reference, dmattn_func, triton_dmattn_func

# -- grids
SEQLENS_Q = (1, 17, 97, 129)
SEQLENS_K = (1, 17, 97, 129)
LONG_SEQLENS_Q = (1, 17)
OPERAND_LAYOUTS = ("permuted", "sliced", "key_strided")
SCALES = (None, 0.3, 0.0, 3.0)
MASK_PATTERNS = ("no_keys", "empty_rows", "empty_heads", "key_band", "tile_checkerboard",
                 "single_key", "full_tiles")


@pytest.mark.parametrize("seqlen_q", SEQLENS_Q)
@pytest.mark.parametrize("seqlen_k", SEQLENS_K)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("masked", MASKED)
@pytest.mark.parametrize("dtype", DTYPES)
def test_lengths(seqlen_q, seqlen_k, causal, masked, dtype, device):
    """Odd and unequal lengths, Lq = 1 (decode), Lq > Lk and Lq < Lk with causal."""
    dims = Dims(1, seqlen_q, seqlen_k, heads_q=2, heads_kv=1, head_dim=40)
    q, k, v = random_qkv(dims, dtype, device)
    mask = random_mask(dims.full_operand_shape("Hk"), device) if masked else None
    bias = random_bias(dims.full_operand_shape("Hk"), dtype, device)
    run = run_forward(q, k, v, mask, bias, causal)
    if causal and seqlen_q > seqlen_k:
        # Bottom-right alignment: the first Lq - Lk rows see no key at all.
        assert torch.isneginf(run.ref_lse[..., : seqlen_q - seqlen_k]).all()


@pytest.mark.slow
@pytest.mark.parametrize("seqlen_q", LONG_SEQLENS_Q)
@pytest.mark.parametrize("causal", CAUSAL)
def test_long_odd_key_length(seqlen_q, causal, device):
    """Lk = 4095 with a (1, 1, 1, Lk) mask and a (1, 1, Lq, Lk) bias of odd key length.
    (Dtypes are covered on shorter keys: the interpreter needs seconds per call here.)"""
    dims = Dims(1, seqlen_q, LONG_SEQLEN_K, heads_q=1, heads_kv=1, head_dim=16)
    q, k, v, mask, bias = random_problem(
        dims, torch.float16, device, mask="1x1x1xLk", bias="1x1xLqxLk", keep=0.5)
    run_forward(q, k, v, mask, bias, causal)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dims(head_dim, dtype, device):
    dims = Dims(1, 33, 65, heads_q=2, heads_kv=1, head_dim=head_dim)
    q, k, v, mask, bias = random_problem(dims, dtype, device, mask="BxHkx1xLk", bias="BxHkxLqxLk")
    run_forward(q, k, v, mask, bias, causal=True)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("causal", CAUSAL)
def test_head_groups(heads, causal, device):
    """MHA, GQA and MQA; the mask is per KV head and the bias per query head."""
    heads_q, heads_kv = heads
    dims = Dims(2, 33, 47, heads_q, heads_kv, head_dim=32)
    q, k, v, mask, bias = random_problem(
        dims, torch.float16, device, mask="BxHkxLqxLk", bias="BxHqxLqxLk")
    run_forward(q, k, v, mask, bias, causal)


def _broadcast_operand(make, batch, heads, rows, cols, form):
    return in_form(make(BROADCAST_DIMS.operand_shape(batch, heads, rows, cols)), BROADCAST_DIMS,
                   form)


@pytest.mark.parametrize("batch", BROADCAST_BATCH)
@pytest.mark.parametrize("heads", BROADCAST_HEADS)
@pytest.mark.parametrize("rows", BROADCAST_ROWS)
@pytest.mark.parametrize("cols", BROADCAST_COLS)
@pytest.mark.parametrize("form", OPERAND_FORMS)
def test_mask_broadcast(batch, heads, rows, cols, form, device):
    q, k, v = random_qkv(BROADCAST_DIMS, torch.float16, device)
    mask = _broadcast_operand(lambda s: random_mask(s, device), batch, heads, rows, cols, form)
    run_forward(q, k, v, mask=mask)


@pytest.mark.parametrize("batch", BROADCAST_BATCH)
@pytest.mark.parametrize("heads", BROADCAST_HEADS)
@pytest.mark.parametrize("rows", BROADCAST_ROWS)
@pytest.mark.parametrize("cols", BROADCAST_COLS)
@pytest.mark.parametrize("form", OPERAND_FORMS)
def test_bias_broadcast(batch, heads, rows, cols, form, device):
    q, k, v = random_qkv(BROADCAST_DIMS, torch.float16, device)
    bias = _broadcast_operand(lambda s: random_bias(s, torch.float16, device),
                              batch, heads, rows, cols, form)
    run_forward(q, k, v, bias=bias)


def _strided_operand(make, dims: Dims, layout: str) -> torch.Tensor:
    """A full-size (B, Hk, Lq, Lk) mask or bias that is a non-contiguous view."""
    b, h, lq, lk = dims.full_operand_shape("Hk")
    if layout == "permuted":
        return make((b, lq, h, lk)).permute(0, 2, 1, 3)
    if layout == "sliced":
        return make((b, h, lq + 2, lk + 5))[:, :, 1:-1, 3:-2]
    if layout == "key_strided":
        return make((b, h, lq, 2 * lk))[..., ::2]
    raise ValueError(layout)


@pytest.mark.parametrize("layout", OPERAND_LAYOUTS)
def test_operand_strides(layout, device):
    """Masks and biases are read through their own strides, whatever they are."""
    dims = Dims(2, 17, 33, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    mask = _strided_operand(lambda s: random_mask(s, device), dims, layout)
    bias = _strided_operand(lambda s: random_bias(s, torch.float16, device), dims, layout)
    run_forward(q, k, v, mask, bias, causal=True)


@pytest.mark.parametrize("layout", QKV_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_layouts(layout, dtype, device):
    """Non-contiguous query/key/value: (B, H, L, D) transposed, sliced and strided head dims."""
    dims = Dims(2, 47, 33, heads_q=4, heads_kv=2, head_dim=40)
    q, k, v = random_qkv(dims, dtype, device, layout)
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    mask = random_mask(dims.operand_shape("B", "Hk", "1", "Lk"), device)
    bias = random_bias(dims.operand_shape("1", "Hq", "Lq", "Lk"), dtype, device)
    run_forward(q, k, v, mask, bias, causal=True)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_scale(scale, dtype, device):
    dims = Dims(1, 17, 40, heads_q=2, heads_kv=2, head_dim=24)
    q, k, v, mask, bias = random_problem(dims, dtype, device, mask="BxHqxLqxLk", bias="1x1xLqxLk")
    run_forward(q, k, v, mask, bias, scale=scale)


def test_default_scale_is_inverse_sqrt_head_dim(device):
    dims = Dims(1, 17, 40, heads_q=2, heads_kv=1, head_dim=40)
    q, k, v = random_qkv(dims, torch.float32, device)
    default = dmattn_func(q, k, v, softmax_scale=None)
    explicit = dmattn_func(q, k, v, softmax_scale=1.0 / math.sqrt(dims.head_dim))
    other = dmattn_func(q, k, v, softmax_scale=1.0)
    assert torch.equal(default, explicit)
    assert not torch.allclose(default, other)


def test_zero_scale_averages_visible_values(device):
    """softmax_scale=0.0 is honored: with no bias every visible key has the same weight.
    Checked against a plain mean, independently of the reference."""
    dims = Dims(1, 9, 21, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    mask = random_mask(dims.operand_shape("1", "1", "Lq", "Lk"), device)
    mask[..., 0] = True  # no empty rows: a plain mean is undefined there
    out = dmattn_func(q, k, v, mask, softmax_scale=0.0)
    weights = mask[0, 0].to(torch.float32)
    weights = weights / weights.sum(-1, keepdim=True)  # (Lq, Lk)
    expected = torch.einsum("mn,nd->md", weights, v[0, :, 0])
    for h in range(dims.heads_q):
        torch.testing.assert_close(out[0, :, h], expected, atol=1e-6, rtol=1e-5)


def test_large_scores(device):
    """Scores in the thousands: the online softmax must rescale, not overflow."""
    dims = Dims(1, 40, 70, heads_q=2, heads_kv=1, head_dim=32)
    q, k, v = random_qkv(dims, torch.float32, device)
    bias = 500.0 * torch.randn(dims.operand_shape("1", "1", "Lq", "Lk"), device=device)
    run_forward(30.0 * q, k, v, bias=bias, causal=True)


def _pattern_mask(pattern: str, dims: Dims, device) -> torch.Tensor:
    """(B, Hk, Lq, Lk) masks with rows, heads and whole 32- and 64-key tiles switched off."""
    b, h, lq, lk = dims.full_operand_shape("Hk")
    mask = random_mask((b, h, lq, lk), device)
    rows = torch.arange(lq, device=device)[:, None]
    cols = torch.arange(lk, device=device)[None, :]
    if pattern == "no_keys":
        mask.zero_()
    elif pattern == "empty_rows":
        mask[:, :, [0, 5, lq - 1]] = False
    elif pattern == "empty_heads":
        mask[0, 1] = False
    elif pattern == "key_band":
        mask &= (cols < 64) | (cols >= 128)
    elif pattern == "tile_checkerboard":
        mask &= ((rows // 32 + cols // 32) % 2 == 0)
    elif pattern == "single_key":
        mask = (cols == (rows * 7) % lk).expand(b, h, lq, lk)
    elif pattern == "full_tiles":
        # Whole 32x32 blocks all True (full tiles for every kernel tile size up to 32, read
        # without the mask), the others random (partial tiles): both kinds in one row's list.
        mask |= ((rows // 32 + cols // 32) % 2 == 0)
    else:
        raise ValueError(pattern)
    return mask


@pytest.mark.parametrize("pattern", MASK_PATTERNS)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mask_patterns(pattern, causal, dtype, device):
    """Fully masked rows, heads and tiles: output 0, LSE -inf, never NaN."""
    dims = Dims(1, 40, 150, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, dtype, device)
    mask = _pattern_mask(pattern, dims, device)
    bias = random_bias(dims.operand_shape("B", "Hq", "1", "Lk"), dtype, device)
    run = run_forward(q, k, v, mask, bias, causal)
    if pattern in ("no_keys", "empty_rows", "empty_heads"):
        assert torch.isneginf(run.ref_lse).any(), "the pattern was meant to leave rows empty"


def test_masked_tiles_read_no_keys_or_values(device):
    """A tile whose mask block is all False does no K/V loads (the sparsity rule). Keys 128..255
    are masked for every row, so any tile size up to 128 sees only False there, and those keys
    and values are NaN: loading and multiplying them by a zero probability would give NaN."""
    assert_forward_skips_masked_band(device)


def test_triton_dmattn_func_is_a_drop_in(device):
    """Same first seven parameters as flash-dmattn's triton_dmattn_func, same results."""
    names = list(inspect.signature(triton_dmattn_func).parameters)[:7]
    assert names == ["query", "key", "value", "attn_mask", "attn_bias", "is_causal",
                     "softmax_scale"]
    dims = Dims(2, 17, 33, heads_q=4, heads_kv=2, head_dim=40)
    q, k, v, mask, bias = random_problem(
        dims, torch.float16, device, mask="BxHkx1xLk", bias="BxHkxLqxLk")
    run = run_forward(q, k, v, mask, bias, True, 0.2, func=triton_dmattn_func)
    out, lse = dmattn_func(q, k, v, mask, bias, True, 0.2, return_lse=True)
    assert torch.equal(run.out, out) and torch.equal(run.lse, lse)


def test_return_lse_false_returns_only_the_output(device):
    dims = Dims(1, 17, 33, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    out = dmattn_func(q, k, v)
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, dmattn_func(q, k, v, return_lse=True)[0])


# -- memory: no copy of mask or bias, nothing of size Lq * Lk
# Lq and Lk differ from every other size, so an (Lq, Lk)-shaped temporary is recognizable, and
# Lk is several times D (see assert_no_lq_lk_allocation for the byte limit).
ALLOC_DIMS = Dims(1, 33, 129, heads_q=8, heads_kv=1, head_dim=16)
ALLOC_OPERANDS = (  # (mask shape, bias shape), symbolic
    pytest.param((("1", "1", "1", "Lk"), ("1", "1", "Lq", "1")), id="kv_row-q_col"),
    pytest.param((("1", "Hk", "Lq", "Lk"), ("B", "Hq", "1", "Lk")), id="kv_full-q_row"),
    pytest.param((("1", "1", "1", "1"), ("1", "1", "Lq", "Lk")), id="scalar-shared"),
)


@pytest.mark.parametrize("operands", ALLOC_OPERANDS)
@pytest.mark.parametrize("form", OPERAND_FORMS)
def test_forward_allocates_nothing_of_size_lq_lk(operands, form, device):
    """No (Lq, Lk)-shaped temporary and nothing near a score matrix's size. (``run_forward``
    also fails on any op that copies, pads or casts the mask or the bias.)"""
    mask_shape, bias_shape = operands
    dims = ALLOC_DIMS
    q, k, v = random_qkv(dims, torch.float16, device)
    mask = in_form(random_mask(dims.operand_shape(*mask_shape), device), dims, form)
    bias = in_form(random_bias(dims.operand_shape(*bias_shape), torch.float16, device), dims, form)
    run = run_forward(q, k, v, mask, bias, causal=True)
    assert_no_lq_lk_allocation(run.watch, dims)


def test_allocation_checks_can_fail():
    """The watch is not blind: it flags an expand().contiguous() of the mask as an (Lq, Lk)
    temporary and as a copy, a padded bias as a copy and a gather that widens it too, a
    flattened fp16 score matrix by its size, and it poisons fresh allocations. A gather of the
    bias in a key order is a reordering, not a copy."""
    dims = ALLOC_DIMS
    mask = random_mask(dims.operand_shape("1", "1", "1", "Lk"), "cpu")
    bias = random_bias(dims.operand_shape("1", "1", "1", "Lk"), torch.float16, "cpu")
    with AllocationWatch(watched=(mask, bias)) as watch:
        expand_operand(mask, dims).contiguous()
        F.pad(bias, (0, 15))
        order = torch.randperm(bias.shape[-1]).expand(bias.shape)
        torch.gather(bias, -1, order)
        torch.gather(bias, -1, torch.cat((order, order), -1))
        fresh = torch.empty(4)
    with pytest.raises(AssertionError, match="shaped"):
        assert_no_lq_lk_allocation(watch, dims)
    assert len(watch.copies) == 3, watch.copies
    assert watch.reorders == [f"aten.gather.default -> {tuple(bias.shape)}"], watch.reorders
    assert torch.isnan(fresh).all()

    scores = dims.batch * dims.heads_q * dims.seqlen_q * dims.seqlen_k
    with AllocationWatch() as watch:
        torch.empty(scores, dtype=torch.float16)
    with pytest.raises(AssertionError, match="largest"):
        assert_no_lq_lk_allocation(watch, dims)


# -- 64-bit offsets, in a subprocess: a 32-bit offset overflow reads wild memory and may crash
LARGE_OFFSET_SCRIPT = """
import sys
import torch
from kernels import attention_reference, dmattn_func
device = sys.argv[1]
torch.manual_seed(0)
stride = 2**30  # fits int32; row or head 2 then starts at element 2**31
lq, lk, heads = 3, 33, 3
q = torch.randn(1, lq, heads, 16, device=device, dtype=torch.float16, requires_grad=True)
k = torch.randn(1, lk, heads, 16, device=device, dtype=torch.float16, requires_grad=True)
v = torch.randn(1, lk, heads, 16, device=device, dtype=torch.float16, requires_grad=True)
small_mask = torch.rand(1, 1, lq, lk, device=device) < 0.6
small_mask[..., 0] = True
small_bias = torch.randn(1, heads, 1, lk, device=device).half()
# Untouched pages of these storages are never committed on CPU.
mask = torch.empty(2 * stride + lk, dtype=torch.bool, device=device).as_strided(
    (1, 1, lq, lk), (0, 0, stride, 1))
bias = torch.empty(2 * stride + lk, dtype=torch.float16, device=device).as_strided(
    (1, heads, 1, lk), (0, stride, 0, 1))
mask.copy_(small_mask)
bias.copy_(small_bias)
bias.requires_grad_()
out = dmattn_func(q, k, v, mask, bias)
grads = torch.autograd.grad(out.float().square().sum(), (q, k, v, bias))
leaves = [t.detach().float().requires_grad_() for t in (q, k, v, small_bias)]
ref = attention_reference(*leaves[:3], small_mask, leaves[3])
ref_grads = torch.autograd.grad(ref.square().sum(), leaves)
errors = [(out.double() - ref).abs().max().item()]
errors += [(g.double() - r.double()).abs().max().item() for g, r in zip(grads, ref_grads)]
print("max errors", errors)
sys.exit(0 if max(errors) < 2e-2 else 1)
"""


@pytest.mark.slow
def test_offsets_past_2_31_elements(device):
    """Mask rows and bias heads that start at element 2**31 (offsets past 2**31 need 64-bit arithmetic), forward and
    backward. The storages are 2 and 4 GiB of address space, of which a few pages are used."""
    env = dict(os.environ)
    root = str(Path(kernels.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", LARGE_OFFSET_SCRIPT, str(device)], env=env,
                            capture_output=True, text=True, timeout=600)
    code = result.returncode  # negative: killed by that signal (-11: segfault)
    assert code == 0, f"exit code {code}\n{result.stdout}\n{result.stderr[-3000:]}"


# -- the reference itself, against an independent formulation
@pytest.mark.parametrize("causal", CAUSAL)
def test_reference_matches_sdpa(causal, device):
    """The fp64 reference agrees with PyTorch's SDPA given the bottom-right causal rule
    written out by hand, a boolean mask and an additive bias (no empty rows, which SDPA turns
    into NaN)."""
    dims = Dims(2, 13, 29, heads_q=4, heads_kv=2, head_dim=24)
    q, k, v = random_qkv(dims, torch.float32, device)
    mask = random_mask(dims.full_operand_shape("Hq"), device)
    mask[..., 0] = True
    bias = random_bias(dims.operand_shape("1", "Hq", "Lq", "Lk"), torch.float32, device)
    keep = mask
    if causal:
        rows = torch.arange(dims.seqlen_q, device=device)[:, None]
        cols = torch.arange(dims.seqlen_k, device=device)[None, :]
        keep = keep & (cols <= rows + dims.seqlen_k - dims.seqlen_q)
    float_mask = bias.double().masked_fill(~keep, -math.inf)
    group = dims.heads_q // dims.heads_kv
    expected = F.scaled_dot_product_attention(
        q.double().transpose(1, 2),
        k.double().transpose(1, 2).repeat_interleave(group, 1),
        v.double().transpose(1, 2).repeat_interleave(group, 1),
        attn_mask=float_mask, scale=0.7,
    ).transpose(1, 2)
    out = attention_reference(q, k, v, mask, bias, causal, 0.7)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)
