"""The gather route's kept-key lists built in one launch (``tuning.GATHER_ONE_LIST_PASS``,
``gather_kernels._kept_list_kernel``): the lists and bits of the two list passes, call after
call, and its decoupled look-back on statuses as concurrent programs leave them."""

from __future__ import annotations

import pytest
import torch

from attn_helpers import Dims, random_bias, random_mask, random_qkv, run_forward
from kernels import KeyIntervals, call_plan, dmattn_func, topk_intervals
from kernels.planning import tuning
from kernels.runtime import scratch


def _clear_plans():
    call_plan._plans.clear()
    call_plan._interval_plans.clear()
    call_plan._mask_plans.clear()


@pytest.mark.parametrize("form", ["bool", "bool-rows", "intervals"])
def test_one_list_pass_lists_what_two_do(device, monkeypatch, no_kept_plans, form):
    """With ``tuning.GATHER_ONE_LIST_PASS`` a step's lists take one launch (each chunk adds the
    counts the chunks before it publish): the bits of the two passes, call after call (its
    tickets and tags carry over between calls), over lists of many chunks, an empty list and a
    list of every key; the float64 reference holds."""
    from kernels.runtime import launch

    rows = 3 if form == "bool-rows" else 1
    # 11 chunks of 64 keys (the interpreter's chunk; on a GPU too, so that chunks wait on others)
    monkeypatch.setattr(tuning, "GATHER_LIST_CHUNK", 64)
    dims = Dims(2, rows, 700, 4, 2, 16)
    q, k, v = random_qkv(dims, torch.float16, device)
    bias = random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), torch.float16, device)
    if form == "intervals":  # a new object each call: a second call would prepare it
        selection = torch.randn(dims.batch, dims.heads_kv, 1, dims.seqlen_k, device=device)
        # 64 of 700 keys: the route unforced
        chosen = topk_intervals(selection, 64, seqlen_q=dims.seqlen_q, is_causal=True)

        def fresh():
            return KeyIntervals(chosen.start, chosen.end, max_kept=chosen.max_kept)
    else:
        mask = random_mask((2, 2, rows, 700), device, keep=0.1)
        mask[0, 0] = False  # a list of no key
        mask[1, 1] = True  # a list of every key

        def fresh():
            return mask
    _clear_plans()
    two = [dmattn_func(q, k, v, fresh(), bias, True, return_lse=True) for _ in range(2)]
    _clear_plans()
    monkeypatch.setattr(tuning, "GATHER_ONE_LIST_PASS", True)
    # Each scratch keeps its buffers from call to call, as on a GPU's stream, so that the
    # tickets and the statuses' tags of one call meet the next call's.
    kept_buffers = {}
    allocate = scratch.Scratch.buffers
    monkeypatch.setattr(scratch.Scratch, "buffers",
                        lambda self: kept_buffers.setdefault(id(self), allocate(self)))
    launched = []
    original = launch.PlannedLaunch.__call__
    monkeypatch.setattr(launch.PlannedLaunch, "__call__", lambda self, *args: (
        launched.append(self.kernel.__name__), original(self, *args))[1])
    for call in range(3):
        launched.clear()
        out, lse = dmattn_func(q, k, v, fresh(), bias, True, return_lse=True)
        assert launched == ["_kept_list_kernel", "_gather_decode_kernel"], call
        assert torch.equal(out, two[0][0]) and torch.equal(lse, two[0][1]), call
    assert torch.equal(two[0][0], two[1][0])
    tickets = [t for buffers in kept_buffers.values() for t in buffers
               if t.dtype == torch.int64 and t.dim() == 1]
    assert tickets and all(int(t.min()) == 3 * 11 for t in tickets)  # 3 calls of 11 chunks
    run_forward(q, k, v, fresh(), bias, causal=True)
    _clear_plans()  # none made under the option outlives the test


