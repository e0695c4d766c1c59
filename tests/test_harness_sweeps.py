"""Sweep files: parsing, defaults, grids, explicit cases, and one-line errors naming file and key.

Also: every shipped sweep loads, and the FLOP model's causal pair count matches brute force.
"""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

import pytest

from dmbench.backends import BACKEND_NAMES
from dmbench.case import FULL_MASK_SHAPE, Case, parse_pair
from dmbench.errors import ConfigError
from dmbench.flops import causal_visible_pairs, dense_flops
from dmbench.sweep import Timing, load_sweep, sweep_digest

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "sweeps").glob("*.yaml"))


def _write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _load(tmp_path: Path, text: str):
    return load_sweep(_write(tmp_path, text), BACKEND_NAMES)


# -- valid files


def test_grid_is_cartesian_product(tmp_path):
    sweep = _load(tmp_path, """
        grid:
          batch: [1, 2]
          heads: ["4/2", 8]
          seqlen: [64, 128, 256]
          head_dim: 64
          causal: [true, false]
    """)
    assert len(sweep.cases) == 2 * 2 * 3 * 2
    assert not sweep.skipped
    assert len({c.case_id for c in sweep.cases}) == len(sweep.cases)
    combos = {(c.batch, c.heads_q, c.heads_kv, c.seqlen_q, c.causal) for c in sweep.cases}
    expected = set(itertools.product([1, 2], [(4, 2), (8, 8)], [64, 128, 256], [True, False]))
    assert combos == {(b, h[0], h[1], s, c) for b, h, s, c in expected}


def test_several_grids_and_cases_add_up(tmp_path):
    sweep = _load(tmp_path, """
        defaults: {batch: 1, head_dim: 32}
        grid:
          - {heads: [2, 4], seqlen: [16, 32]}
          - {heads: "8/1", seqlen: [16, 32, 48]}
        cases:
          - {heads: 2, seqlen: 100}
          - {heads: 2, seqlen: 16}
    """)
    # The second explicit case repeats a grid point and is kept once.
    assert len(sweep.cases) == 4 + 3 + 1


def test_heads_and_seqlen_forms(tmp_path):
    sweep = _load(tmp_path, """
        defaults: {batch: 1, head_dim: 64}
        cases:
          - {heads: "16/4", seqlen: "1/65536"}
          - {heads: {q: 16, kv: 4}, seqlen: {q: 1, k: 65536}}
          - {heads: 8, seqlen: 512}
    """)
    # Both spellings of the first case give the same Case, so it appears once.
    assert len(sweep.cases) == 2
    a = sweep.cases[0]
    assert (a.heads_q, a.heads_kv, a.seqlen_q, a.seqlen_k) == (16, 4, 1, 65536)
    c = sweep.cases[1]
    assert (c.heads_q, c.heads_kv, c.seqlen_q, c.seqlen_k) == (8, 8, 512, 512)


@pytest.mark.parametrize("text, pair", [("16/4", (16, 4)), (" 16 / 4 ", (16, 4)), ("0/4", (0, 4)),
                                        ("16", None), ("16/4/2", None), ("-1/4", None),
                                        ("a/4", None), ("/4", None), ("\u00b2/4", None)])
def test_parse_pair_is_the_one_parser_of_the_a_slash_b_form(text, pair):
    assert parse_pair(text) == pair


def test_heads_dict_in_a_grid_is_one_value(tmp_path):
    sweep = _load(tmp_path, """
        grid: {batch: 1, head_dim: 32, heads: {q: 8, kv: 2}, seqlen: [32, 64]}
    """)
    assert [(c.heads_q, c.heads_kv) for c in sweep.cases] == [(8, 2), (8, 2)]


def test_defaults(tmp_path):
    sweep = _load(tmp_path, """
        cases:
          - {batch: 1, heads: 2, seqlen: 8, head_dim: 16}
    """)
    (case,) = sweep.cases
    assert sweep.name == "s"  # the file stem
    assert case == Case(1, 2, 2, 8, 8, 16)
    assert (case.window, case.causal, case.dtype, case.mask, case.mask_shape, case.bias, case.seed) == (
        None, False, "bf16", "none", FULL_MASK_SHAPE, "none", 0)
    assert sweep.timing == Timing()
    assert sweep.check is False
    assert sweep.backends == tuple(b for b in ("triton", "sdpa", "sdpa-dense", "flex", "fdma", "fa4")
                                   if b in BACKEND_NAMES)


