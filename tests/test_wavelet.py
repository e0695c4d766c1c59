"""kernels.masks.wavelet: the Triton kernels of topk_intervals' causal selection give the bits of the
torch ops they replace (``topk._kth_smallest`` and ``_intervals``' epilogue).

Under the interpreter (the default CPU run) the kernels run on CPU tensors, as topk_intervals
runs them there; ``--device cuda`` compares them with the torch ops on the GPU.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from kernels.masks import wavelet as _wavelet
from kernels import topk_intervals

tk = importlib.import_module("kernels.masks.topk")

# n = 1024 and 2048 fill whole blocks (an empty block past them holds the table's last word);
# 1025 and 2049 spill one position into a block of their own.
LENGTHS = (1, 2, 17, 97, 1024, 1025, 2049)


def _queries(rows: int, n: int, m: int, generator: torch.Generator):
    """Random ranges 0 <= lo <= hi <= n and k in [0, n + 3): past the range too."""
    a = torch.randint(0, n + 1, (rows, m), generator=generator)
    b = torch.randint(0, n + 1, (rows, m), generator=generator)
    k = torch.randint(0, n + 3, (rows, m), generator=generator)
    return torch.minimum(a, b), torch.maximum(a, b), k


def _use_tiles(tiles: str, monkeypatch) -> None:
    """The launches' tiles: the device's own ("own": under the interpreter, every row of a
    block in one program), or a GPU's ("gpu": one row a program, 512 queries) wherever the
    test runs, so that the CPU run checks the GPU's form of the kernels too."""
    if tiles == "gpu":
        monkeypatch.setattr(_wavelet, "_tiles", lambda rows: (1, _wavelet.QUERIES))


@pytest.fixture(params=("own", "gpu"))
def tiles(request, monkeypatch):
    _use_tiles(request.param, monkeypatch)
    return request.param


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("rows", (1, 3))
def test_kth_smallest_gives_the_torch_bits(n, rows, device, tiles):
    generator = torch.Generator().manual_seed(n * 10 + rows)
    values = torch.stack([torch.randperm(n, generator=generator) for _ in range(rows)])
    lo, hi, k = _queries(rows, n, max(n, 5), generator)
    expected = tk._kth_smallest(values, lo, hi, k)
    got = _wavelet.kth_smallest(values.to(device), lo.to(device), hi.to(device), k.to(device))
    assert got.dtype == torch.int64
    assert torch.equal(got.cpu(), expected)
    # Within range the answer is the k-th smallest of the range itself.
    for r in range(rows):
        for q in range(0, lo.shape[1], max(1, lo.shape[1] // 7)):
            part = values[r, lo[r, q]:hi[r, q]].sort().values
            if k[r, q] < len(part):
                assert got[r, q] == part[k[r, q]]


def test_kth_smallest_takes_queries_of_their_own_count(device, tiles):
    """m queries per row, fewer or more than the n values, lo > 0 among them; more rows than
    the interpreter puts in one program."""
    generator = torch.Generator().manual_seed(3)
    rows = _wavelet.INTERPRETED_ROWS + 3 if tiles == "own" else 2
    values = torch.stack([torch.randperm(300, generator=generator) for _ in range(rows)])
    for m in (1, 40, 700):
        lo, hi, k = _queries(rows, 300, m, generator)
        lo = torch.minimum(lo + 5, hi)
        got = _wavelet.kth_smallest(values.to(device), lo.to(device), hi.to(device),
                                    k.to(device))
        assert torch.equal(got.cpu(), tk._kth_smallest(values, lo, hi, k)), m


def _both_paths(monkeypatch, call):
    """call() with the torch ops forced, then with the kernels."""
    monkeypatch.setattr(tk, "USE_KERNELS", False)
    expected = call()
    monkeypatch.setattr(tk, "USE_KERNELS", True)
    return expected, call()


CAUSAL_CASES = (((1, 1), 1), ((5, 97), 3), ((97, 5), 2), ((300, 300), 16),
                ((40, 1025), 1000), ((1025, 1025), 5000), ((3, 2049), 64))


@pytest.mark.parametrize("lengths,window,tiles", [
    pytest.param(lengths, window, tiles, id=f"q{lengths[0]}-k{lengths[1]}-w{window}-{tiles}")
    for tiles, cases in (("own", CAUSAL_CASES), ("gpu", CAUSAL_CASES[:5]))
    for lengths, window in cases])
def test_causal_intervals_give_the_torch_bits(lengths, window, tiles, device, monkeypatch):
    _use_tiles(tiles, monkeypatch)
    seqlen_q, seqlen_k = lengths
    bias = torch.randn(2, 3, 1, seqlen_k).to(device)
    bias[..., ::7] = 0.5  # ties
    expected, got = _both_paths(monkeypatch, lambda: tk._rows_direct(
        bias.reshape(6, seqlen_k), window, seqlen_q, True))
    for want, have in zip(expected, got):
        assert have.dtype == torch.int32 and torch.equal(have, want)


@pytest.mark.parametrize("window", (1, 4, 100))
def test_packed_causal_intervals_give_the_torch_bits(window, device, monkeypatch, tiles):
    """Packed rows: every query's range starts at its sequence's first rank (lo > 0)."""
    lengths = ((5, 5), (0, 3), (1, 1), (7, 2), (30, 90), (4, 0), (1, 6), (2000, 1100))
    cu_q = torch.tensor([0] + [q for q, _ in lengths]).cumsum(0).to(torch.int32).to(device)
    cu_k = torch.tensor([0] + [k for _, k in lengths]).cumsum(0).to(torch.int32).to(device)
    bias = torch.randint(0, 50, (3, int(cu_k[-1]))).float().to(device)
    expected, got = _both_paths(monkeypatch, lambda: topk_intervals(
        bias, window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))
    assert torch.equal(got.start, expected.start) and torch.equal(got.end, expected.end)


def test_topk_intervals_takes_the_kernels_on_the_interpreter_and_cuda(device, monkeypatch):
    """Causal selections run the kernels on CUDA tensors and under the interpreter (every
    test of topk_intervals then checks them); CPU tensors without the interpreter, and the
    selections without causality, take the torch ops."""
    monkeypatch.setattr(importlib.import_module("kernels.topk_ops"), "GRAPH_MAX_ELEMENTS",
                        0)  # one call, not a capture's two
    calls = []
    original = _wavelet.causal_intervals
    monkeypatch.setattr(_wavelet, "causal_intervals",
                        lambda *args: calls.append(args) or original(*args))
    bias = torch.randn(1, 2, 1, 50).to(device)
    topk_intervals(bias, 4, is_causal=True)
    assert len(calls) == 1
    topk_intervals(bias, 4, is_causal=False)
    assert len(calls) == 1
    monkeypatch.setattr(_wavelet, "is_interpreted", lambda kernel: False)
    topk_intervals(bias.cpu(), 4, is_causal=True)
    assert len(calls) == 1
