"""Packed documents on the Hopper forward (``attention_forward``'s DOCUMENTS): each sequence's
own row tiles (``planning.documents.document_tiles``), keys and causality, against the fp64
varlen reference. The table is tested here on the CPU; the kernel on a Hopper GPU."""

from __future__ import annotations

import math
import random

import pytest
import torch

from attn_helpers import assert_close_to_reference
from hopper_helpers import hopper_problem, sized, tma_keys
from kernels import attention_varlen_reference
from kernels.planning.documents import document_key_blocks, document_tiles, tile_bound
from kernels.planning.forward import call_problem
from kernels.planning.inputs import check_inputs
from kernels.planning.problem import OperandLayout
from kernels.planning.schedule import normalize_options, schedule
from kernels.varlen import packed_intervals


def _walks(lengths, rows, block_n, causal):
    """{(sequence, row tile): key blocks} by the definition."""
    walks = {}
    for sequence, (seqlen_q, seqlen_k) in enumerate(lengths):
        for row_tile in range(math.ceil(seqlen_q / rows)):
            end = seqlen_k
            if causal:
                end = min(seqlen_k, (row_tile + 1) * rows + seqlen_k - seqlen_q)
            walks[(sequence, row_tile)] = math.ceil(max(end, 1) / block_n)
    return walks


def _offsets(lengths, device="cpu"):
    cu_q = torch.tensor([0] + [q for q, _ in lengths]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [k for _, k in lengths]).cumsum(0).to(torch.int32)
    return cu_q.to(device), cu_k.to(device)


@pytest.mark.parametrize("seed", range(40))
def test_the_table_lists_every_row_tile_once_longest_walks_first(seed):
    rng = random.Random(seed)
    lengths = [(rng.choice([0, 1, 5, 127, 128, 129, 300, 1000]),
                rng.choice([0, 1, 64, 128, 200, 1000])) for _ in range(rng.randint(1, 7))]
    if rng.random() < 0.5:  # self-attention: as many keys as rows
        lengths = [(q, q) for q, _ in lengths]
    if sum(q for q, _ in lengths) == 0:
        lengths[0] = (3, lengths[0][1])
    causal = rng.random() < 0.5
    cu_q, cu_k = _offsets(lengths)
    total_q = int(cu_q[-1])
    table = document_tiles(cu_q, cu_k, total_q, 128, 128, causal)
    walks = _walks(lengths, 128, 128, causal)
    assert table.dtype == torch.int32
    assert table.numel() == 1 + 2 * tile_bound(total_q, len(lengths), 128)
    count = int(table[0])
    assert count == len(walks) <= tile_bound(total_q, len(lengths), 128)
    listed = [(int(table[1 + 2 * i]), int(table[2 + 2 * i])) for i in range(count)]
    assert sorted(listed) == sorted(walks)
    blocks = [walks[tile] for tile in listed]
    assert blocks == sorted(blocks, reverse=True)
    for earlier, later in zip(listed, listed[1:]):  # ties keep the sequences' order
        if walks[earlier] == walks[later]:
            assert earlier < later


