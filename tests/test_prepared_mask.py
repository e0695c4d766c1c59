"""prepare_mask: a mask's tile lists built once and walked by later calls.

A prepared call must give bit-for-bit the unprepared call's outputs and gradients, must not read
the mask to find tiles again, and must refuse a call or a mask it was not prepared for.
"""

from __future__ import annotations

import pytest
import torch

import kernels.planning.activity
import kernels.planning.forward
from kernels import PreparedMask, dmattn_func, prepare_mask

from attn_helpers import (CAUSAL, Dims, assert_forward_skips_masked_band, grads_of, random_bias,
                          random_mask, random_problem, random_qkv, run_backward, run_forward)

CASES = (  # dims, mask shape, bias shape
    pytest.param(Dims(2, 37, 53, heads_q=4, heads_kv=2, head_dim=16), "BxHkxLqxLk", "BxHkx1xLk",
                 id="gqa-kv_mask"),
    pytest.param(Dims(1, 53, 37, heads_q=2, heads_kv=2, head_dim=40), "1x1xLqxLk", "1x1xLqxLk",
                 id="lq_gt_lk-shared"),
    pytest.param(Dims(2, 17, 97, heads_q=4, heads_kv=1, head_dim=16), "Bx1x1xLk", "BxHqxLqxLk",
                 id="mqa-key_row"),
    pytest.param(Dims(1, 1, 97, heads_q=4, heads_kv=2, head_dim=16), "1xHkxLqxLk", "1xHkx1xLk",
                 id="decode"),
)


def with_prepared(prepared: PreparedMask):
    """dmattn_func's signature, calling with ``prepared`` in place of its (same) mask."""
    def call(q, k, v, mask, bias, causal, scale, **kwargs):
        assert mask is prepared.mask
        return dmattn_func(q, k, v, prepared, bias, causal, scale, **kwargs)
    return call


@pytest.fixture
def no_mask_pass(monkeypatch):
    """Fails the test if a call reads the mask to build an activity map or compacts a list."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a prepared call built an activity map or tile list")

    def forbid():
        monkeypatch.setattr(kernels.planning.forward, "tile_activity", forbidden)
        monkeypatch.setattr(kernels.planning.activity, "lists_from_activity", forbidden)
    return forbid


@pytest.mark.parametrize("dims, mask_shape, bias_shape", CASES)
@pytest.mark.parametrize("causal", CAUSAL)
def test_prepared_forward_matches_reference_and_unprepared(dims, mask_shape, bias_shape, causal,
                                                           no_mask_pass, device):
    q, k, v, mask, bias = random_problem(dims, torch.float16, device, mask_shape, bias_shape)
    plain_out, plain_lse = dmattn_func(q, k, v, mask, bias, causal, return_lse=True)
    prepared = prepare_mask(mask, q, k, causal)
    no_mask_pass()
    run = run_forward(q, k, v, mask, bias, causal, func=with_prepared(prepared))
    assert torch.equal(run.out, plain_out) and torch.equal(run.lse, plain_lse)


@pytest.mark.parametrize("dims, mask_shape, bias_shape", CASES)
@pytest.mark.parametrize("causal", CAUSAL)
def test_prepared_backward_matches_reference_and_unprepared(dims, mask_shape, bias_shape, causal,
                                                            no_mask_pass, device):
    q, k, v, mask, bias = random_problem(dims, torch.float16, device, mask_shape, bias_shape)
    grad_out = torch.randn(q.shape, device=device).to(q.dtype)
    plain = grads_of(dmattn_func, q, k, v, mask, bias, causal, None, grad_out)
    prepared = prepare_mask(mask, q, k, causal)
    no_mask_pass()
    run = run_backward(q, k, v, mask, bias, causal, grad_out=grad_out,
                       func=with_prepared(prepared))
    for (name, got), (_, want) in zip(run.grads.named(), plain.named()):
        assert torch.equal(got, want), name


def test_one_prepared_mask_serves_many_calls(no_mask_pass, device):
    """New query, key, value and bias values on every call, as in the layers of a model."""
    dims = Dims(2, 37, 53, heads_q=4, heads_kv=2, head_dim=16)
    mask = random_mask(dims.operand_shape("B", "Hk", "Lq", "Lk"), device, keep=0.3)
    q, k, _ = random_qkv(dims, torch.bfloat16, device)
    prepared = prepare_mask(mask, q, k, is_causal=True)
    no_mask_pass()
    for _ in range(3):
        q, k, v = random_qkv(dims, torch.bfloat16, device)
        bias = random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), torch.bfloat16, device)
        run_backward(q, k, v, mask, bias, True, func=with_prepared(prepared))


def test_prepared_masked_tiles_read_no_keys_or_values(device):
    """The sparsity rule (an all-masked tile reads no K or V) holds on the prepared path (NaN
    keys in an all-masked band)."""
    assert_forward_skips_masked_band(device, prepare_mask)


# -- what a prepared mask refuses
DIMS = Dims(1, 17, 33, heads_q=2, heads_kv=1, head_dim=16)


def _prepared(device, causal=False):
    """A prepared key-row mask: it broadcasts over queries, so a call with another query
    length passes the mask's own shape check and must be refused for the prepared lists."""
    q, k, v = random_qkv(DIMS, torch.float16, device)
    mask = random_mask(DIMS.operand_shape("1", "1", "1", "Lk"), device)
    return q, k, v, mask, prepare_mask(mask, q, k, causal)


@pytest.mark.parametrize("change, words", [
    pytest.param("seqlen_q", "shapes", id="shape"),
    pytest.param("dtype", "dtype torch.float16", id="dtype"),
    pytest.param("is_causal", "is_causal", id="causal"),
])
def test_a_call_it_was_not_prepared_for_is_refused(change, words, device):
    q, k, v, _, prepared = _prepared(device)
    causal = False
    if change == "seqlen_q":
        q = q[:, :-1]
    elif change == "dtype":
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    else:
        causal = True
    with pytest.raises(ValueError, match=f"attn_mask: the mask was prepared for {words}"):
        dmattn_func(q, k, v, prepared, is_causal=causal)


def test_a_mask_written_after_preparing_is_refused(device):
    q, k, v, mask, prepared = _prepared(device)
    mask[0, 0, 0, :] = False
    with pytest.raises(ValueError, match="attn_mask: the mask was written in place"):
        dmattn_func(q, k, v, prepared)


def test_prepare_mask_checks_its_inputs(device):
    q, k, v = random_qkv(DIMS, torch.float16, device)
    with pytest.raises(TypeError,
                       match="attn_mask must be a bool torch.Tensor or KeyIntervals to prepare"):
        prepare_mask(None, q, k)
    with pytest.raises(TypeError, match="attn_mask"):
        prepare_mask(torch.ones(1, 1, 17, 33, device=device), q, k)
    with pytest.raises(ValueError, match="attn_mask"):
        prepare_mask(torch.ones(1, 1, 17, 32, dtype=torch.bool, device=device), q, k)


def test_prepared_mask_is_not_copied(device):
    _, _, _, mask, prepared = _prepared(device)
    assert prepared.mask is mask