def test_defaults_section_and_overrides(tmp_path):
    sweep = _load(tmp_path, """
        name: mine
        backends: [reference, triton, reference]
        timing: {warmup: 0, repeats: 2, budget_s: 1}
        check: true
        defaults: {batch: 2, head_dim: 32, dtype: float16, causal: true, seed: 7}
        cases:
          - {heads: 2, seqlen: 8}
          - {heads: 2, seqlen: 8, dtype: fp32, causal: false, mask: topk, window: 4, bias: kv_row}
    """)
    a, b = sweep.cases
    assert sweep.name == "mine"
    assert sweep.backends == ("reference", "triton")
    assert sweep.timing == Timing(warmup=0, repeats=2, budget_s=1.0, flush_l2=True)
    assert sweep.check is True
    assert (a.batch, a.dtype, a.causal, a.seed) == (2, "fp16", True, 7)
    assert (b.dtype, b.causal, b.mask, b.window, b.bias) == ("fp32", False, "topk", 4, "kv_row")
    assert b.bias_shape == "BxHkx1xLk"


def test_window_dropped_without_window_mask(tmp_path):
    sweep = _load(tmp_path, """
        cases: [{batch: 1, heads: 2, seqlen: 8, head_dim: 16, window: 4}]
    """)
    assert sweep.cases[0].window is None


def test_impossible_grid_points_are_skipped_with_reason(tmp_path):
    sweep = _load(tmp_path, """
        grid: {batch: 1, head_dim: 16, seqlen: 8, heads: ["4/2", "6/4"]}
    """)
    assert len(sweep.cases) == 1 and len(sweep.skipped) == 1
    assert "multiple" in sweep.skipped[0].reason
    assert sweep.skipped[0].case.heads_q == 6


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_sweeps_load(path):
    sweep = load_sweep(path, BACKEND_NAMES)
    assert sweep.cases
    assert set(sweep.backends) <= set(BACKEND_NAMES)


def test_rounds_share_out_repeats_and_budget(tmp_path):
    sweep = _load(tmp_path, f"timing: {{warmup: 2, repeats: 20, budget_s: 3.0, rounds: 3}}\n"
                            f"cases: [{{{BASE}}}]\n")
    assert sweep.timing.rounds == 3
    # Each round warms up again, takes a third of the repeats (rounded up) and of the budget.
    assert sweep.timing.per_round() == Timing(warmup=2, repeats=7, budget_s=1.0, rounds=1)
    assert Timing(repeats=5).per_round() == Timing(repeats=5)


@pytest.mark.parametrize("value, expected", [("true", True), ("false", False), (None, False)])
def test_timing_cuda_graph_is_read_and_changes_the_digest(tmp_path, value, expected):
    timing = "" if value is None else f"timing: {{cuda_graph: {value}}}\n"
    sweep = _load(tmp_path, f"{timing}cases: [{{{BASE}}}]\n")
    assert sweep.timing.cuda_graph is expected
    assert sweep.timing.kind == ("cuda_graph" if expected else "eager")
    eager = _load(tmp_path, f"cases: [{{{BASE}}}]\n")
    assert (sweep_digest(sweep) != sweep_digest(eager)) is expected
    assert sweep.timing.per_round() == sweep.timing  # rounds: 1


@pytest.mark.parametrize("value", ["1", "'true'", "[true]", "null"])
def test_timing_cuda_graph_takes_true_or_false_only(tmp_path, value):
    path = _write(tmp_path, f"timing: {{cuda_graph: {value}}}\ncases: [{{{BASE}}}]\n")
    with pytest.raises(ConfigError) as info:
        load_sweep(path, BACKEND_NAMES)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    assert "timing.cuda_graph: expected true or false" in message


def test_smoke_sweep_is_present():
    assert REPO / "sweeps" / "smoke.yaml" in SHIPPED


# -- errors: ConfigError, one line, naming the file and the key

BASE = "batch: 1, heads: 2, seqlen: 8, head_dim: 16"


