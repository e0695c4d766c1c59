"""The FlashAttention-4 peer (``fa4``) on a machine without its package or a GPU: what it can
express, why it skips the rest, its document offsets, and that it counts as a peer."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dmbench.backends import BACKEND_NAMES, make_backends
from dmbench.backends.fa4 import Fa4Backend, document_offsets, fa4_gap
from dmbench.case import Case
from dmbench.collected import PEERS, ratio_to_best_peer
from dmbench.problem import make_problem
from dmbench.sweep import DEFAULT_BACKENDS

BASE = Case(batch=2, heads_q=8, heads_kv=2, seqlen_q=256, seqlen_k=256, head_dim=128,
            causal=True)


@pytest.mark.parametrize("changes", [
    {}, {"causal": False}, {"heads_kv": 1}, {"head_dim": 40}, {"head_dim": 256},
    {"dtype": "fp16"}, {"seqlen_q": 1, "seqlen_k": 4095},
    {"mask": "sliding", "window": 64},
    {"mask": "sliding", "window": 64, "mask_format": "intervals"},
    {"mask": "document", "window": 64}, {"mask": "document", "window": 64, "causal": False,
                                          "mask_format": "varlen"},
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) or "dense-causal")
def test_what_fa4_expresses_runs(changes):
    assert fa4_gap(replace(BASE, **changes)) is None


@pytest.mark.parametrize("changes, reason", [
    ({"bias": "kv_row"}, "no bias gradient"),
    ({"mask": "topk", "window": 64}, "cannot read a topk mask"),
    ({"mask": "block_sparse", "window": 128}, "cannot read a block_sparse mask"),
    ({"mask": "random"}, "cannot read a random mask"),
    ({"mask": "sliding", "window": 64, "causal": False}, "non-causal sliding"),
    ({"dtype": "fp32"}, "fp16 and bf16 only"),
    ({"head_dim": 36}, "multiples of 8"),
], ids=["bias", "topk", "block-sparse", "random", "sliding-non-causal", "fp32", "d36"])
def test_what_fa4_cannot_express_is_skipped_with_the_reason(changes, reason):
    assert reason in fa4_gap(replace(BASE, **changes))


def test_fa4_needs_a_cuda_device():
    assert "CUDA device" in Fa4Backend().unavailable_reason(torch.device("cpu"))


def test_fa4_is_a_peer_and_a_default_backend():
    assert "fa4" in BACKEND_NAMES and "fa4" in make_backends()
    assert "fa4" in PEERS and "fa4" in DEFAULT_BACKENDS
    assert ratio_to_best_peer({"triton": 2.0, "sdpa": 3.0, "fa4": 1.0}) == (0.5, "fa4")


def test_document_offsets_pack_every_row_and_drop_empty_documents():
    case = Case(batch=2, heads_q=2, heads_kv=1, seqlen_q=10, seqlen_k=10, head_dim=16,
                mask="document", documents=(0, 4, 0, 6), dtype="fp32")
    offsets, longest = document_offsets(make_problem(case, torch.device("cpu")))
    assert offsets.tolist() == [0, 4, 10, 14, 20] and offsets.dtype == torch.int32
    assert longest == 6
