"""Varlen (packed) attention.

The packed batch runs as one problem whose mask is a KeyIntervals in packed row coordinates.
That construction is checked with the eager reference: run over the packed batch with the packed
intervals, it must equal the reference run sequence by sequence (out, LSE and the gradients of
query, key, value and bias). Then ``dmattn_varlen_func`` itself, through the Triton kernels,
is checked against the same per-sequence reference.
"""

from __future__ import annotations

import pytest
import torch

from kernels import (KeyIntervals, attention_reference, attention_varlen_reference,
                     dmattn_varlen_func)
from kernels import topk_intervals
from kernels.masks.packed_seqlens import check_cu_seqlens
from kernels.tolerance import check_tensor
from kernels.varlen import packed_intervals, varlen_call

# Sequences (Lq_s, Lk_s): lengths 0 and 1, Lq_s above and below Lk_s, totals not multiples
# of 16.
PACKED = (
    pytest.param(((5, 5), (0, 3), (1, 1), (7, 2), (3, 9), (4, 0), (1, 6)), id="mixed"),
    pytest.param(((17, 33),), id="one"),
    pytest.param(((1, 5), (1, 1), (1, 9), (0, 0), (1, 2)), id="decode"),
)
CAUSAL = (pytest.param(False, id="full"), pytest.param(True, id="causal"))
HEADS_Q, HEADS_KV, HEAD_DIM = 4, 2, 16
OPERAND_HEADS = (pytest.param(None, id="none"), pytest.param(1, id="1"),
                 pytest.param(HEADS_KV, id="Hk"), pytest.param(HEADS_Q, id="Hq"))
# The kernel tests' dtypes; each one's tolerance comes from kernels.tolerance.
KERNEL_DTYPES = (pytest.param(torch.float16, id="fp16"), pytest.param(torch.float32, id="fp32"))


def offsets(lengths) -> tuple[torch.Tensor, torch.Tensor]:
    cu_q = torch.tensor([0] + [q for q, _ in lengths]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [k for _, k in lengths]).cumsum(0).to(torch.int32)
    return cu_q, cu_k


def packed_problem(lengths, dtype, device, mask_heads=None, bias_heads=None):
    """Packed q, k, v, cu_seqlens, max_seqlens, KeyIntervals (1, Hm, total_k) in each
    sequence's own rows (or None) and a bias (Hb, total_k) (or None)."""
    cu_q, cu_k = offsets(lengths)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(total_q, HEADS_Q, HEAD_DIM, device=device).to(dtype)
    k = torch.randn(total_k, HEADS_KV, HEAD_DIM, device=device).to(dtype)
    v = torch.randn(total_k, HEADS_KV, HEAD_DIM, device=device).to(dtype)
    mask = bias = None
    if mask_heads is not None:
        longest = max(q for q, _ in lengths)
        start = torch.randint(-2, longest + 1, (1, mask_heads, total_k), device=device)
        end = start + torch.randint(0, longest + 2, (1, mask_heads, total_k), device=device)
        mask = KeyIntervals(start, end)
    if bias_heads is not None:
        bias = (2 * torch.randn(bias_heads, total_k, device=device)).to(dtype)
    max_q = max(q for q, _ in lengths)
    max_k = max(k for _, k in lengths)
    return (q, k, v, cu_q.to(device), cu_k.to(device), max_q, max_k), mask, bias


def seen_by_definition(lengths, is_causal, mask) -> torch.Tensor:
    """(Hm or 1, total_q, total_k) bool: packed row r sees packed key p iff both are in one
    sequence s, p's local index is visible to r's local row, and the caller's interval of p
    holds r's local row."""
    cu_q, cu_k = offsets(lengths)
    heads = 1 if mask is None else mask.shape[1]
    seen = torch.zeros(heads, int(cu_q[-1]), int(cu_k[-1]), dtype=torch.bool)
    for s, (seqlen_q, seqlen_k) in enumerate(lengths):
        q0, k0 = int(cu_q[s]), int(cu_k[s])
        for i in range(seqlen_q):
            for j in range(seqlen_k):
                if is_causal and j > i + seqlen_k - seqlen_q:
                    continue
                for h in range(heads):
                    inside = mask is None or (
                        int(mask.start[0, h, k0 + j]) <= i < int(mask.end[0, h, k0 + j]))
                    seen[h, q0 + i, k0 + j] = inside
    return seen