@pytest.mark.parametrize("text, key", [
    (f"cases: [{{{BASE}, colour: red}}]", "colour"),
    (f"bogus: 1\ncases: [{{{BASE}}}]", "bogus"),
    (f"defaults: {{colour: red}}\ncases: [{{{BASE}}}]", "colour"),
    (f"timing: {{warmpu: 1}}\ncases: [{{{BASE}}}]", "warmpu"),
    ("cases: [{batch: 1, heads: 2, seqlen: 8, head_dim: 16, dtype: fp8}]", "dtype"),
    ("cases: [{batch: 1, heads: 2, seqlen: 8, head_dim: 300}]", "head_dim"),
    ("cases: [{batch: 1, heads: '5/2', seqlen: 8, head_dim: 16}]", "cases[0]"),
    ("cases: [{batch: 1, heads: '5/x', seqlen: 8, head_dim: 16}]", "heads"),
    ("cases: [{batch: 1, heads: {q: 4}, seqlen: 8, head_dim: 16}]", "heads"),
    ("cases: [{batch: 1, heads: 2, seqlen: '1/0', head_dim: 16}]", "seqlen"),
    ("cases: [{batch: 0, heads: 2, seqlen: 8, head_dim: 16}]", "batch"),
    ("cases: [{batch: 1, heads: 2, seqlen: 8, head_dim: 16, causal: maybe}]", "causal"),
    ("cases: [{batch: 1, heads: 2, seqlen: 8, head_dim: 16, mask: diagonal}]", "mask"),
    ("cases: [{batch: 1, heads: 2, seqlen: 8, head_dim: 16, bias: huge}]", "bias"),
    ("cases: [{batch: 1, heads: 2, seqlen: 8, head_dim: 16, mask: topk}]", "cases[0]"),
    ("cases: [{batch: 1, heads: 2, seqlen: 8, head_dim: 16, seed: -1}]", "seed"),
    ("cases: [{batch: 1, heads: 2, seqlen: 8}]", "head_dim"),
    (f"backends: [triton, cudnn]\ncases: [{{{BASE}}}]", "backends"),
    (f"timing: {{repeats: 0}}\ncases: [{{{BASE}}}]", "repeats"),
    (f"timing: {{rounds: 0}}\ncases: [{{{BASE}}}]", "rounds"),
    ("grid: {batch: [], heads: 2, seqlen: 8, head_dim: 16}", "batch"),
    ("name: x", "grid"),
])
def test_bad_values_name_file_and_key(tmp_path, text, key):
    path = _write(tmp_path, text + "\n", name="broken_sweep.yaml")
    with pytest.raises(ConfigError) as info:
        load_sweep(path, BACKEND_NAMES)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message
    assert key in message


def test_bad_dtype_says_what_was_expected(tmp_path):
    path = _write(tmp_path, "cases: [{batch: 1, heads: 2, seqlen: 8, head_dim: 16, dtype: fp8}]\n")
    with pytest.raises(ConfigError, match=r"cases\[0\]\.dtype: expected one of bf16, fp16, fp32, got 'fp8'"):
        load_sweep(path, BACKEND_NAMES)


DEFAULTS = "defaults: {batch: 1, heads: 2, seqlen: 8, head_dim: 16}"


@pytest.mark.parametrize("text, key", [
    ("defaults: {batch: 1, heads: 2, seqlen: 8, head_dim: 300}\ngrid: {dtype: [bf16, fp16]}", "defaults.head_dim"),
    ("defaults: {batch: 1, heads: 2, seqlen: 8, head_dim: 300}\ncases: [{dtype: bf16}]", "defaults.head_dim"),
    ("defaults: {batch: 1, heads: 2, seqlen: '8/x', head_dim: 16}\ncases: [{dtype: bf16}]", "defaults.seqlen"),
    ("defaults: {batch: 1, heads: {q: 4, kv: 0}, seqlen: 8, head_dim: 16}\ngrid: {dtype: bf16}", "defaults.heads.kv"),
    (f"{DEFAULTS[:-1]}, causal: maybe}}\ngrid: {{seed: [1, 2]}}", "defaults.causal"),
    (f"{DEFAULTS[:-1]}, dtype: fp8}}\ncases: [{{seed: 1}}]", "defaults.dtype"),
    (f"{DEFAULTS[:-1]}, mask: diagonal}}\ncases: [{{seed: 1}}]", "defaults.mask"),
    (f"{DEFAULTS[:-1]}, bias: huge}}\ncases: [{{seed: 1}}]", "defaults.bias"),
    (f"{DEFAULTS[:-1]}, seed: -1}}\ncases: [{{dtype: bf16}}]", "defaults.seed"),
    (f"{DEFAULTS[:-1]}, mask: topk, window: 0}}\ncases: [{{seed: 1}}]", "defaults.window"),
    (f"{DEFAULTS}\ngrid: {{head_dim: [16, 300]}}", "grid.head_dim"),
    (f"{DEFAULTS}\ncases: [{{seed: 1}}, {{dtype: fp8}}]", "cases[1].dtype"),
])
def test_bad_values_name_the_section_they_are_in(tmp_path, text, key):
    path = _write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as info:
        load_sweep(path, BACKEND_NAMES)
    message = str(info.value)
    assert message.startswith(f"{path}: {key}: "), message
    assert "\n" not in message