@pytest.mark.parametrize("seed", range(40))
def test_the_backward_table_lists_every_key_block_once_by_sequence_longest_first(seed):
    """``document_key_blocks``: every key block of every sequence (those walking no query
    block too: they write zeros), a sequence's together and in order, the sequences by their
    longest walk (most first, ties in sequence order)."""
    rng = random.Random(100 + seed)
    lengths = [(rng.choice([0, 1, 5, 63, 64, 65, 300, 1000]),
                rng.choice([0, 1, 127, 128, 129, 500, 1000])) for _ in range(rng.randint(1, 7))]
    if sum(k for _, k in lengths) == 0:
        lengths.append((3, 3))
    causal = bool(seed % 2)
    cu_q, cu_k = _offsets(lengths)
    total_k = int(cu_k[-1])
    table = document_key_blocks(cu_q, cu_k, total_k, 128, 64, causal)
    walks = {}
    for sequence, (lq, lk) in enumerate(lengths):
        for block in range(math.ceil(lk / 128)):
            rows = [r for r in range(lq) if any(
                key <= r + lk - lq or not causal for key in range(block * 128,
                                                                  min(lk, block * 128 + 128)))]
            first = rows[0] // 64 if rows else math.ceil(lq / 64)
            walks[(sequence, block)] = math.ceil(lq / 64) - first
    count = int(table[0])
    assert table.numel() == 1 + 2 * tile_bound(total_k, len(lengths), 128)
    listed = [(int(table[1 + 2 * i]), int(table[2 + 2 * i])) for i in range(count)]
    assert sorted(listed) == sorted(walks)
    longest = {}
    for (sequence, _), walk in walks.items():
        longest[sequence] = max(walk, longest.get(sequence, 0))
    want = sorted(walks, key=lambda entry: (-longest[entry[0]], entry))
    assert listed == want


# -- which calls walk documents
def _documents_problem(**changes):
    """A prepared, causal packed batch of 12 documents, 16k rows, on a Hopper GPU."""
    problem = hopper_problem(shape=sized(batch=1, seqlen_q=16384, seqlen_k=16384),
                             is_causal=True, mask=OperandLayout((1, 1, 16384, 16384), 16),
                             intervals=True, tma_mask=True, prepared=True, documents=12)
    return problem if not changes else hopper_problem(**{**problem.__dict__, **changes})


@pytest.mark.parametrize("options", [{}, {"forward_documents": True},
                                     {"forward_route": "hopper"},
                                     {"forward_tile_order": "balanced"}])
def test_prepared_documents_walk_on_the_hopper_forward(options):
    forward = schedule(_documents_problem(), options).forward
    assert forward.route == "hopper" and forward.documents and forward.tile_order == "balanced"


def test_the_option_false_keeps_the_documents_off():
    forward = schedule(_documents_problem(), {"forward_documents": False}).forward
    assert not forward.documents
    assert forward == schedule(_documents_problem(documents=None)).forward


@pytest.mark.parametrize("changes, options", [
    ({"shape": sized(batch=1, seqlen_q=511, seqlen_k=511)}, {}),  # rows too few to fill
    ({"bias": OperandLayout((1, 4, 1, 16384), 16), "shape": sized(
        batch=1, seqlen_q=16384, seqlen_k=16384, head_dim=64)}, {}),  # bias row below D72
    ({"documents": None}, {}),
    ({"capability": (8, 0)}, {}),
    ({}, {"forward_route": "triton"}),
    ({}, {"forward_route": "hopper", "forward_tile_order": "heads"}),
])
def test_by_default_documents_are_walked_only_where_they_lead(changes, options):
    """The default keeps documents off where they are not measured to lead, and where
    another option rules them out (no error: nothing asked for them)."""
    assert not schedule(_documents_problem(**changes), options).forward.documents


def test_a_bias_row_at_wide_heads_walks_the_documents():
    problem = _documents_problem(bias=OperandLayout((1, 4, 1, 16384), 16), tma_bias=True)
    assert schedule(problem).forward.documents


def test_documents_not_yet_prepared_walk_them_too():
    """The first call with new offsets, a torch.compile'd call, one in a CUDA graph capture:
    no kept table, so the plan makes it per call; the schedule is the prepared call's."""
    problem = _documents_problem(prepared=False)
    for options in ({}, {"forward_documents": True}):
        forward = schedule(problem, options).forward
        assert forward.route == "hopper" and forward.documents
    assert schedule(problem).forward == schedule(_documents_problem()).forward


@pytest.mark.parametrize("changes, options, message", [
    ({"documents": None}, {}, "not a packed batch's documents"),
    ({"capability": None}, {}, "CUDA GPU only"),
    ({"dtype": torch.float32}, {}, "float16 or bfloat16"),
    ({}, {"forward_route": "triton"}, "'forward_route' 'triton' conflict"),
    ({}, {"forward_tile_order": "heads"}, "'forward_tile_order' 'heads' conflicts"),
])
def test_asking_for_documents_where_they_cannot_be_walked_says_why(changes, options, message):
    with pytest.raises(ValueError, match=message):
        schedule(_documents_problem(**changes), {"forward_documents": True, **options})


