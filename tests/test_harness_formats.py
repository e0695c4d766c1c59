"""Mask formats (bool, intervals, varlen) and the document kind: sweep keys and their errors,
the documents' draw, the same mask in every format, the backends on every format against the
fp64 reference, the mask's build steps, and the memory skip of dense-mask backends."""

from __future__ import annotations

import statistics
import textwrap
from dataclasses import replace

import pytest
import torch

from dmbench.backends import BACKEND_NAMES, make_backends
from dmbench.backends.torch_ops import FlexBackend
from dmbench.case import Case
from dmbench.documents import DOCUMENT_RANGE, Documents, case_documents, draw_lengths
from dmbench.errors import ConfigError
from dmbench.mask_views import dense_mask, kept_pairs
from dmbench.masks import causal_rows
from dmbench.problem import make_problem
from dmbench.sweep import load_sweep

CPU = torch.device("cpu")
FORMATS = ("bool", "intervals", "varlen")


def _load(tmp_path, text: str):
    path = tmp_path / "s.yaml"
    path.write_text(textwrap.dedent(text))
    return load_sweep(path, BACKEND_NAMES)


def _case(mask: str, fmt: str = "bool", causal: bool = True, bias: str = "none", lq: int = 21,
          lk: int = 37, window: int | None = 9, dtype: str = "fp32", **extra) -> Case:
    return Case(2, 4, 2, lq, lk, 16, window, causal, dtype, mask, bias=bias, seed=5,
                mask_format=fmt, **extra)


# -- sweep keys


def test_mask_format_and_documents_parse(tmp_path):
    sweep = _load(tmp_path, """
        defaults: {batch: 1, heads: "4/2", seqlen: 64, head_dim: 16, causal: true}
        grid:
          - {mask: topk, window: 8, bias: [kv_row, none], mask_format: [bool, intervals]}
          - {mask: document, window: 32, mask_format: [bool, intervals, varlen]}
        cases:
          - {mask: document, documents: [0, 1, 63, 0], mask_format: varlen, bias: kv_row}
    """)
    assert len(sweep.cases) == 4 + 3 + 1
    assert {c.mask_format for c in sweep.cases} == set(FORMATS)
    explicit = sweep.cases[-1]
    assert explicit.documents == (0, 1, 63, 0) and explicit.window is None
    ids = [c.case_id for c in sweep.cases]
    assert len(set(ids)) == len(ids)
    assert "document[0,1,63,0]:varlen" in explicit.case_id
    # The bool format keeps the case ids that existed before mask formats.
    assert sweep.cases[0].case_id == "B1-H4/2-Lq64-Lk64-D16-W8-causal-bf16-topk-kv_row-s0"


BASE = "batch: 1, heads: 2, seqlen: 16, head_dim: 16"


@pytest.mark.parametrize("case, key, words", [
    ("mask: random, mask_format: intervals", "mask_format", "expresses masks topk"),
    ("mask: topk, window: 4, mask_format: varlen", "mask_format", "expresses masks document"),
    ("mask: block_topk, window: 4, mask_format: intervals", "mask_format", "got mask block_topk"),
    ("mask: topk, window: 4, bias: q_full, mask_format: intervals", "mask_format", "kv_row"),
    ("mask: document, window: 4, bias: kv_full, mask_format: varlen", "mask_format", "per key"),
    ("mask: none, mask_format: intervals", "mask_format", "got mask none"),
    ("mask: topk, window: 4, mask_format: dense", "mask_format", "bool, intervals, varlen"),
    ("mask: topk, window: 4, documents: [16]", "documents", "needs mask document"),
    ("mask: document, documents: [8, -1, 9]", "documents", "non-negative integers"),
    ("mask: document, documents: []", "documents", "non-negative integers"),
    ("mask: document, documents: [8, 9]", "cases[0]", "sum to 17"),
    ("mask: document", "cases[0]", "needs a window (the longest document) or documents"),
    ("mask: document, window: 4, seqlen: '8/16'", "cases[0]", "seqlen q and k must be equal"),
])
def test_bad_format_combinations_name_the_key(tmp_path, case, key, words):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, f"defaults: {{{BASE}}}\ncases: [{{{case}}}]\n")
    message = str(info.value)
    assert "\n" not in message and f"{key}" in message and words in message, message


