"""``dmbench compile-cost``: one row per first call at a length (and one for the warm-up), the
compile counts in them, --require-zero's exit code, and one-line errors for bad flags."""

from __future__ import annotations

import csv

import pytest
from typer.testing import CliRunner

from dmbench.cli import app
from dmbench.errors import ExitCode
from kernels.runtime import forms

runner = CliRunner()


@pytest.fixture(autouse=True)
def forms_of_a_fresh_process(monkeypatch):
    """The compiles counted as a fresh process counts them: forms that earlier tests in this
    worker compiled (the same tiny dims recur) would make the warm-up's count 0."""
    monkeypatch.setattr(forms, "_compiled_forms", set())


TINY = ["--heads", "4/2", "--head-dim", "16", "--dtype", "fp32",
        "--masks", "intervals", "--bias", "kv_row"]


def test_rows_and_zero_compiles_after_warmup(tmp_path, device):
    out = tmp_path / "cost.csv"
    result = runner.invoke(app, ["compile-cost", *TINY, "--device", device.type, "--lengths", "24,33,40",
                                 "--warmup", "--require-zero", "--out", str(out)])
    assert result.exit_code == ExitCode.OK, result.output
    rows = list(csv.DictReader(out.open()))
    assert [(row["step"], row["seqlen"]) for row in rows] == [
        ("warmup", "40"), ("call", "24"), ("call", "33"), ("call", "40")]
    assert int(rows[0]["compiled"]) > 0  # the warm-up compiled (or, here, recorded) kernels
    assert all(row["compiled"] == "0" for row in rows[1:])
    assert all(float(row["first_ms"]) > 0 and float(row["second_ms"]) > 0 for row in rows[1:])


def test_window_makes_the_interval_form_top_w(tmp_path, device):
    """--window: the interval form's calls and warm-up use topk_intervals of a per-key bias
    (below the ordering threshold here: plain top-W intervals), and its rows say so."""
    out = tmp_path / "cost.csv"
    result = runner.invoke(app, ["compile-cost", *TINY, "--device", device.type,
                                 "--lengths", "24,40", "--window", "8", "--warmup",
                                 "--require-zero", "--out", str(out)])
    assert result.exit_code == ExitCode.OK, result.output
    rows = list(csv.DictReader(out.open()))
    assert [(row["mask"], row["step"]) for row in rows] == [
        ("topk8", "warmup"), ("topk8", "call"), ("topk8", "call")]
    assert all(row["compiled"] == "0" for row in rows[1:])


def test_documents_make_two_packed_calls_per_length_and_compile_nothing_after_warmup(
        tmp_path, device):
    """--masks documents: each length's first call is two dmattn_varlen_func calls with new
    offsets (a model's first two layers: the packed mask built, then prepared), and after the
    warm-up no length compiles."""
    out = tmp_path / "cost.csv"
    flags = [flag if flag != "intervals" else "documents" for flag in TINY]
    result = runner.invoke(app, ["compile-cost", *flags, "--device", device.type,
                                 "--lengths", "24,33,40", "--warmup", "--require-zero",
                                 "--out", str(out)])
    assert result.exit_code == ExitCode.OK, result.output
    rows = list(csv.DictReader(out.open()))
    assert [(row["mask"], row["step"]) for row in rows] == [
        ("documents", "warmup")] + [("documents", "call")] * 3
    assert int(rows[0]["compiled"]) > 0
    assert all(row["compiled"] == "0" for row in rows[1:])


def test_query_rows_time_decode_steps_against_growing_caches(tmp_path, device):
    """--query-rows: each call is a decode step (one query row against a cache of the
    length, the top-W selection inside, forward only) and the warm-up makes the same steps:
    caches on both sides of the gather route's threshold (8 W here) compile nothing after it."""
    out = tmp_path / "cost.csv"
    result = runner.invoke(app, ["compile-cost", *TINY, "--device", device.type,
                                 "--lengths", "40,70,71,90", "--window", "8",
                                 "--query-rows", "1", "--warmup", "--require-zero",
                                 "--out", str(out)])
    assert result.exit_code == ExitCode.OK, result.output
    rows = list(csv.DictReader(out.open()))
    assert [(row["step"], row["seqlen"], row["query_rows"]) for row in rows] == [
        ("warmup", "90", "1"), ("call", "40", "1"), ("call", "70", "1"), ("call", "71", "1"),
        ("call", "90", "1")]
    assert int(rows[0]["compiled"]) > 0
    assert all(row["compiled"] == "0" for row in rows[1:])


def test_require_zero_fails_when_a_new_length_compiles(tmp_path, device):
    # Without a warm-up, 40 follows 32: the bias's head stride (the length) is a multiple of
    # 16 at 32 and not at 40, so 40's first call compiles the unaligned variant.
    # (head_dim 32: forms no other test in this process has compiled.)
    result = runner.invoke(app, ["compile-cost", *TINY, "--device", device.type,
                                 "--head-dim", "32", "--lengths", "32,40",
                                 "--require-zero",
                                 "--out", str(tmp_path / "cost.csv")])
    assert result.exit_code == ExitCode.PERF_REGRESSION, result.output
    assert "compiled" in result.output


def test_bad_flags_exit_2(tmp_path):
    for flags, named in ((["--lengths", "12,x"], "--lengths"), (["--masks", "dense"], "--masks"),
                         (["--heads", "3/2"], "--heads"), (["--heads", "16:4"], "--heads"), (["--heads", "0/4"], "--heads"), (["--bias", "none,kv_row"], "--bias"), (["--dtype", "fp8"], "--dtype"),
                         (["--window", "0"], "--window"), (["--masks", "bool", "--window", "8"], "--window"),
                         (["--query-rows", "0"], "--query-rows"), (["--query-rows", "17"], "--query-rows"),
                         (["--masks", "documents", "--query-rows", "1"], "--query-rows")):
        result = runner.invoke(app, ["compile-cost", *flags,
                                     "--out", str(tmp_path / "cost.csv")])
        assert result.exit_code == ExitCode.USAGE, (flags, result.output)
        assert named in result.output