def test_the_backward_walks_documents_by_default():
    problem = _documents_problem()
    for options in ({}, {"backward_documents": True}, {"backward": "hopper"}):
        backward = schedule(problem, normalize_options(options)).backward
        assert backward.route.value == "hopper" and backward.documents
    assert not schedule(problem, {"backward_documents": False}).backward.documents
    # the first call with new offsets (not prepared) walks them too, its table made per call
    first = _documents_problem(prepared=False)
    assert schedule(first).backward.documents
    assert schedule(first, {"backward_documents": True}).backward == schedule(first).backward


@pytest.mark.parametrize("changes, options", [
    ({"deterministic": True}, {}),  # dQ's adds over documents come in any order
    ({"shape": sized(batch=1, seqlen_q=511, seqlen_k=511)}, {}),  # below the packed rows' floor
    ({}, {"backward": "dq+dkdv"}),
])
def test_the_backward_keeps_documents_off_where_it_should(changes, options):
    problem = _documents_problem(**changes)
    assert not schedule(problem, normalize_options(options)).backward.documents


@pytest.mark.parametrize("changes, options, message", [
    ({"documents": None}, {}, "not a packed batch's documents"),
    ({"deterministic": True}, {}, "not bitwise reproducible"),
    ({"dtype": torch.float32}, {}, "float16 or bfloat16"),
    ({}, {"backward": "fused"}, "'backward' 'fused' conflict"),
    ({"shape": sized(batch=1, seqlen_q=1, seqlen_k=300), "bias_grad": True,  # one row in all
      "bias": OperandLayout((1, 1, 1, 300), 16)}, {}, "not yet one query row"),
])
def test_asking_the_backward_for_documents_where_it_cannot_says_why(changes, options, message):
    with pytest.raises(ValueError, match=message):
        schedule(_documents_problem(**changes),
                 normalize_options({"backward_documents": True, **options}))


def test_the_option_takes_a_bool():
    for name in ("forward_documents", "backward_documents"):
        assert normalize_options({name: False}) == {name: False}
        with pytest.raises(ValueError, match=name):
            normalize_options({name: 1})


@pytest.mark.parametrize("is_causal", [False, True])
def test_packed_intervals_name_their_documents_and_the_problem_counts_them(is_causal):
    lengths = [(5, 5), (0, 0), (17, 17), (3, 3)]
    cu_q, cu_k = _offsets(lengths)
    total = int(cu_q[-1])
    q = torch.randn(1, total, 2, 16)
    intervals = packed_intervals(cu_q, cu_k, total, is_causal)
    assert intervals._documents[:2] == (cu_q, cu_k) and intervals._documents[2] == is_causal
    checked = check_inputs(q, q, q, intervals, None, None)
    assert call_problem(checked, q, is_causal).documents == len(lengths)
    # A packed call over cross-attention offsets may be non-causal while each sequence is.
    assert call_problem(checked, q, False).documents == len(lengths)
    start = torch.zeros(1, 1, total, dtype=torch.int32)
    masked = packed_intervals(cu_q, cu_k, total, is_causal,
                              attn_mask=type(intervals)(start, start + 4))
    assert masked._documents is None  # a caller's mask inside the documents


# -- device side: a Hopper GPU
DOCUMENTS = [  # (query rows, keys) per sequence
    [(1, 1)],
    [(17, 17), (0, 0), (97, 97), (128, 128), (129, 129)],
    [(300, 300), (1, 1), (4095, 4095), (256, 256)],
    [(1000, 1000)] * 3 + [(63, 63)],
    [(40, 97), (97, 40), (128, 1), (5, 0), (700, 1025)],  # Lq != Lk: bottom-right causality
    [(2048, 2048), (17, 17), (1025, 1025), (3000, 3000)],
]


