"""topk_intervals: flash-dmattn's dynamic top-W mask as key intervals.

The ground truth is the dense mask built the way flash-dmattn builds it: per query row, the bias
of the visible keys, torch.topk of it, True scattered at the chosen keys. On biases with equal
values torch.topk's choice is not defined, so ties are checked against the documented rule
(larger bias first, then smaller key index) evaluated pair by pair.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from attn_helpers import AllocationWatch
from kernels import KeyIntervals
from kernels import topk_intervals

# (Lq, Lk): equal, Lq < Lk, Lq > Lk, decode, and odd sizes.
LENGTHS = (
    pytest.param((17, 17), id="q17-k17"),
    pytest.param((17, 97), id="q17-k97"),
    pytest.param((97, 17), id="q97-k17"),
    pytest.param((1, 97), id="q1-k97"),
    pytest.param((1, 1), id="q1-k1"),
    pytest.param((97, 97), id="q97-k97"),
    pytest.param((33, 300), id="q33-k300"),
)
WINDOWS = (1, 2, 16, 1000)  # 1000: never fewer visible keys than the window
CAUSAL = (pytest.param(False, id="full"), pytest.param(True, id="causal"))
BATCH_HEADS = (pytest.param((1, 1), id="b1h1"), pytest.param((2, 3), id="b2h3"))
# Packed sequences (Lq_s, Lk_s), lengths 0 and 1 among them.
PACKED = (
    pytest.param(((5, 5), (0, 3), (1, 1), (7, 2), (3, 9), (4, 0), (1, 6)), id="mixed"),
    pytest.param(((17, 17),), id="one"),
    pytest.param(((1, 1), (1, 1), (2, 2)), id="tiny"),
)


def visible(seqlen_q: int, seqlen_k: int, is_causal: bool) -> torch.Tensor:
    rows = torch.arange(seqlen_q)[:, None]
    cols = torch.arange(seqlen_k)[None, :]
    if not is_causal:
        return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    return cols <= rows + (seqlen_k - seqlen_q)


def topk_scatter_mask(bias, window, seqlen_q, is_causal) -> torch.Tensor:
    """(B, H, Lq, Lk): per row, topk of the visible keys' bias, True scattered at them."""
    b, h, _, lk = bias.shape
    seen = visible(seqlen_q, lk, is_causal)
    scores = bias.float().expand(b, h, seqlen_q, lk).masked_fill(~seen, -math.inf)
    keep = torch.zeros(b, h, seqlen_q, lk, dtype=torch.bool)
    keep.scatter_(-1, scores.topk(min(window, lk), dim=-1).indices, True)
    # With fewer visible keys than the window, topk also picks hidden keys; drop them.
    return keep & seen


def rule_mask(bias, window, seqlen_q, is_causal) -> torch.Tensor:
    """(B, H, Lq, Lk) by the documented rule: j is kept at row i iff it is visible and fewer
    than ``window`` visible keys beat it (larger bias, or equal and a smaller index; NaN
    counts as -inf)."""
    b, h, _, lk = bias.shape
    values = torch.where(torch.isnan(bias), -math.inf, bias.double())[:, :, 0]  # (B, H, Lk)
    index = torch.arange(lk)
    # beats[..., k, j]: key k beats key j
    larger = values[..., :, None] > values[..., None, :]
    tied_before = (values[..., :, None] == values[..., None, :]) & (index[:, None] < index)
    beats = (larger | tied_before).double()
    seen = visible(seqlen_q, lk, is_causal).double()  # (Lq, Lk)
    beaten_by = torch.einsum("ik,bhkj->bhij", seen, beats)
    return (beaten_by < window) & seen.bool()