def test_head_dim_limit(tmp_path):
    path = _write(tmp_path, "cases: [{batch: 1, heads: 2, seqlen: 8, head_dim: 300}]\n")
    with pytest.raises(ConfigError, match=r"head_dim: expected at most 256, got 300"):
        load_sweep(path, BACKEND_NAMES)
    # 256 itself is fine.
    path.write_text("cases: [{batch: 1, heads: 2, seqlen: 8, head_dim: 256}]\n")
    assert load_sweep(path, BACKEND_NAMES).cases[0].head_dim == 256


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_sweep(path, BACKEND_NAMES)
    assert str(path) in str(info.value) and "not found" in str(info.value)


def test_a_directory_is_not_a_sweep(tmp_path):
    with pytest.raises(ConfigError, match="is a directory; expected a sweep YAML file"):
        load_sweep(tmp_path, BACKEND_NAMES)


def test_bad_yaml(tmp_path):
    path = _write(tmp_path, "grid: {batch: [1, 2\ncases: : :\n", name="bad.yaml")
    with pytest.raises(ConfigError) as info:
        load_sweep(path, BACKEND_NAMES)
    message = str(info.value)
    assert str(path) in message and "invalid YAML" in message and "\n" not in message


DUPLICATES = [  # (sweep text, line of the second key, the key, line of the first)
    ("name: a\ncases: []\nname: b\n", 3, "name", 1),
    ("timing: {warmup: 1, repeats: 3, warmup: 2}\ncases: []\n", 1, "warmup", 1),
    ("grid:\n  - seqlen: 8\n    head_dim: 16\n    seqlen: 16\n", 4, "seqlen", 2),
    ("defaults:\n  heads: {q: 4, kv: 2, q: 8}\n", 2, "q", 2),
]


@pytest.mark.parametrize("text, line, key, first", DUPLICATES)
def test_a_duplicate_key_at_any_depth_is_refused(tmp_path, text, line, key, first):
    path = _write(tmp_path, text, name="dup.yaml")
    with pytest.raises(ConfigError) as info:
        load_sweep(path, BACKEND_NAMES)
    assert str(info.value) == (f"{path}: invalid YAML (line {line}): duplicate key {key!r} "
                               f"(first on line {first})")


def test_merge_keys_still_override(tmp_path):
    sweep = _load(tmp_path, """
        defaults: &base {batch: 1, heads: 2, seqlen: 8, head_dim: 16}
        cases:
          - {<<: *base, seqlen: 16}
    """)
    assert [c.seqlen_q for c in sweep.cases] == [16]


def test_the_cli_refuses_a_duplicate_key_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from dmbench.cli import app
    from dmbench.errors import ExitCode

    sweep = _write(tmp_path, DUPLICATES[2][0] + "backends: [reference]\n", name="dup.yaml")
    out = tmp_path / "out.csv"
    result = CliRunner().invoke(app, ["fwd", str(sweep), "--device", "cpu", "--out", str(out),
                                      "--no-plot", "--no-progress"])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert result.output.strip().splitlines() == [
        f"error: {sweep}: invalid YAML (line 4): duplicate key 'seqlen' (first on line 2)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dup.yaml"]


# -- name: a plain file name (it names results/<gpu>/<name>-<command>.csv and the charts)

CASE = "cases: [{batch: 1, heads: 2, seqlen: 8, head_dim: 16}]\n"


@pytest.mark.parametrize("name, why", [
    ("'../../escape'", "contains '/'"), ("/abs/path", "contains '/'"), ("a/b", "contains '/'"),
    ("'a\\b'", "contains '\\'"), ("'..'", "is '..'"), ("'.'", "is '.'"),
    ("''", "is empty"), ('"a\\0b"', "a NUL character"), ("[a]", "got ['a']"),
])
def test_name_must_be_a_plain_file_name(tmp_path, name, why):
    path = _write(tmp_path, f"name: {name}\n{CASE}")
    with pytest.raises(ConfigError) as info:
        load_sweep(path, BACKEND_NAMES)
    message = str(info.value)
    assert message.startswith(f"{path}: name: expected a plain file name"), message
    assert why in message and "\n" not in message


@pytest.mark.parametrize("file_name", ["...yaml", "a\\b.yaml"])
def test_a_file_stem_that_is_no_plain_file_name_needs_a_name(tmp_path, file_name):
    path = _write(tmp_path, CASE, name=file_name)
    with pytest.raises(ConfigError) as info:
        load_sweep(path, BACKEND_NAMES)
    assert str(info.value).startswith(f"{path}: name: absent, so the file stem"), str(info.value)
    path.write_text(f"name: fine\n{CASE}")
    assert load_sweep(path, BACKEND_NAMES).name == "fine"