def _references(q, k, v, cu_q, cu_k, bias, causal):
    """The varlen reference's (out, lse) in fp64, then eager in the inputs' dtype."""
    return tuple(attention_varlen_reference(q, k, v, cu_q, cu_k, attn_bias=bias,
                                            is_causal=causal, return_lse=True, upcast=upcast)
                 for upcast in (True, False))


def _assert_matches(out, lse, references, dtype, context: str = "") -> None:
    """Out and LSE within the accuracy rule of the fp64 reference (``context`` prefixes the
    tensors' names in a failure)."""
    ref, eager = references
    for name, got, want, low in zip(("out", "lse"), (out, lse), ref, eager):
        assert_close_to_reference(f"{context}{name}", got, want, low, dtype)


def _launch(q, k, v, cu_q, cu_k, bias, causal):
    """The Hopper forward over packed documents, launched as the route's plan launches it,
    into a NaN-poisoned output: (out (total_q, Hq, D), lse (Hq, total_q))."""
    from kernels.planning import tuning
    from kernels.planning.hopper_forward_launch import HopperForwardLaunch
    from kernels.planning.forward import call_problem
    from kernels.planning.inputs import check_inputs

    query, key, value = q[None], k[None], v[None]
    bias4 = None if bias is None else bias[None, :, None, :]
    checked = check_inputs(query, key, value, None, bias4, None)
    problem = call_problem(checked, query, causal)
    tile = tuning.HOPPER_FORWARD
    launch = HopperForwardLaunch(problem, tile, None, checked.bias, "balanced",
                                 sequences=cu_q.numel() - 1, causal=causal)
    table = document_tiles(cu_q, cu_k, q.shape[0], 2 * tile.rows, tile.block_n, causal)
    out = torch.full_like(query, float("nan"))
    lse = torch.full((1, q.shape[1], q.shape[0]), float("nan"), device=q.device)
    launch(query, key, value, out, lse, bias=bias4, documents=(table, cu_q, cu_k))
    return out[0], lse[0]


# (head dim, (query heads, key heads), a per-key bias) of the reference tests
FORMS = [(128, (8, 2), False), (64, (4, 4), True), (80, (6, 1), False), (128, (4, 2), True)]