def distinct_bias(shape) -> torch.Tensor:
    """Distinct values: a random permutation, scaled, so torch.topk's choice is unique."""
    count = math.prod(shape)
    return (torch.randperm(count).double() / count - 0.5).view(shape).float()


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("is_causal", CAUSAL)
@pytest.mark.parametrize("batch_heads", BATCH_HEADS)
def test_equals_the_topk_scatter_mask(lengths, window, is_causal, batch_heads, device):
    seqlen_q, seqlen_k = lengths
    bias = distinct_bias((*batch_heads, 1, seqlen_k))
    intervals = topk_intervals(bias.to(device), window, seqlen_q=seqlen_q, is_causal=is_causal)
    assert intervals.shape == (*batch_heads, seqlen_k)
    assert intervals.start.dtype == intervals.end.dtype == torch.int32
    assert intervals.device.type == device.type
    expected = topk_scatter_mask(bias, window, seqlen_q, is_causal)
    assert torch.equal(intervals.to_dense(seqlen_q).cpu(), expected)


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("window", (1, 3, 8))
@pytest.mark.parametrize("is_causal", CAUSAL)
def test_ties_rank_the_smaller_key_first(lengths, window, is_causal, device):
    seqlen_q, seqlen_k = lengths
    bias = torch.randint(0, 3, (2, 2, 1, seqlen_k)).to(torch.bfloat16)
    intervals = topk_intervals(bias.to(device), window, seqlen_q=seqlen_q, is_causal=is_causal)
    expected = rule_mask(bias, window, seqlen_q, is_causal)
    assert torch.equal(intervals.to_dense(seqlen_q).cpu(), expected)


@pytest.mark.parametrize("is_causal", CAUSAL)
@pytest.mark.parametrize("seqlen_q", (9, 1), ids=("q9", "decode"))
def test_nan_ranks_as_minus_infinity(is_causal, seqlen_q, device):
    seqlen_k, window = 23, 4
    bias = torch.randint(0, 4, (1, 2, 1, seqlen_k)).float()
    bias[..., 1::5] = math.nan
    bias[..., 3::7] = -math.inf
    bias[..., 2] = math.inf
    intervals = topk_intervals(bias.to(device), window, seqlen_q=seqlen_q, is_causal=is_causal)
    expected = rule_mask(bias, window, seqlen_q, is_causal)
    assert torch.equal(intervals.to_dense(seqlen_q).cpu(), expected)
    # The rule with NaN written as -inf is the same mask.
    as_inf = topk_intervals(torch.nan_to_num(bias, nan=-math.inf, posinf=math.inf).to(device),
                            window, seqlen_q=seqlen_q, is_causal=is_causal)
    assert torch.equal(as_inf.to_dense(seqlen_q), intervals.to_dense(seqlen_q))


def test_seqlen_q_defaults_to_seqlen_k_and_causal_is_the_default(device):
    bias = distinct_bias((1, 2, 1, 40)).to(device)
    default = topk_intervals(bias, 5)
    explicit = topk_intervals(bias, 5, seqlen_q=40, is_causal=True)
    assert torch.equal(default.start, explicit.start) and torch.equal(default.end, explicit.end)


def test_broadcast_bias_gives_broadcast_shaped_intervals(device):
    row = distinct_bias((1, 3, 1, 33)).to(device)
    intervals = topk_intervals(row.expand(2, 3, 1, 33), 4, seqlen_q=20)
    single = topk_intervals(row, 4, seqlen_q=20)
    assert intervals.shape == (2, 3, 33) and single.shape == (1, 3, 33)
    assert torch.equal(intervals.to_dense(20), single.to_dense(20).expand(2, 3, 20, 33))


def test_takes_a_bias_that_requires_grad_and_returns_plain_integers(device):
    bias = distinct_bias((1, 2, 1, 17)).to(device).requires_grad_()
    intervals = topk_intervals(bias, 3, seqlen_q=5)
    assert not intervals.start.requires_grad and not intervals.end.requires_grad
    with torch.no_grad():
        again = topk_intervals(bias, 3, seqlen_q=5)
    assert torch.equal(again.start, intervals.start) and torch.equal(again.end, intervals.end)
    assert bias.grad is None


def test_never_allocates_a_query_by_key_matrix():
    seqlen_q, seqlen_k = 1024, 2048
    bias = distinct_bias((1, 1, 1, seqlen_k))
    with AllocationWatch() as watch:
        topk_intervals(bias, 64, seqlen_q=seqlen_q)
    # int64 arrays of Lk + 1 entries per level are the largest things made.
    assert watch.largest_fresh_bytes() <= 8 * (seqlen_k + 1), watch.describe()