@pytest.mark.parametrize("name", ["window", "a.b", "..a", "x-1_2 3", "é"])
def test_plain_names_are_kept(tmp_path, name):
    assert _load(tmp_path, f"name: '{name}'\n{CASE}").name == name


# -- heads whose q is not a multiple of kv: an error wherever the value reaches only such points

GQA_RULE = "heads q (3) must be a multiple of kv (2)"


@pytest.mark.parametrize("text, key, written", [
    ('defaults: {batch: 1, heads: "3/2", seqlen: 8, head_dim: 16}\ngrid: {seqlen: [8, 16]}',
     "defaults.heads", '"3/2"'),
    ('defaults: {batch: 1, heads: {q: 3, kv: 2}, seqlen: 8, head_dim: 16}\ncases: [{seed: 1}]',
     "defaults.heads", "{q: 3, kv: 2}"),
    ('defaults: {batch: 1, seqlen: 8, head_dim: 16}\ncases: [{heads: 2}, {heads: "3/2"}]',
     "cases[1].heads", '"3/2"'),
    ('defaults: {batch: 1, seqlen: 8, head_dim: 16}\ngrid: {heads: "3/2", seed: [1, 2]}',
     "grid.heads", '"3/2"'),
    ('defaults: {batch: 1, seqlen: 8, head_dim: 16}\n'
     'grid: [{heads: 2}, {heads: {q: 3, kv: 2}, seed: [1, 2]}]', "grid[1].heads", "{q: 3, kv: 2}"),
])
def test_heads_that_cannot_run_are_refused_where_written(tmp_path, text, key, written):
    path = _write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as info:
        load_sweep(path, BACKEND_NAMES)
    assert str(info.value) == f"{path}: {key}: {written}: {GQA_RULE}"


def test_a_sweep_whose_every_point_is_skipped_is_refused(tmp_path):
    path = _write(tmp_path, 'defaults: {batch: 1, seqlen: 8, head_dim: 16}\n'
                            'grid: {heads: ["3/2", "5/2"]}\n')
    with pytest.raises(ConfigError) as info:
        load_sweep(path, BACKEND_NAMES)
    assert str(info.value) == f"{path}: grid.heads: no point of the sweep can run: {GQA_RULE}"
    path.write_text("defaults: {batch: 1, heads: 2, seqlen: 8, head_dim: 16}\n"
                    "grid: {mask: topk, seed: [1, 2]}\n")
    with pytest.raises(ConfigError, match=r": grid: no point of the sweep can run: mask topk needs a window$"):
        load_sweep(path, BACKEND_NAMES)


def test_a_mixed_heads_axis_still_skips_its_bad_points(tmp_path):
    sweep = _load(tmp_path, """
        defaults: {batch: 1, seqlen: 8, head_dim: 16}
        grid: {heads: ["4/2", "3/2"], seed: [1, 2]}
    """)
    assert {(c.heads_q, c.seed) for c in sweep.cases} == {(4, 1), (4, 2)}
    assert [s.reason for s in sweep.skipped] == [GQA_RULE, GQA_RULE]


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "just a string\n", ""])
def test_top_level_not_a_mapping(tmp_path, text):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=str(path).replace(".", r"\.")):
        load_sweep(path, BACKEND_NAMES)


# -- the FLOP model


def _brute_causal(lq: int, lk: int) -> int:
    offset = lk - lq
    return sum(1 for i in range(lq) for j in range(lk) if j <= i + offset)


@pytest.mark.parametrize("a, b", list(itertools.product((1, 5, 17), (1, 7, 33))))
def test_causal_visible_pairs_brute_force(a, b):
    assert causal_visible_pairs(a, b) == _brute_causal(a, b)
    assert causal_visible_pairs(b, a) == _brute_causal(b, a)


def test_causal_visible_pairs_square_and_edges():
    for n in (1, 2, 3, 64, 100):
        assert causal_visible_pairs(n, n) == n * (n + 1) // 2
    assert causal_visible_pairs(1, 65536) == 65536  # decode sees every key
    assert causal_visible_pairs(10, 3) == _brute_causal(10, 3)


def test_dense_flops_modes():
    case = Case(2, 4, 2, 16, 32, 64)
    fwd = 4.0 * 2 * 4 * 16 * 32 * 64
    assert dense_flops(case, "fwd") == fwd
    assert dense_flops(case, "bwd") == 2.5 * fwd
    assert dense_flops(case, "fwd+bwd") == 3.5 * fwd
    causal = Case(2, 4, 2, 16, 32, 64, causal=True)
    assert dense_flops(causal, "fwd") == 4.0 * 2 * 4 * _brute_causal(16, 32) * 64