def _documents_inputs(lengths, head_dim, heads, bias, device, bias_rows_aligned=True):
    """bf16 (q, k, v, cu_q, cu_k, a per-key bias or None) of packed ``lengths``; the bias's
    rows 16-byte aligned, as the forward's TMA reads them, where ``bias_rows_aligned``."""
    dtype = torch.bfloat16
    cu_q, cu_k = _offsets(lengths, device)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(total_q, heads[0], head_dim, device=device, dtype=dtype)
    k = torch.randn(total_k, heads[1], head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    attn_bias = None
    if bias:
        width = tma_keys(total_k, 2) if bias_rows_aligned else total_k
        attn_bias = (2 * torch.randn(heads[1], width, device=device)).to(dtype)[:, :total_k]
    return q, k, v, cu_q, cu_k, attn_bias


@pytest.mark.hopper
@pytest.mark.parametrize("lengths", DOCUMENTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,heads,bias", FORMS)
def test_documents_match_the_reference(device, lengths, causal, head_dim, heads, bias):
    torch.manual_seed(len(lengths) * 7 + head_dim)
    dtype = torch.bfloat16
    q, k, v, cu_q, cu_k, attn_bias = _documents_inputs(lengths, head_dim, heads, bias, device)
    out, lse = _launch(q, k, v, cu_q, cu_k, attn_bias, causal)
    assert not out.isnan().any() and not lse.isnan().any()
    references = _references(q, k, v, cu_q, cu_k, attn_bias, causal)
    _assert_matches(out, lse, references, dtype)
    empty = torch.isneginf(references[0][1])
    assert torch.isneginf(lse[empty]).all() and (out.transpose(0, 1)[empty] == 0).all()


@pytest.mark.hopper
@pytest.mark.parametrize("options", [{}, {"forward_documents": True}])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_calls_walk_their_documents_from_the_first_call(device, causal, options):
    """``dmattn_varlen_func``, by default and with ``forward_documents``: every call walks the
    documents on the Hopper forward, the first with new offsets too (its table made for the
    call, the later ones' kept with the prepared mask), each matching the reference; the
    backward reads the Hopper forward's LSE."""
    from kernels import dmattn_varlen_func, record_routes

    torch.manual_seed(3)
    lengths = [(700, 700), (1, 1), (129, 129), (2048, 2048), (0, 0), (333, 333)]
    cu_q, _ = _offsets(lengths, device)
    total = int(cu_q[-1])
    q, k, v = (torch.randn(total, heads, 128, device=device, dtype=torch.bfloat16)
               for heads in (8, 2, 2))
    references = _references(q, k, v, cu_q, cu_q, None, causal)
    walked = []
    for _ in range(3):
        with record_routes() as routes:
            out, lse = dmattn_varlen_func(q, k, v, cu_q, cu_q, 2048, 2048, is_causal=causal,
                                          return_lse=True, kernel_options=options)
        walked.append(set(routes.forward))
        _assert_matches(out, lse, references, torch.bfloat16)
    assert walked[0] == walked[1] == walked[2] == {"hopper"}
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = dmattn_varlen_func(*leaves, cu_q, cu_q, 2048, 2048, is_causal=causal,
                             kernel_options=options)
    out.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.isfinite().all() for t in leaves)


@pytest.mark.hopper
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_and_captured_varlen_calls_walk_their_documents(device, causal):
    """torch.compile(fullgraph=True) of a packed call, and a CUDA graph of one: nothing is
    prepared in either (the custom ops carry the offsets; a capture keeps no packed mask), so
    each makes its documents' tables in the call with no read-back. Both take the Hopper
    forward and backward over the documents and give the eager call's output, dK and dV bit
    for bit (one program writes each), dQ within two bf16 roundings (its adds over documents
    come in any order)."""
    from kernels import dmattn_varlen_func, record_routes

    torch.manual_seed(5)
    lengths = [(700, 700), (1, 1), (129, 129), (1500, 1500), (333, 333)]
    cu_q, _ = _offsets(lengths, device)
    total = int(cu_q[-1])
    q, k, v = (torch.randn(total, heads, 128, device=device, dtype=torch.bfloat16)
               for heads in (8, 2, 2))
    grad_out = torch.randn_like(q)

    def attend(q, k, v):
        return dmattn_varlen_func(q, k, v, cu_q, cu_q, 1500, 1500, is_causal=causal)

    def step(fn, leaves):
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, grad_out))

    def same(got, want, what):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            if name == "dq":
                torch.testing.assert_close(a, b, rtol=2 ** -7, atol=1e-5)
            else:
                assert torch.equal(a, b), f"{what}: {name} differs from the eager call's"

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    eager = step(attend, leaves)
    torch._dynamo.reset()
    try:
        compiled_attend = torch.compile(attend, fullgraph=True)
        step(compiled_attend, leaves)  # compiles
        with record_routes() as routes:
            compiled = step(compiled_attend, leaves)
    finally:
        torch._dynamo.reset()
    assert set(routes.forward) == set(routes.backward) == {"hopper"}, routes.describe()
    same(compiled, eager, "compiled")

    # Fresh leaves, first used on the side stream: autograd keeps the stream a leaf was first
    # used on, and the engine's closing wait on the default (legacy) stream is illegal in a
    # capture.
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm outside the capture
        step(attend, leaves)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with record_routes() as routes:
        with torch.cuda.graph(graph):
            captured = step(attend, leaves)
    graph.replay()
    torch.cuda.synchronize()
    assert set(routes.forward) == set(routes.backward) == {"hopper"}, routes.describe()
    same(captured, eager, "captured")