def test_one_list_pass_holds_under_many_chunks_at_once(device, monkeypatch, no_kept_plans):
    """On a GPU the one-pass lists' programs run at once and wait on each other's published
    counts (the interpreter runs them one by one): at B8 H32/8 Lk131072 (128 chunks a row, 64
    rows), ten steps in a row give the two passes' bits each time."""
    cuda = device.type == "cuda"
    dims = Dims(8, 1, 131072, 32, 8, 128) if cuda else Dims(2, 1, 1500, 4, 2, 16)
    q, k, v = random_qkv(dims, torch.bfloat16, device)
    mask = random_mask((dims.batch, dims.heads_kv, 1, dims.seqlen_k), device, keep=0.05)
    _clear_plans()
    want = dmattn_func(q, k, v, mask, None, True, return_lse=True)
    _clear_plans()
    monkeypatch.setattr(tuning, "GATHER_ONE_LIST_PASS", True)
    for step in range(10 if cuda else 2):
        out, lse = dmattn_func(q, k, v, mask, None, True, return_lse=True)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), step
    _clear_plans()


@pytest.mark.parametrize("chunk, prefix_at", [(40, 0), (35, 20), (3, None), (0, None)])
def test_the_look_back_adds_the_counts_before_its_chunk(device, chunk, prefix_at):
    """``_kept_list_kernel``'s look-back, one program on statuses as concurrent programs
    would leave them (the interpreter runs programs in order, so a whole grid never shows
    them): the counts of the chunks before its own, back to the nearest that published its
    prefix (two windows of 32 where that is chunk 0, 40 chunks back), none beyond it (their
    counts are absurd: adding one shows). Its keys land after them, and it publishes its
    prefix under the call's tag."""
    from kernels.planning.operands import Layout, OnePassListPointers, Sizes
    from kernels.triton_device.gather_kernels import _kept_list_kernel

    chunks, size = 48, 64
    seqlen_k = chunks * size
    gen = torch.Generator().manual_seed(chunk)
    mask = (torch.rand(1, 1, 1, seqlen_k, generator=gen) < 0.3).to(device)
    counts = torch.randint(0, 60, (chunks,), generator=gen)
    tag, prefix_flag = 5, 1 << 32  # the fifth call (tickets from 4 x 48)
    words = torch.full((chunks,), (tag << 33) | 10**6, dtype=torch.int64)  # absurd counts
    first = 0 if prefix_at is None else prefix_at
    words[first] = (tag << 33) | prefix_flag | 1000
    words[first + 1:chunk] = (tag << 33) | counts[first + 1:chunk]
    want_before = (1000 + int(counts[first + 1:chunk].sum())) if chunk > 0 else 0
    if prefix_at is None and chunk > 0:  # chunk 0 published only its count, not yet its prefix
        words[0] = (tag << 33) | 1000
    tickets = torch.tensor([(tag - 1) * chunks + chunk], dtype=torch.int64, device=device)
    statuses = words.to(device)
    kept = torch.full((1, seqlen_k + 2000), -1, dtype=torch.int32, device=device)
    lengths = torch.zeros(1, dtype=torch.int32, device=device)
    ptrs = OnePassListPointers(mask, mask, kept, lengths, tickets, statuses)
    _kept_list_kernel[(1, 1)](ptrs, Layout(seqlen_k, seqlen_k, seqlen_k, 1, 1),
                              Sizes(1, 1, 1, seqlen_k), 1, 1, chunks, kept.shape[1],
                              MASK_KIND=0, IS_CAUSAL=False, CHUNK=size, LOOKBACK=32)
    keys = torch.arange(chunk * size, (chunk + 1) * size, device=device)
    mine = keys[mask[0, 0, 0, chunk * size:(chunk + 1) * size]].to(torch.int32)
    assert int(tickets) == (tag - 1) * chunks + chunk + 1
    assert torch.equal(kept[0, want_before:want_before + mine.numel()], mine)
    assert int(statuses[chunk]) == (tag << 33) | prefix_flag | (want_before + mine.numel())


