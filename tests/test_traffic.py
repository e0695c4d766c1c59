"""`dmbench.traffic`: the compulsory bytes of a call, counted by hand on small cases."""

from __future__ import annotations

import pytest

from dmbench.case import Case
from dmbench.results import new_row, row_case
from dmbench.traffic import PEAK_RATES, compulsory_bytes, gbps

# B1, Hq 2, Hk 1, Lq 4, Lk 8, D16 in bf16: q (and out, dout, dq) 1*2*4*16*2 = 256 bytes each;
# k (and v, dk, dv) 1*1*8*16*2 = 256 each; lse 1*2*4*4 = 32.
SMALL = dict(batch=1, heads_q=2, heads_kv=1, seqlen_q=4, seqlen_k=8, head_dim=16)
FORWARD = 256 + 2 * 256 + 256 + 32  # read q, k, v; write out, lse
BACKWARD = 3 * 256 + 2 * 256 + 32 + 256 + 2 * 256  # read q, out, dout, k, v, lse; write dq, dk, dv


def test_no_mask_no_bias_counts_inputs_and_outputs_once():
    case = Case(**SMALL)
    assert compulsory_bytes(case, "fwd") == FORWARD
    assert compulsory_bytes(case, "bwd") == BACKWARD
    assert compulsory_bytes(case, "fwd+bwd") == FORWARD + BACKWARD


def test_fp32_doubles_the_tensors_but_not_the_lse():
    case = Case(**SMALL, dtype="fp32")
    assert compulsory_bytes(case, "fwd") == 2 * (FORWARD - 32) + 32


def test_a_bias_is_read_in_both_passes_and_its_gradient_written_once():
    case = Case(**SMALL, bias="kv_row")  # (B, Hk, 1, Lk): 8 bf16 values, 16 bytes
    assert compulsory_bytes(case, "fwd") == FORWARD + 16
    assert compulsory_bytes(case, "bwd") == BACKWARD + 2 * 16


@pytest.mark.parametrize("mask_format, mask_bytes", [
    ("bool", 1 * 1 * 4 * 8),  # (B, Hk, Lq, Lk) bytes
    ("intervals", 1 * 1 * 8 * 8),  # topk intervals per (B, Hk, key): two int32
])
def test_the_mask_counts_at_the_share_of_pairs_it_keeps(mask_format, mask_bytes):
    case = Case(**SMALL, window=2, mask="topk", bias="kv_row", mask_format=mask_format)
    assert compulsory_bytes(case, "fwd", kept_fraction=0.25) == FORWARD + 16 + mask_bytes / 4


def test_documents_as_varlen_carry_no_per_key_mask():
    case = Case(1, 2, 1, 8, 8, 16, 4, True, mask="document", mask_format="varlen")
    assert compulsory_bytes(case, "fwd") == compulsory_bytes(
        Case(1, 2, 1, 8, 8, 16, None, True), "fwd")


def test_gbps_is_bytes_over_time_and_none_without_a_time():
    case = Case(**SMALL)
    assert gbps(case, "fwd", 1e-3) == pytest.approx(FORWARD / 1e-6 / 1e9)
    assert gbps(case, "fwd", None) is None and gbps(case, "fwd", 0.0) is None


def test_peak_rates_are_keyed_by_exact_gpu_names():
    assert PEAK_RATES["NVIDIA H100 80GB HBM3"].gbps == 3350.0
    assert "NVIDIA H200 NVL" not in PEAK_RATES  # another card than the H200 SXM


def test_row_case_inverts_the_case_columns_of_a_row():
    class Env:
        gpu = driver = torch = triton = git_sha = host = ""
        git_dirty = False

    case = Case(2, 4, 2, 96, 96, 40, 48, True, "fp16", "document", bias="kv_row",
                mask_format="intervals", documents=(0, 1, 95))
    assert row_case(new_row("s", case, "triton", "fwd", "ok", Env())) == case