# -- packed sequences
def pack(lengths, heads: int):
    """(bias (H, total_k), cu_seqlens_q, cu_seqlens_k) for sequences of (Lq_s, Lk_s)."""
    cu_q = torch.tensor([0] + [q for q, _ in lengths], dtype=torch.int32).cumsum(0)
    cu_k = torch.tensor([0] + [k for _, k in lengths], dtype=torch.int32).cumsum(0)
    bias = distinct_bias((heads, int(cu_k[-1])))
    return bias, cu_q.to(torch.int32), cu_k.to(torch.int32)


@pytest.mark.parametrize("lengths", PACKED)
@pytest.mark.parametrize("window", (1, 3, 1000))
@pytest.mark.parametrize("is_causal", CAUSAL)
def test_packed_equals_each_sequence_on_its_own(lengths, window, is_causal, device):
    bias, cu_q, cu_k = pack(lengths, heads=3)
    packed = topk_intervals(bias.to(device), window, is_causal=is_causal,
                            cu_seqlens_q=cu_q.to(device), cu_seqlens_k=cu_k.to(device))
    assert packed.shape == (1, 3, bias.shape[1])
    for s, (seqlen_q, seqlen_k) in enumerate(lengths):
        k0, k1 = int(cu_k[s]), int(cu_k[s + 1])
        if seqlen_k == 0:
            continue
        start, end = packed.start[..., k0:k1].cpu(), packed.end[..., k0:k1].cpu()
        if seqlen_q == 0:
            assert (start >= end).all(), f"sequence {s} has no rows, yet a key is seen"
            continue
        alone = topk_scatter_mask(bias[None, :, None, k0:k1], window, seqlen_q, is_causal)
        assert torch.equal(KeyIntervals(start, end).to_dense(seqlen_q), alone), f"sequence {s}"


def test_packed_query_offsets_default_to_the_key_offsets(device):
    bias, _, cu_k = pack(((4, 4), (0, 0), (7, 7)), heads=2)
    bias, cu_k = bias.to(device), cu_k.to(device)
    default = topk_intervals(bias, 2, cu_seqlens_k=cu_k)
    explicit = topk_intervals(bias, 2, cu_seqlens_q=cu_k, cu_seqlens_k=cu_k)
    assert torch.equal(default.start, explicit.start) and torch.equal(default.end, explicit.end)