def test_a_bad_combination_in_a_grid_is_an_error_too(tmp_path):
    with pytest.raises(ConfigError, match=r"grid\.mask_format: mask_format intervals"):
        _load(tmp_path, f"grid: {{{BASE}, mask: [topk, random], window: 4, "
                        "mask_format: intervals}\n")


# -- documents


@pytest.mark.parametrize("seqlen, longest", ((37, 12), (4096, 512), (1000, 1), (50, 1000)))
def test_drawn_lengths_fill_the_row_within_the_range(seqlen, longest):
    lengths = draw_lengths(seqlen, longest, torch.Generator().manual_seed(3))
    top = min(longest, seqlen)
    assert sum(lengths) == seqlen
    assert all(1 <= n <= top for n in lengths)
    assert all(n >= max(1, top // DOCUMENT_RANGE) for n in lengths[:-1])  # the last one is cut


def test_drawn_mix_has_many_short_documents_and_few_long_ones():
    """Log-uniform over [W / 64, W]: median W / 8, mean (W - W / 64) / ln 64, about W / 4.2;
    3 of 5 documents under W / 5, one in 19 over 4 W / 5."""
    lengths = draw_lengths(1 << 20, 8192, torch.Generator().manual_seed(0))[:-1]
    assert statistics.median(lengths) == pytest.approx(8192 / 8, rel=0.1)
    assert statistics.mean(lengths) == pytest.approx(8192 * 63 / 64 / 4.1589, rel=0.1)
    longest_fifth = sum(n > 8192 * 4 // 5 for n in lengths)
    shortest_fifth = sum(n < 8192 // 5 for n in lengths)
    assert shortest_fifth > 5 * longest_fifth > 0


def test_documents_are_seeded_per_case_and_differ_per_row():
    case = _case("document", lq=300, lk=300, window=64)
    a, b = case_documents(case), case_documents(case)
    assert a == b and a.lengths[0] != a.lengths[1]
    assert case_documents(replace(case, seed=6)) != a


def test_explicit_documents_with_empty_ones_in_every_form():
    docs = Documents(9, ((0, 1, 5, 0, 3, 0), (9,)))
    layout = docs.packed(CPU)
    assert layout.cu_seqlens.tolist() == [0, 0, 1, 6, 6, 9, 9, 18] and layout.max_seqlen == 9
    assert docs.ids(CPU).tolist() == [[1, 2, 2, 2, 2, 2, 4, 4, 4], [6] * 9]
    start, end = docs.bounds(CPU)
    assert start[0].tolist() == [0, 1, 1, 1, 1, 1, 6, 6, 6]
    assert end[0].tolist() == [1, 6, 6, 6, 6, 6, 9, 9, 9]
    rows = torch.arange(9)
    for causal in (True, False):
        dense = docs.intervals(causal, CPU).to_dense(9)
        assert torch.equal(dense, docs.rows(rows, causal))
        expect = start[:, :, None] == start[:, None, :]
        if causal:
            expect &= torch.ones(9, 9, dtype=torch.bool).tril()
        assert torch.equal(dense[:, 0], expect)


# -- the same mask in every format


@pytest.mark.parametrize("mask, bias, lengths", [
    ("topk", "kv_row", (21, 37)), ("topk", "none", (37, 21)), ("sliding", "none", (21, 37)),
    ("sliding", "kv_row", (37, 37)), ("document", "kv_row", (37, 37)),
])
@pytest.mark.parametrize("causal", (True, False))
def test_intervals_are_the_bool_mask(mask, bias, lengths, causal):
    """fp32 scores have no ties, so topk_intervals and torch.topk keep the same keys."""
    base = _case(mask, "bool", causal, bias, *lengths)
    dense = make_problem(base, CPU).mask
    intervals = make_problem(replace(base, mask_format="intervals"), CPU).mask
    expanded = dense_mask(base, intervals)
    visible = causal_rows(torch.arange(base.seqlen_q), base)
    assert torch.equal(expanded.expand_as(dense) & visible, dense & visible)
    assert kept_pairs(base, intervals) == kept_pairs(base, dense) > 0


def test_varlen_problem_has_the_packed_layout_and_the_documents_intervals():
    case = _case("document", "varlen", lq=37, lk=37, window=12, bias="kv_row")
    p = make_problem(case, CPU, time_build=True)
    lengths = [n for row in p.documents.lengths for n in row]
    assert p.packed.cu_seqlens.tolist() == torch.tensor([0] + lengths).cumsum(0).tolist()
    assert p.packed.max_seqlen == max(lengths)
    bool_mask = make_problem(replace(case, mask_format="bool"), CPU).mask
    assert torch.equal(dense_mask(case, p.mask), bool_mask)
    assert p.mask_build.name == "cu_seqlens" and p.mask_build.ms >= 0


# -- backends on every format, against the fp64 reference


def _checked(backend, problem, with_grad=True):
    from dmbench.accuracy import check_backend, ground_truth

    result = check_backend(backend, problem, ground_truth(problem, with_grad), with_grad)
    assert result.passed, (problem.case.case_id, result.error, result.failures())
    return result


@pytest.mark.interpreter
def test_every_format_of_one_document_case_gives_the_same_numbers():
    """Ours through dmattn_func (bool, intervals) and dmattn_varlen_func (varlen), sdpa and the
    eager reference on the dense expansion: each within the rule, and ours alike in all three."""
    backends = make_backends()
    case = _case("document", lq=45, lk=45, window=16, bias="kv_row", dtype="bf16",
                 documents=(0, 1, 7, 0, 20, 1, 16, 0), causal=True)
    ours = {}
    for fmt in FORMATS:
        problem = make_problem(replace(case, mask_format=fmt), CPU)
        for name in ("sdpa", "reference"):
            _checked(backends[name], problem)
        ours[fmt] = _checked(backends["triton"], problem).checks
    assert set(ours["varlen"]) == {"out", "lse", "dq", "dk", "dv", "dbias"}
    for name, check in ours["bool"].items():
        for fmt in ("intervals", "varlen"):
            assert ours[fmt][name].error == pytest.approx(check.error, rel=0.1, abs=1e-2), name


@pytest.mark.parametrize("case", [
    _case("topk", "intervals", bias="kv_row", dtype="bf16"),
    _case("topk", "intervals", causal=False, lq=37, lk=21),
    _case("sliding", "intervals", lq=37, lk=37, window=1, bias="kv_row"),
], ids=lambda c: c.case_id)
@pytest.mark.interpreter
def test_ours_on_intervals(case):
    _checked(make_backends()["triton"], make_problem(case, CPU))


@pytest.mark.parametrize("case", [
    _case("topk", "intervals", bias="kv_row", dtype="bf16", lq=1, lk=200, window=12),
    _case("topk", "intervals", bias="kv_row", lq=4, lk=97),
], ids=lambda c: c.case_id)
@pytest.mark.interpreter
def test_ours_with_the_selection_inside_the_call(case):
    """triton-select: the selection of the call's own bias inside the timed call, checked
    against the reference on the case's mask (the same intervals), gradients too."""
    _checked(make_backends()["triton-select"], make_problem(case, CPU))


@pytest.mark.parametrize("case", [_case("topk", "bool", bias="kv_row"),
                                  _case("topk", "intervals"),
                                  _case("sliding", "intervals", bias="kv_row")],
                         ids=lambda c: c.case_id)
def test_the_selection_inside_the_call_skips_other_masks_naming_them(case):
    reason = make_backends()["triton-select"].skip_reason(case)
    assert reason and "mask topk, mask_format intervals and bias kv_row only" in reason


@pytest.mark.parametrize("case", [
    _case("topk", "bool", bias="kv_row", dtype="bf16", lq=1, lk=200, window=12),
    _case("sliding", "bool", lq=33, lk=40),
], ids=lambda c: c.case_id)
@pytest.mark.interpreter
def test_ours_with_the_bool_mask_passed_on_every_call(case):
    """triton-per-call: the bool mask as the case makes it, unprepared, read by every call;
    checked against the reference, gradients too, with no build step."""
    backend = make_backends()["triton-per-call"]
    assert backend.skip_reason(case) is None
    problem = make_problem(case, CPU)
    assert backend.bind(backend.adapt(problem), case, want_lse=False).build is None
    _checked(backend, problem)


@pytest.mark.parametrize("case", [_case("topk", "intervals"), _case("none")],
                         ids=lambda c: c.case_id)
def test_the_per_call_mask_skips_cases_without_a_bool_mask_naming_them(case):
    reason = make_backends()["triton-per-call"].skip_reason(case)
    assert reason and "mask_format bool only" in reason


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("mask, fmt", [("topk", "intervals"), ("sliding", "intervals"),
                                       ("document", "intervals"), ("document", "varlen"),
                                       ("document", "bool")])
def test_flex_mask_mods_match_the_reference(mask, fmt):
    """flex's mask_mods (over start/end, over document ids) run eagerly on the CPU; flex has no
    CPU backward, so the forward is checked."""
    from dmbench.accuracy import ground_truth
    from kernels.tolerance import check_tensor

    lengths = (37, 37) if mask == "document" else (21, 37)
    case = _case(mask, fmt, True, "kv_row", *lengths, window=12)
    problem = make_problem(case, CPU)
    truth = ground_truth(problem, with_grad=False)
    flex = FlexBackend(compiled=False)
    out, lse = flex.bind(flex.adapt(problem), case, want_lse=True).call()
    for name, tensor in (("out", out), ("lse", lse)):
        check = check_tensor(name, tensor, truth.reference.tensors[name],
                             truth.eager.tensors[name], torch.float32)
        assert check.passed, check.describe()


# -- build steps and memory


@pytest.mark.parametrize("fmt, backend, steps", [
    ("bool", "triton", ["torch.topk+scatter", "prepare_mask"]),
    ("intervals", "triton", ["topk_intervals"]),
    ("intervals", "sdpa", ["topk_intervals", "float mask"]),
    ("intervals", "reference", ["topk_intervals", "dense expansion"]),
    ("intervals", "sdpa-dense", []),
])
@pytest.mark.interpreter
def test_build_steps_are_the_masks_and_the_backends(fmt, backend, steps):
    from dmbench.runner import _timed_call

    case = _case("topk", fmt, bias="kv_row", lq=8, lk=8, window=3)
    problem = make_problem(case, CPU, time_build=True)
    _, setup = _timed_call(make_backends()[backend], problem, "fwd")
    assert [s.name for s in setup.steps] == steps
    assert all(s.ms >= 0 for s in setup.steps)


def test_dense_backends_are_skipped_where_their_tensors_cannot_fit(monkeypatch):
    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    cuda = torch.device("cuda")
    backends = make_backends()
    case = Case(1, 16, 4, 65536, 65536, 128, 2048, True, "bf16", "topk", bias="kv_row",
                mask_format="intervals")
    assert backends["sdpa"].dense_bytes(case, "fwd") == 16 * 65536**2 * 2
    reason = backends["sdpa"].memory_reason(case, "fwd", cuda)
    assert "128.0 GiB" in reason and "80.0 GiB" in reason and "\n" not in reason
    small = replace(case, seqlen_q=16384, seqlen_k=16384)
    assert backends["sdpa"].memory_reason(small, "bwd", cuda) is None
    for name in ("triton", "flex", "sdpa-dense"):
        assert backends[name].memory_reason(case, "bwd", cuda) is None
    assert backends["sdpa"].memory_reason(case, "fwd", CPU) is None


def test_a_wrong_inference_forward_fails_the_check_by_name():
    """The check runs the forward again without autograd (ours may take another route there)
    and fails a case whose inference output is wrong, naming that pass."""
    from dmbench.accuracy import check_backend, ground_truth
    from dmbench.backends import Bound

    class WrongWithoutGrad(type(make_backends()["reference"])):
        def bind(self, adapted, case, want_lse):
            bound = super().bind(adapted, case, want_lse)

            def call():
                out, lse = bound.call()
                return (out, lse) if torch.is_grad_enabled() else (out + 1, lse)

            return Bound(call)

    problem = make_problem(_case("topk", bias="kv_row"), CPU)
    result = check_backend(WrongWithoutGrad(), problem, ground_truth(problem, True), True)
    assert not result.passed
    assert any(f.startswith("out (inference)") for f in result.failures())