# -- the packed intervals
@pytest.mark.parametrize("lengths", PACKED)
@pytest.mark.parametrize("is_causal", CAUSAL)
@pytest.mark.parametrize("mask_heads", (None, 1, 3))
def test_packed_intervals_follow_the_definition(lengths, is_causal, mask_heads):
    (_, _, _, cu_q, cu_k, _, _), mask, _ = packed_problem(lengths, torch.float32, "cpu",
                                                          mask_heads=mask_heads)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    intervals = packed_intervals(cu_q, cu_k, total_k, is_causal, mask)
    assert intervals.shape == (1, mask_heads or 1, total_k)
    assert intervals.start.dtype == torch.int32
    expected = seen_by_definition(lengths, is_causal, mask)
    assert torch.equal(intervals.to_dense(total_q)[0], expected)


def test_packed_intervals_of_a_broadcast_mask_stay_in_bounds():
    lengths = ((3, 4), (2, 2))
    cu_q, cu_k = offsets(lengths)
    huge = 2**40
    start = torch.tensor([[[-huge, 1, 5, huge, -huge, 0]]])
    end = torch.tensor([[[huge, 2, huge, huge, -1, huge]]])
    intervals = packed_intervals(cu_q, cu_k, 6, False, KeyIntervals(start, end))
    assert intervals.start.min() >= 0 and intervals.end.max() <= int(cu_q[-1])
    expected = seen_by_definition(lengths, False, KeyIntervals(start, end))
    assert torch.equal(intervals.to_dense(int(cu_q[-1]))[0], expected)


# -- the packed call equals the per-sequence reference (eager, float64 compute)
def run_packed(attention, problem, mask, bias, is_causal, **options):
    return varlen_call(attention, *problem, attn_mask=mask, attn_bias=bias,
                       is_causal=is_causal, return_lse=True, **options)


def gradients(out, leaves, grad_out):
    return torch.autograd.grad(out, leaves, grad_out.to(out.dtype))


@pytest.mark.parametrize("lengths", PACKED)
@pytest.mark.parametrize("is_causal", CAUSAL)
@pytest.mark.parametrize("mask_heads", OPERAND_HEADS)
@pytest.mark.parametrize("bias_heads", OPERAND_HEADS)
def test_packed_reference_equals_each_sequence(lengths, is_causal, mask_heads, bias_heads):
    problem, mask, bias = packed_problem(lengths, torch.float32, "cpu", mask_heads, bias_heads)
    q, k, v = (t.requires_grad_() for t in problem[:3])
    leaves = [q, k, v] + ([bias.requires_grad_()] if bias is not None else [])
    out, lse = run_packed(attention_reference, problem, mask, bias, is_causal, upcast=True)
    ref_out, ref_lse = attention_varlen_reference(
        q, k, v, problem[3], problem[4], attn_mask=mask, attn_bias=bias, is_causal=is_causal,
        return_lse=True)
    assert out.shape == q.shape and lse.shape == (HEADS_Q, q.shape[0])
    assert out.dtype == lse.dtype == torch.float64
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)  # -inf rows match too
    grad_out = torch.randn_like(out)
    for name, got, want in zip(("dq", "dk", "dv", "dbias"), gradients(out, leaves, grad_out),
                               gradients(ref_out, leaves, grad_out)):
        # float64 gradients rounded to the inputs' float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)