def test_packed_ties_follow_the_rule_per_sequence():
    lengths = ((6, 6), (3, 8), (8, 3))
    _, cu_q, cu_k = pack(lengths, heads=2)
    bias = torch.randint(0, 2, (2, int(cu_k[-1]))).float()
    packed = topk_intervals(bias, 2, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for s, (seqlen_q, _) in enumerate(lengths):
        k0, k1 = int(cu_k[s]), int(cu_k[s + 1])
        got = KeyIntervals(packed.start[..., k0:k1], packed.end[..., k0:k1]).to_dense(seqlen_q)
        assert torch.equal(got, rule_mask(bias[None, :, None, k0:k1], 2, seqlen_q, True))


# -- bad input
def test_rejects_bad_input():
    bias = distinct_bias((1, 2, 1, 8))
    packed, cu_q, cu_k = pack(((3, 3), (2, 5)), heads=2)
    cases = [
        (dict(bias=bias, window=0), ValueError, "window must be a positive int"),
        (dict(bias=bias, window=2.0), ValueError, "window must be a positive int"),
        (dict(bias=bias, window=True), ValueError, "window must be a positive int"),
        (dict(bias=bias.tolist(), window=2), TypeError, "bias must be a torch.Tensor"),
        (dict(bias=bias.long(), window=2), TypeError, "bias must be a floating-point"),
        (dict(bias=bias[..., :0], window=2), ValueError, "bias must not be empty"),
        (dict(bias=bias.expand(1, 2, 3, 8), window=2), ValueError, r"\(B, H, 1, Lk\)"),
        (dict(bias=bias, window=2, seqlen_q=0), ValueError, "seqlen_q must be a positive"),
        (dict(bias=bias, window=2, cu_seqlens_q=cu_q), ValueError, "cu_seqlens_q needs"),
        (dict(bias=packed, window=2, seqlen_q=3, cu_seqlens_k=cu_k), ValueError,
         "seqlen_q must be None"),
        (dict(bias=packed[None], window=2, cu_seqlens_k=cu_k), ValueError, r"\(H, total_k\)"),
        (dict(bias=packed, window=2, cu_seqlens_k=cu_k.long()), TypeError,
         "cu_seqlens_k dtype must be torch.int32"),
        (dict(bias=packed, window=2, cu_seqlens_k=cu_k[:, None]), ValueError,
         "cu_seqlens_k must be 1-D"),
        (dict(bias=packed[:, :7], window=2, cu_seqlens_k=cu_k), ValueError,
         "cu_seqlens_k must end at the packed length 7"),
        (dict(bias=packed, window=2, cu_seqlens_k=cu_k.flip(0)), ValueError,
         "cu_seqlens_k must start at 0"),
        (dict(bias=packed, window=2, cu_seqlens_k=torch.tensor([0, 6, 3, 8], dtype=torch.int32)),
         ValueError, "cu_seqlens_k must be non-decreasing"),
        (dict(bias=packed, window=2, cu_seqlens_q=cu_q[:2], cu_seqlens_k=cu_k), ValueError,
         "cu_seqlens_q must have the shape of cu_seqlens_k"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            topk_intervals(**kwargs)


def test_single_sequence_keys_equal_their_offsets_build(device):
    from kernels.masks.packed_seqlens import PackedKeys

    single = PackedKeys.single(13, 29, device)
    built = PackedKeys.build(torch.tensor([0, 13], dtype=torch.int32, device=device),
                             torch.tensor([0, 29], dtype=torch.int32, device=device), 29)
    for name in ("seq", "local", "key_start", "seqlen_k", "query_start", "seqlen_q"):
        assert torch.equal(getattr(single, name), getattr(built, name)), name


def test_repeated_forms_replay_a_graph_with_the_direct_bits(device, monkeypatch):
    """On a GPU a causal form's first call captures the selection as a CUDA graph and every
    call replays it: each must give the bits of the direct ops for its own bias. The
    one-window form (no causality, or one query row) is never captured, and off the GPU
    nothing is kept."""
    tk = importlib.import_module("kernels.masks.topk")
    face = importlib.import_module("kernels.topk_ops")
    monkeypatch.setattr(face, "_graphs", type(face._graphs)())
    generator = torch.Generator().manual_seed(5)
    for call in range(6):  # per form: captured and replayed, then replayed
        bias = torch.randn(2, 3, 1, 300, generator=generator).to(device)
        window, is_causal = (40, True) if call % 3 == 0 else (41, True) if call % 3 == 1 \
            else (40, False)
        got = topk_intervals(bias, window, seqlen_q=250, is_causal=is_causal)
        start, end = tk._rows_direct(bias.reshape(6, 300), window, 250, is_causal)
        assert torch.equal(got.start, start.reshape(2, 3, 300)), f"call {call}: start"
        assert torch.equal(got.end, end.reshape(2, 3, 300)), f"call {call}: end"
    kept = list(face._graphs.values())
    if device.type == "cuda":  # two causal forms (windows 40 and 41): two graphs
        assert len(kept) == 2 and all(isinstance(g, face._SelectionGraph) for g in kept)
    else:
        assert not kept


@pytest.mark.parametrize("seqlen_q, is_causal", ((1, True), (1, False), (5, False)),
                         ids=("decode", "decode-full", "q5-full"))
@pytest.mark.parametrize("window", (1, 7, 40, 99))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32),
                         ids=("bf16", "fp16", "fp32"))
@pytest.mark.parametrize("max_slices", (32, 2), ids=("slices8", "slices2"))
def test_one_window_walks_rows_in_steps(seqlen_q, is_causal, window, dtype, max_slices, device,
                                        monkeypatch):
    """The one-window selection's kernels cut a row into slices walked in steps of
    ``TOP_WINDOW_BLOCK`` keys: a radix select of the W-th largest value, then each key's
    verdict with the ties before it counted. With steps of 16 over 100 keys (8 slices of one
    step, or 2 of four) of few values (ties in every step; values one
    unit in the last place apart, so every bit of the dtype matters; both signs, -0.0 and
    +0.0, NaN and infinities among them), it keeps the rule's keys, and so do the torch ops
    (``USE_KERNELS = False``)."""
    tk = importlib.import_module("kernels.masks.topk")
    monkeypatch.setattr(tk, "TOP_WINDOW_BLOCK", 16)
    monkeypatch.setattr(tk, "TOP_WINDOW_MAX_SLICES", max_slices)
    generator = torch.Generator().manual_seed(window)
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-23}[dtype]
    shape = (2, 3, 1, 100)
    bias = (torch.randint(0, 3, shape, generator=generator)
            + ulp * torch.randint(0, 2, shape, generator=generator)).double()
    bias[1] -= 2.0  # negative values
    bias[0, 0, 0, 5::11] = math.nan
    bias[0, 1, 0, 7::13] = math.inf
    bias[0, 2, 0, 1::4] = -0.0
    bias[0, 2, 0, 3::4] = 0.0
    bias[1, 2, 0, ::3] = -math.inf
    bias = bias.to(dtype)
    expected = rule_mask(bias, window, seqlen_q, is_causal)
    for use_kernels in (True, False):
        monkeypatch.setattr(tk, "USE_KERNELS", use_kernels)
        got = topk_intervals(bias.to(device), window, seqlen_q=seqlen_q, is_causal=is_causal)
        assert torch.equal(got.to_dense(seqlen_q).cpu(), expected), f"kernels {use_kernels}"
        # The kernels list each row's kept keys in key order, as decode's gather route reads
        # them (the torch ops list none).
        if not use_kernels:
            assert got._kept_lists is None
            continue
        kept, counts = (t.cpu() for t in got._kept_lists)
        rows = expected.any(dim=2).reshape(6, 100)
        assert kept.shape == (6, window) and torch.equal(counts, torch.full((6,), window))
        for row in range(6):
            assert kept[row].tolist() == rows[row].nonzero().flatten().tolist(), f"row {row}"


