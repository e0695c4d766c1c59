"""Packed documents on the Hopper forward (``attention_forward``'s DOCUMENTS): each sequence's
own row tiles (``planning.documents.document_tiles``), keys and causality, against the fp64
varlen reference. The table is tested here on the CPU; the kernel on a Hopper GPU."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kernels import attention_varlen_reference
from kernels.planning.documents import document_tiles, tile_bound
from kernels.tolerance import check_tensor


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


# -- device side: a Hopper GPU
DOCUMENTS = [  # (query rows, keys) per sequence
    [(1, 1)],
    [(17, 17), (0, 0), (97, 97), (128, 128), (129, 129)],
    [(300, 300), (1, 1), (4095, 4095), (256, 256)],
    [(1000, 1000)] * 3 + [(63, 63)],
    [(40, 97), (97, 40), (128, 1), (5, 0), (700, 1025)],  # Lq != Lk: bottom-right causality
    [(2048, 2048), (17, 17), (1025, 1025), (3000, 3000)],
]


def _launch(q, k, v, cu_q, cu_k, bias, causal):
    """The Hopper forward over packed documents, launched as the route's plan launches it,
    into a NaN-poisoned output: (out (total_q, Hq, D), lse (Hq, total_q))."""
    from kernels.planning import tuning
    from kernels.planning.hopper_forward import HopperForwardLaunch
    from kernels.planning.forward import call_problem
    from kernels.planning.inputs import check_inputs

    query, key, value = q[None], k[None], v[None]
    bias4 = None if bias is None else bias[None, :, None, :]
    checked = check_inputs(query, key, value, None, bias4, None)
    problem = call_problem(checked, query, causal)
    tile = tuning.HOPPER_FORWARD
    launch = HopperForwardLaunch(problem, tile, None, checked.bias, "balanced",
                                 sequences=cu_q.numel() - 1)
    table = document_tiles(cu_q, cu_k, q.shape[0], 2 * tile.rows, tile.block_n, causal)
    out = torch.full_like(query, float("nan"))
    lse = torch.full((1, q.shape[1], q.shape[0]), float("nan"), device=q.device)
    launch(query, key, value, out, lse, bias=bias4, documents=(table, cu_q, cu_k))
    return out[0], lse[0]


@pytest.mark.hopper
@pytest.mark.parametrize("lengths", DOCUMENTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,heads,bias", [(128, (8, 2), False), (64, (4, 4), True),
                                                (80, (6, 1), False), (128, (4, 2), True)])
def test_documents_match_the_reference(device, lengths, causal, head_dim, heads, bias):
    torch.manual_seed(len(lengths) * 7 + head_dim)
    dtype = torch.bfloat16
    cu_q, cu_k = _offsets(lengths, device)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(total_q, heads[0], head_dim, device=device, dtype=dtype)
    k = torch.randn(total_k, heads[1], head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    attn_bias = None
    if bias:  # rows 16-byte aligned, as TMA reads them
        rows = torch.randn(heads[1], -(-total_k // 8) * 8, device=device)
        attn_bias = (2 * rows).to(dtype)[:, :total_k]
    out, lse = _launch(q, k, v, cu_q, cu_k, attn_bias, causal)
    assert not out.isnan().any() and not lse.isnan().any()
    ref = attention_varlen_reference(q, k, v, cu_q, cu_k, attn_bias=attn_bias,
                                     is_causal=causal, return_lse=True)
    eager = attention_varlen_reference(q, k, v, cu_q, cu_k, attn_bias=attn_bias,
                                       is_causal=causal, return_lse=True, upcast=False)
    for name, got, want, low in zip(("out", "lse"), (out, lse), ref, eager):
        check = check_tensor(name, got, want, low, dtype)
        assert check.passed, check.describe()
    empty = torch.isneginf(ref[1])
    assert torch.isneginf(lse[empty]).all() and (out.transpose(0, 1)[empty] == 0).all()