def test_topk_intervals_serve_as_the_varlen_mask():
    lengths = PACKED[0].values[0]
    problem, _, _ = packed_problem(lengths, torch.float32, "cpu")
    cu_q, cu_k = problem[3], problem[4]
    bias = torch.randn(HEADS_KV, int(cu_k[-1]))
    mask = topk_intervals(bias, 2, is_causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = run_packed(attention_reference, problem, mask, bias, True, upcast=True)
    ref_out, ref_lse = attention_varlen_reference(*problem[:5], attn_mask=mask, attn_bias=bias,
                                                  is_causal=True, return_lse=True)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    # Every row of the first sequence (5 rows, 5 keys, causal) sees key 0 at least.
    assert torch.isfinite(lse[:, :5]).all()


# -- bad input
def test_rejects_bad_input():
    (q, k, v, cu_q, cu_k, max_q, max_k), _, bias = packed_problem(
        ((3, 4), (2, 5)), torch.float32, "cpu", bias_heads=1)
    good = dict(query=q, key=k, value=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                max_seqlen_q=max_q, max_seqlen_k=max_k)
    mask = KeyIntervals(torch.zeros(1, 2, 9, dtype=torch.int32),
                        torch.ones(1, 2, 9, dtype=torch.int32))
    cases = [
        (dict(query=q[None]), ValueError, r"query must be 3-D \(total, heads, head_dim\)"),
        (dict(key=k.tolist()), TypeError, "key must be a torch.Tensor"),
        (dict(value=v[:, :, None]), ValueError, "value must be 3-D"),
        (dict(cu_seqlens_q=cu_q.long()), TypeError, "cu_seqlens_q dtype must be torch.int32"),
        (dict(cu_seqlens_k=cu_k[:1]), ValueError, "cu_seqlens_k must be 1-D with n"),
        (dict(cu_seqlens_q=cu_q + 1), ValueError, "cu_seqlens_q must start at 0"),
        (dict(cu_seqlens_k=torch.tensor([0, 6, 4, 9], dtype=torch.int32)), ValueError,
         "cu_seqlens_k must be non-decreasing"),
        (dict(cu_seqlens_k=torch.tensor([0, 4, 8], dtype=torch.int32)), ValueError,
         "cu_seqlens_k must end at the packed length 9"),
        (dict(cu_seqlens_q=torch.tensor([0, 1, 2, 5], dtype=torch.int32)), ValueError,
         "cu_seqlens_q and cu_seqlens_k must describe the same number"),
        (dict(max_seqlen_q=2), ValueError, "cu_seqlens_q: a sequence is longer than "
                                           "max_seqlen=2"),
        (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be a non-negative int"),
        (dict(max_seqlen_k=5.0), ValueError, "max_seqlen_k must be a non-negative int"),
        (dict(cu_seqlens_k=cu_k.to("meta")), ValueError, "cu_seqlens_k must be on query's"),
        (dict(attn_mask=torch.ones(1, 3, 5, 9, dtype=torch.bool)), TypeError,
         "attn_mask must be KeyIntervals or None"),
        (dict(attn_mask=KeyIntervals(mask.start[..., :8], mask.end[..., :8])), ValueError,
         r"attn_mask.start dimension 2 \(seqlen_k\) must be 9"),
        (dict(attn_mask=KeyIntervals(mask.start[:, :1].expand(1, 3, 9),
                                     mask.end[:, :1].expand(1, 3, 9))),
         ValueError, r"attn_mask.start dimension 1 \(heads\)"),
        (dict(attn_bias=bias[None]), ValueError, r"attn_bias must be per key, \(heads, total_k\)"),
        (dict(attn_bias=bias[:, :8]), ValueError, "total_k = 9"),
        (dict(attn_bias=bias.expand(3, 9)), ValueError, r"heads in \[1, 2, 4\]"),
        (dict(attn_bias=bias.tolist()), TypeError, "attn_bias must be a torch.Tensor"),
        (dict(query=q[:0], cu_seqlens_q=torch.zeros(3, dtype=torch.int32)), ValueError,
         "total_q = 0"),
    ]
    for change, error, message in cases:
        with pytest.raises(error, match=message):
            varlen_call(attention_reference, **{**good, **change})


def test_offsets_check_reads_the_device_once():
    cu = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    check_cu_seqlens("cu_seqlens_q", cu, 7, "cpu", max_seqlen=5)
    with pytest.raises(ValueError, match="longest 5"):
        check_cu_seqlens("cu_seqlens_q", cu, 7, "cpu", max_seqlen=4)


def test_packed_mask_is_built_once_per_offsets(monkeypatch):
    """A model's layers call with the same offsets: the first call checks them and builds the
    packed mask, the others reuse it. Writing into the offsets makes them new (checked again)."""
    import kernels.varlen as varlen
    problem, _, _ = packed_problem(PACKED[0].values[0], torch.float32, "cpu")
    q, k, v, cu_q, cu_k, max_q, max_k = problem
    built = []
    real = varlen.packed_intervals
    monkeypatch.setattr(varlen, "packed_intervals",
                        lambda *args, **kw: built.append(1) or real(*args, **kw))
    monkeypatch.setattr(varlen, "_packed_masks", type(varlen._packed_masks)())

    def run(cu_q, cu_k, is_causal):
        return varlen_call(attention_reference, q, k, v, cu_q, cu_k, max_q, max_k,
                           is_causal=is_causal)

    outs = [run(cu_q, cu_k, True) for _ in range(3)]
    assert len(built) == 1 and all(torch.equal(outs[0], o) for o in outs)
    run(cu_q, cu_k, False)  # another mask
    run(cu_q.clone(), cu_k, True)  # other offsets
    assert len(built) == 3
    cu_k[1] = 9  # past the second offset (8): checked again, and refused
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        run(cu_q, cu_k, True)


@pytest.mark.parametrize("lengths,within", [
    (((2, 5), (3, 0)), False),  # sequence 0's row 0 sees packed key 3, past the packed lead 0
    (((5, 5), (0, 3), (2, 2)), True),  # every sequence's keys lead by at most the total, 3
    (((5, 5), (3, 3), (2, 2)), True),  # equal offsets: each causal is the packed causal
    (((17, 33),), True),  # one sequence: its causality is the packed problem's
    (((1, 4), (3, 2)), False),  # sequence 0's row 0 sees packed key 3, past the packed lead 2
    (((3, 2), (1, 4)), True),
])
def test_packed_call_is_causal_where_each_sequences_causality_implies_it(lengths, within):
    """The packed call passes ``is_causal=True`` to the kernels only where that removes no
    pair a sequence's own causality keeps; either way it equals the reference run sequence by
    sequence (``test_packed_reference_equals_each_sequence``)."""
    problem, _, _ = packed_problem(lengths, torch.float32, "cpu")
    q, k, v, cu_q, cu_k, max_q, max_k = problem
    flags = []

    def spy(*args, is_causal, **options):
        flags.append(is_causal)
        return attention_reference(*args, is_causal=is_causal, **options)

    out = varlen_call(spy, q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True)
    varlen_call(spy, q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False)
    assert flags == [within, False]
    # Within the packed causality every kept pair stays: the causal call equals the other.
    want = attention_varlen_reference(q, k, v, cu_q, cu_k, is_causal=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    if cu_q.tolist() == cu_k.tolist():
        flags.clear()
        varlen_call(spy, q, k, v, cu_q, cu_q, max_q, max_q, is_causal=True)
        assert flags == [True]


# -- dmattn_varlen_func through the Triton kernels
def kernel_problem(dtype, device):
    lengths = PACKED[0].values[0]
    return packed_problem(lengths, dtype, device, mask_heads=HEADS_KV, bias_heads=HEADS_Q)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("is_causal", CAUSAL)
def test_varlen_forward_matches_the_reference(dtype, is_causal, device):
    problem, mask, bias = kernel_problem(dtype, device)
    q, k, v, cu_q, cu_k, max_q, max_k = problem
    out, lse = dmattn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, attn_mask=mask,
                                  attn_bias=bias, is_causal=is_causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (HEADS_Q, q.shape[0]) and lse.dtype == torch.float32
    ref = attention_varlen_reference(q, k, v, cu_q, cu_k, attn_mask=mask, attn_bias=bias,
                                     is_causal=is_causal, return_lse=True)
    eager = attention_varlen_reference(q, k, v, cu_q, cu_k, attn_mask=mask, attn_bias=bias,
                                       is_causal=is_causal, return_lse=True, upcast=False)
    for name, got, want, low in zip(("out", "lse"), (out, lse), ref, eager):
        check = check_tensor(name, got, want, low, dtype)
        assert check.passed, check.describe()
    empty = torch.isneginf(ref[1])
    assert torch.isneginf(lse[empty]).all() and (out.transpose(0, 1)[empty] == 0).all()


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("is_causal", CAUSAL)
def test_varlen_backward_matches_the_reference(dtype, is_causal, device):
    problem, mask, bias = kernel_problem(dtype, device)
    q, k, v, cu_q, cu_k, max_q, max_k = problem
    leaves = [t.requires_grad_() for t in (q, k, v, bias)]
    grad_out = torch.randn_like(q, dtype=torch.float32)
    out = dmattn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, attn_mask=mask, attn_bias=bias,
                             is_causal=is_causal)
    got = gradients(out, leaves, grad_out)
    runs = [attention_varlen_reference(q, k, v, cu_q, cu_k, attn_mask=mask, attn_bias=bias,
                                       is_causal=is_causal, upcast=upcast)
            for upcast in (True, False)]
    want, low = (gradients(run, leaves, grad_out) for run in runs)
    for name, a, r, e in zip(("dq", "dk", "dv", "dbias"), got, want, low):
        assert a.shape == r.shape, name
        check = check_tensor(name, a, r, e, dtype)
        assert check.passed, check.describe()


@pytest.mark.parametrize("is_causal", CAUSAL)
def test_varlen_compiles_whole_with_eager_bits(is_causal, device):
    """torch.compile(fullgraph=True) of dmattn_varlen_func, bias gradient included: one graph
    (the offsets' value checks, which read them back, are skipped while tracing) and eager's
    outputs and gradients bit for bit."""
    problem, mask, bias = kernel_problem(torch.float16, device)
    q, k, v, cu_q, cu_k, max_q, max_k = problem
    grad_out = torch.randn_like(q, dtype=torch.float32).to(q.dtype)

    def attend(q, k, v, bias):
        return dmattn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, attn_mask=mask,
                                  attn_bias=bias, is_causal=is_causal)

    _assert_compiled_matches_eager(attend, (q, k, v, bias), grad_out)


@pytest.mark.parametrize("is_causal", CAUSAL)
def test_compiled_varlen_calls_hand_the_host_layer_their_documents(is_causal, monkeypatch,
                                                                   device):
    """Under torch.compile the packed mask crosses the custom ops with its offsets and their
    own causality (the packed call itself is not causal here: its two offsets tensors are
    not one), so the host layer gets KeyIntervals naming their documents, forward and
    backward, as an eager call does (on a Hopper GPU the kernels walk them, their tables made
    per call); outputs and gradients are eager's bit for bit."""
    from kernels import ops
    problem, _, bias = kernel_problem(torch.float16, device)
    q, k, v, cu_q, cu_k, max_q, max_k = problem
    cu_k = cu_k.clone()  # cross-attention offsets: the packed call cannot be causal
    grad_out = torch.randn_like(q)
    seen = []

    def spy(real, mask_at):
        def call(*args):
            seen.append((real.__name__, args[mask_at], args[mask_at + 2]))
            return real(*args)
        return call

    monkeypatch.setattr(ops, "_forward_impl", spy(ops._forward_impl, 3))
    monkeypatch.setattr(ops, "_backward_impl", spy(ops._backward_impl, 6))

    def attend(q, k, v, bias):
        return dmattn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, attn_bias=bias,
                                  is_causal=is_causal)

    _assert_compiled_matches_eager(attend, (q, k, v, bias), grad_out)
    assert [name for name, _, _ in seen] == ["_forward_impl", "_backward_impl"]
    for _, mask, packed_causal in seen:
        assert isinstance(mask, KeyIntervals) and packed_causal is False
        documents_q, documents_k, documents_causal = mask._documents
        assert torch.equal(documents_q, cu_q) and torch.equal(documents_k, cu_k)
        assert documents_causal is is_causal


def _assert_compiled_matches_eager(attend, inputs, grad_out) -> None:
    """``attend`` compiled whole (aot_eager, fullgraph) and eager, on fresh leaves of
    ``inputs``: outputs and gradients equal bit for bit."""
    results = []
    torch._dynamo.reset()
    try:
        for fn in (torch.compile(attend, backend="aot_eager", fullgraph=True), attend):
            leaves = [t.detach().requires_grad_() for t in inputs]
            out = fn(*leaves)
            results.append((out, *torch.autograd.grad(out, leaves, grad_out)))
    finally:
        torch._dynamo.reset()
    for name, got, want in zip(("out", "dq", "dk", "dv", "dbias"), *results):
        assert torch.equal(got, want), f"{name} differs between compiled and eager runs"