@pytest.mark.parametrize("finish", ("kernel", "torch-ops"))
@pytest.mark.parametrize("seqlen_q", (2, 5, 16))
@pytest.mark.parametrize("window", ("rows", 40, "most"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32),
                         ids=("bf16", "fp16", "fp32"))
def test_few_causal_rows_take_one_selection_with_the_bits_of_every_row(seqlen_q, window, dtype,
                                                                      finish, device,
                                                                      monkeypatch):
    """A causal selection of 2-16 query rows (``FEW_ROWS_MAX``) takes ``_few_rows``: one
    top-W selection of the keys the first row sees, then the last rows' keys against that
    selection's last keys, in one launch (``_few_rows_kernel``) or in torch ops. Its intervals
    carry the bits of the general path (``_intervals``, whose ``end`` is 0 for keys beaten at
    once, whatever their start) and keep the rule's keys, on biases of few values (ties
    everywhere), NaN, infinities and both zeros, at windows of Lq keys, 40, and all but one of
    the keys the first row sees."""
    tk = importlib.import_module("kernels.masks.topk")
    monkeypatch.setattr(tk, "FEW_ROWS_KERNEL", finish == "kernel")
    launched = []
    launch = tk._few_rows_launch
    monkeypatch.setattr(tk, "_few_rows_launch",
                        lambda *args: launched.append(args) or launch(*args))
    seqlen_k = 90
    window = {"rows": seqlen_q, "most": seqlen_k - seqlen_q}.get(window, window)
    generator = torch.Generator().manual_seed(seqlen_q * 100 + window)
    bias = torch.randint(0, 4, (2, 3, 1, seqlen_k), generator=generator).double()
    bias[0, 0, 0, 3::7] = math.nan
    bias[0, 1, 0, 2::5] = math.inf
    bias[0, 2, 0, 1::3] = -0.0
    bias[1, 0, 0, ::4] = -math.inf
    bias[1, 1] = torch.randn(1, seqlen_k, generator=generator).double()
    bias = bias.to(dtype).to(device)
    rows = bias.reshape(6, seqlen_k)
    assert tk._few_rows_form(rows, window, seqlen_q, True, False)
    taken = []
    few_rows = tk._few_rows
    spy = lambda *args, **kwargs: taken.append(args) or few_rows(*args, **kwargs)  # noqa: E731
    # Called from the selection's entry (with the gather route's lists) or, on a GPU, inside
    # its CUDA graph's capture; a graph of this form kept from an earlier case (the other
    # finish) would replay without calling it.
    ops = importlib.import_module("kernels.topk_ops")
    monkeypatch.setattr(ops, "_graphs", type(ops._graphs)())
    for module in (tk, ops):
        monkeypatch.setattr(module, "_few_rows", spy)
    got = topk_intervals(bias, window, seqlen_q=seqlen_q, is_causal=True)
    assert taken and bool(launched) == (finish == "kernel")
    start, end = tk._intervals(rows, window, True, seqlen_q, None)
    assert torch.equal(got.start.reshape(6, seqlen_k), start.to(torch.int32))
    assert torch.equal(got.end.reshape(6, seqlen_k), end.to(torch.int32))
    expected = rule_mask(bias.cpu(), window, seqlen_q, True)
    assert torch.equal(got.to_dense(seqlen_q).cpu(), expected)