@pytest.mark.parametrize("chunks, capacity", [(7, 4000), (8, 100), (1, 4000)])
def test_the_word_pass_lists_what_the_key_pass_lists(device, chunks, capacity):
    """``_kept_word_keys_kernel`` (a word of bits at a time) writes the lists and lengths of
    ``_kept_keys_kernel`` (a key at a time) from the same chunk counts and bits: rows of no key,
    of every key (bit 31 of every word), of random keys, parts over several chunks with a last
    part cut short, and lists cut at ``capacity``."""
    from kernels.planning.operands import KeptPointers
    from kernels.triton_device.gather_kernels import _kept_keys_kernel, _kept_word_keys_kernel

    size, rows = 64, 4
    gen = torch.Generator().manual_seed(chunks)
    keep = torch.rand(rows, chunks * size, generator=gen) < 0.1
    keep[0] = False
    keep[1] = True
    keep[3, ::7] = True
    bits = (keep.view(rows, -1, 32).to(torch.int64) << torch.arange(32)).sum(-1)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).to(device)
    chunk_counts = keep.view(rows, chunks, size).sum(-1).to(torch.int32).to(device)
    lists = []
    for kernel, parts, words in ((_kept_keys_kernel, chunks, None),
                                 (_kept_word_keys_kernel, -(-chunks // 2), 4)):
        kept = torch.full((rows, capacity), -1, dtype=torch.int32, device=device)
        lengths = torch.full((rows,), -1, dtype=torch.int32, device=device)
        ptrs = KeptPointers(bits, bits, kept, lengths, chunk_counts, bits)
        extra = {} if words is None else {"WORDS": words}
        kernel[(rows, parts)](ptrs, chunks, capacity, CHUNK=size, COUNTS_BLOCK=4, **extra)
        lists.append((kept, lengths))
    (want, want_lengths), (got, got_lengths) = lists
    assert torch.equal(got_lengths, want_lengths)
    assert want_lengths.tolist() == [min(int(n), capacity) for n in keep.sum(-1)]
    for row, length in enumerate(want_lengths.tolist()):
        assert torch.equal(got[row, :length], want[row, :length]), row
        expected = keep[row].nonzero().flatten()[:length].to(torch.int32)
        assert torch.equal(got[row, :length].cpu(), expected), row


@pytest.mark.parametrize("form", ["bool", "intervals"])
def test_a_step_with_the_word_pass_matches_the_key_pass(device, monkeypatch, no_kept_plans,
                                                         form):
    """With ``tuning.GATHER_WORD_KEYS`` a decode step's second list pass is the word pass; its
    outputs are the key pass's, bit for bit, and the float64 reference holds."""
    from kernels.runtime import launch

    monkeypatch.setattr(tuning, "GATHER_LIST_CHUNK", 64)
    dims = Dims(2, 1, 700, 4, 2, 16)
    q, k, v = random_qkv(dims, torch.float16, device)
    bias = random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), torch.float16, device)
    if form == "intervals":
        selection = torch.randn(dims.batch, dims.heads_kv, 1, dims.seqlen_k, device=device)
        chosen = topk_intervals(selection, 64, seqlen_q=dims.seqlen_q, is_causal=True)

        def fresh():
            return KeyIntervals(chosen.start, chosen.end, max_kept=chosen.max_kept)
    else:
        mask = random_mask((2, 2, 1, 700), device, keep=0.1)
        mask[1, 1] = True

        def fresh():
            return mask
    _clear_plans()
    want = dmattn_func(q, k, v, fresh(), bias, True, return_lse=True)
    _clear_plans()
    monkeypatch.setattr(tuning, "GATHER_WORD_KEYS", True)
    launched = []
    original = launch.PlannedLaunch.__call__
    monkeypatch.setattr(launch.PlannedLaunch, "__call__", lambda self, *args: (
        launched.append(self.kernel.__name__), original(self, *args))[1])
    out, lse = dmattn_func(q, k, v, fresh(), bias, True, return_lse=True)
    assert launched == ["_kept_counts_kernel", "_kept_word_keys_kernel",
                        "_gather_decode_kernel"]
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    run_forward(q, k, v, fresh(), bias, causal=True)
    _clear_plans()