def _random_batch(rng, device, bias_rows_aligned: bool):
    """One fuzz case: (lengths, q, k, v, cu_q, cu_k, bias or None, causal) of 1-12 sequences
    of 0-2000 rows (cross lengths too), head dims 16-128, GQA/MQA, both dtypes, causal or not,
    a per-key bias of every head broadcast (its rows 16-byte aligned, as the forward's TMA
    reads them, where ``bias_rows_aligned``)."""
    count = rng.randint(1, 12)
    lengths = [(rng.choice([0, 1, rng.randint(1, 2000), int(2 ** rng.uniform(0, 11))]),)
               for _ in range(count)]
    lengths = [(q, q if rng.random() < 0.7 else rng.randint(0, 2000)) for (q,) in lengths]
    # A bias over one key in all reads as one broadcast along the keys, and one over one row
    # as a full (Lq, Lk) bias (neither a Hopper kernel's)
    if sum(q for q, _ in lengths) < 2 or sum(k for _, k in lengths) < 2:
        lengths.append((37, 37))
    heads_q, heads_kv = rng.choice([(1, 1), (4, 1), (8, 2), (6, 3)])
    head_dim = rng.choice([16, 40, 64, 80, 128])
    dtype = rng.choice([torch.bfloat16, torch.float16])
    causal = rng.random() < 0.5
    cu_q, cu_k = _offsets(lengths, device)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(total_q, heads_q, head_dim, device=device, dtype=dtype)
    k = torch.randn(total_k, heads_kv, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    bias = None
    if rng.random() < 0.4:
        heads = rng.choice(sorted({1, heads_kv, heads_q}))
        width = tma_keys(total_k, 2) if bias_rows_aligned else total_k
        bias = (2 * torch.randn(heads, width, device=device)).to(dtype)[:, :total_k]
    return lengths, q, k, v, cu_q, cu_k, bias, causal


@pytest.mark.hopper
def test_documents_on_random_batches(device):
    """A seeded fuzz of 300 packed batches through ``dmattn_varlen_func`` with
    ``forward_documents``: 1-12 sequences of 0-2000 rows (cross lengths too), head dims 16-128,
    GQA/MQA, both dtypes, causal or not, a per-key bias of every head broadcast; each batch's
    second call walks its documents on the Hopper forward and matches the fp64 reference. NaN
    never passes."""
    from kernels import dmattn_varlen_func, record_routes

    rng = random.Random(67)
    for case in range(300):
        lengths, q, k, v, cu_q, cu_k, bias, causal = _random_batch(rng, device, True)
        head_dim, dtype = q.shape[-1], q.dtype
        longest_q = max(q for q, _ in lengths)
        longest_k = max(k for _, k in lengths)
        options = {"forward_documents": True}
        references = _references(q, k, v, cu_q, cu_k, bias, causal)
        for call in range(2):  # the first call's table is its own, the second's kept
            with record_routes() as routes:
                out, lse = dmattn_varlen_func(q, k, v, cu_q, cu_k, longest_q, longest_k,
                                              attn_bias=bias, is_causal=causal,
                                              return_lse=True, kernel_options=options)
            assert set(routes.forward) == {"hopper"}, (case, call, lengths, routes.describe())
            _assert_matches(out, lse, references, dtype,
                            f"case {case} call {call} {lengths} D{head_dim} causal={causal}: ")


# -- the backward over documents (``kernel_options['backward_documents']``), on a Hopper GPU
def _gradient_check(q, k, v, cu_q, cu_k, bias, causal, context="", options=None):
    """The backward of ``dmattn_varlen_func`` over these documents, its second call (the
    offsets' packed mask prepared) walking them on the Hopper backward, against the fp64
    varlen reference's gradients (dq, dk, dv and a bias's), with the eager run in the inputs'
    dtype as the baseline. Returns the second call's backward routes."""
    from kernels import dmattn_varlen_func, record_routes

    longest_q = int((cu_q[1:] - cu_q[:-1]).max())
    longest_k = int((cu_k[1:] - cu_k[:-1]).max())
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if bias is not None:
        leaves.append(bias.detach().requires_grad_())
    grad_out = torch.randn_like(q)
    options = {"backward_documents": True, **(options or {})}
    calls = []
    for _ in range(2):  # the first call's tables are its own, the second's kept
        with record_routes() as routes:
            out = dmattn_varlen_func(*leaves[:3], cu_q, cu_k, longest_q, longest_k,
                                     attn_bias=leaves[3] if bias is not None else None,
                                     is_causal=causal, kernel_options=options)
            calls.append(torch.autograd.grad(out, leaves, grad_out))
    runs = [attention_varlen_reference(*leaves[:3], cu_q, cu_k,
                                       attn_bias=leaves[3] if bias is not None else None,
                                       is_causal=causal, upcast=upcast)
            for upcast in (True, False)]
    want, low = (torch.autograd.grad(run, leaves, grad_out.to(run.dtype)) for run in runs)
    for call, got in enumerate(calls):
        for name, a, r, e in zip(("dq", "dk", "dv", "dbias"), got, want, low):
            assert a.isfinite().all(), f"{context}call {call} {name} not finite"
            assert_close_to_reference(f"{context}call {call} {name}", a, r, e, q.dtype)
    return routes.backward


@pytest.mark.hopper
@pytest.mark.parametrize("lengths", DOCUMENTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,heads,bias", FORMS)
def test_the_backward_over_documents_matches_the_reference(device, lengths, causal, head_dim,
                                                          heads, bias):
    torch.manual_seed(len(lengths) * 11 + head_dim)
    q, k, v, cu_q, cu_k, attn_bias = _documents_inputs(lengths, head_dim, heads, bias, device,
                                                       bias_rows_aligned=False)
    if bias and sum(k for _, k in lengths) < 2:
        # One key in all: a per-key bias reads as one broadcast along the keys, which the
        # Hopper kernels do not take; forcing the option says so.
        with pytest.raises(ValueError, match="broadcast along the keys"):
            _gradient_check(q, k, v, cu_q, cu_k, attn_bias, causal)
        return
    routes = _gradient_check(q, k, v, cu_q, cu_k, attn_bias, causal)
    assert routes == ["hopper"]


@pytest.mark.hopper
@pytest.mark.parametrize("lengths", DOCUMENTS[1:])
@pytest.mark.parametrize("causal", [False, True])
def test_the_backward_over_documents_with_dq_spread(device, lengths, causal):
    """``backward_dq_spread`` (head dim 128) over documents, with a bias row and without."""
    for bias in (False, True):
        q, k, v, cu_q, cu_k, attn_bias = _documents_inputs(lengths, 128, (8, 2), bias, device,
                                                           bias_rows_aligned=False)
        routes = _gradient_check(q, k, v, cu_q, cu_k, attn_bias, causal,
                                 options={"backward_dq_spread": True})
        assert routes == ["hopper"]


@pytest.mark.hopper
@pytest.mark.parametrize("part", range(4))
def test_the_backward_over_documents_on_random_batches(device, part):
    """A seeded fuzz of 300 packed batches, in four parts of 75 (each its own seed, so they
    run in parallel), through the Hopper backward over documents (as
    ``test_documents_on_random_batches`` draws them: cross lengths, empty sequences, D 16-128,
    GQA/MQA, both dtypes, causal or not, a per-key bias of every head broadcast and its
    gradient), each against the fp64 reference's gradients. NaN never passes."""
    rng = random.Random(71 + part)
    for case in range(75):
        lengths, q, k, v, cu_q, cu_k, bias, causal = _random_batch(rng, device, False)
        (heads_q, head_dim), heads_kv = q.shape[1:], k.shape[1]
        context = (f"part {part} case {case} {lengths} H{heads_q}/{heads_kv} D{head_dim} "
                   f"causal={causal}: ")
        routes = _gradient_check(q, k, v, cu_q, cu_k, bias, causal, context)
        assert routes == ["hopper"], context + str(routes)