@pytest.mark.parametrize("seqlen_q", (2, 7, 16))
def test_few_rows_kernel_and_torch_ops_write_the_same_lists(seqlen_q, device, monkeypatch):
    """``_few_rows``' two finishes, from random shapes, ties, NaN and infinities, on strided
    bias rows: the same start, end, kept-key lists (every slot, the dropped later keys after
    the kept ones) and counts."""
    tk = importlib.import_module("kernels.masks.topk")
    generator = torch.Generator().manual_seed(seqlen_q)
    for seqlen_k, window in ((70, seqlen_q), (130, 33), (301, 280)):
        bias = torch.randint(-2, 3, (5, 2 * seqlen_k), generator=generator).float()
        bias[1] = torch.randn(2 * seqlen_k, generator=generator)
        bias[2, 3::5] = math.nan
        bias[3, 1::6] = math.inf
        bias[3, 2::6] = -math.inf
        rows = bias.to(device)[:, ::2]  # keys two elements apart
        outputs = []
        for kernel in (True, False):
            monkeypatch.setattr(tk, "FEW_ROWS_KERNEL", kernel)
            outputs.append(tk._few_rows(rows, window, seqlen_q, with_lists=True))
        (start, end, (kept, count)), (start_ops, end_ops, (kept_ops, count_ops)) = outputs
        assert torch.equal(start, start_ops) and torch.equal(end, end_ops)
        assert torch.equal(kept, kept_ops) and torch.equal(count, count_ops)
        assert kept.shape == (5, window + seqlen_q - 1)


@pytest.mark.parametrize("seqlen_q, window, seqlen_k, ordered", (
    (17, 40, 90, False),  # more rows than FEW_ROWS_MAX
    (5, 4, 90, False),  # a window smaller than the rows
    (5, 86, 90, False),  # a window of every key the first row sees
    (5, 40, 90, True),  # with a key order
), ids=("rows17", "window-under-rows", "window-all", "ordered"))
def test_other_causal_selections_take_the_general_path(seqlen_q, window, seqlen_k, ordered,
                                                       device):
    tk = importlib.import_module("kernels.masks.topk")
    rows = torch.randn(6, seqlen_k).to(device)
    assert not tk._few_rows_form(rows, window, seqlen_q, True, ordered)


@pytest.mark.parametrize("order_keys", [False, True])
def test_a_selection_bounds_the_keys_one_row_keeps(order_keys, device):
    """``topk_intervals`` notes W (at most Lk) as the most keys one row keeps
    (``KeyIntervals._row_kept``, read by the Hopper forward's route); it holds for every row,
    and a key order and the compiled op's mask keep it."""
    from kernels import ops
    from kernels.masks.key_order import reordered_intervals

    bias = torch.randn(2, 2, 1, 90, device=device)
    for window, causal in ((7, True), (12, False), (200, True)):
        chosen = topk_intervals(bias, window, seqlen_q=40, is_causal=causal,
                                order_keys=order_keys and window < 90)
        assert chosen._row_kept == min(window, 90)
        rows = chosen.to_dense(40)
        if causal:
            rows = rows & (torch.arange(90, device=device)
                           <= torch.arange(40, device=device)[:, None] + 50)
        assert int(rows.sum(-1).max()) <= chosen._row_kept
        if chosen.key_order is not None:
            assert reordered_intervals(chosen, 40, causal)._row_kept == chosen._row_kept
    carried = ops.host_mask(ops.operands_of(chosen, None), row_kept=chosen._row_kept)
    assert carried._row_kept == chosen._row_kept
