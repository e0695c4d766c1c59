"""The forward that reads new KeyIntervals itself (``ForwardSchedule.scan_keys``): where a call
wants no gradient and its intervals are not prepared, each program reads start and end as
given, finds the key blocks from its first to its last visible key and tests every pair, with
no activity pass and no list compaction.

Oracles: the float64 reference given the same intervals, the same call on the list path
(``forward_key_scan`` False), and the same call planned afresh for bit equality of kept plans."""

from __future__ import annotations

import pytest
import torch

from attn_helpers import (AllocationWatch, Dims, assert_close_to_reference,
                          assert_empty_rows_and_finite, forward_plans_made, random_bias,
                          random_intervals, random_qkv)
from kernels import KeyIntervals, attention_reference, call_plan, dmattn_func, prepare_mask
from kernels.planning import tuning
from kernels.planning.activity import IntervalActivityPass, ListCompaction

pytestmark = pytest.mark.usefixtures("no_kept_plans")

CAUSAL = (pytest.param(False, id="full"), pytest.param(True, id="causal"))
INDEX_DTYPES = (pytest.param(torch.int32, id="int32"), pytest.param(torch.int64, id="int64"))
# (dims, interval heads: "1", "Hk" or "Hq", interval batch: "1" or "B")
SHAPES = [
    pytest.param(Dims(2, 17, 33, heads_q=4, heads_kv=2, head_dim=16), "Hk", "B", id="gqa"),
    pytest.param(Dims(1, 97, 40, heads_q=2, heads_kv=1, head_dim=40), "1", "1", id="lq>lk"),
    pytest.param(Dims(2, 33, 70, heads_q=4, heads_kv=4, head_dim=16), "Hq", "1", id="mha"),
    pytest.param(Dims(1, 1, 130, heads_q=8, heads_kv=2, head_dim=16), "Hk", "1",
                 id="decode-split"),
    pytest.param(Dims(1, 3, 65, heads_q=6, heads_kv=2, head_dim=16), "Hq", "1", id="lq3-packed"),
]


def same_dtype(intervals: KeyIntervals, dtype: torch.dtype) -> KeyIntervals:
    """The intervals with start and end of one dtype (``random_intervals`` mixes them, which
    takes the list path)."""
    return KeyIntervals(intervals.start.to(dtype), intervals.end.to(dtype))


def forward(q, k, v, intervals, bias, causal, **options):
    """(out, lse, the plan that ran) of one call without a gradient."""
    with torch.no_grad():
        out, lse = dmattn_func(q, k, v, intervals, bias, causal, return_lse=True,
                               kernel_options=options or None)
    kept = list(call_plan._interval_plans.values())
    return out, lse, (kept[-1][0] if kept else None)


def assert_matches_the_reference(q, k, v, intervals, bias, causal, out, lse):
    """out and lse close to the float64 reference given the same intervals; rows that see no
    key give 0 and -inf."""
    ref_out, ref_lse = attention_reference(q, k, v, intervals, bias, causal, return_lse=True)
    low_out, low_lse = attention_reference(q, k, v, intervals, bias, causal, return_lse=True,
                                           upcast=False)
    assert_empty_rows_and_finite(out, lse, ref_lse)
    assert_close_to_reference("out", out, ref_out, low_out, q.dtype)
    assert_close_to_reference("lse", lse, ref_lse, low_lse, q.dtype)
    return low_out, low_lse


@pytest.mark.parametrize("dims,heads,batch", SHAPES)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_scan_matches_the_reference_and_the_list_path(dims, heads, batch, causal, index_dtype,
                                                      device):
    dtype = torch.float16
    q, k, v = random_qkv(dims, dtype, device)
    bias = random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), dtype, device)
    intervals = same_dtype(random_intervals(dims, heads, batch, device), index_dtype)
    splits = {"forward_key_splits": 3} if dims.seqlen_q == 1 else {}  # decode: split-K too
    out, lse, plan = forward(q, k, v, intervals, bias, causal, **splits)
    assert plan.scan_keys and plan.splits == splits.get("forward_key_splits", 1)
    low_out, low_lse = assert_matches_the_reference(q, k, v, intervals, bias, causal, out, lse)

    listed_out, listed_lse, listed = forward(q, k, v, KeyIntervals(intervals.start,
                                                                   intervals.end),
                                             bias, causal, forward_key_scan=False)
    assert not listed.scan_keys
    assert_close_to_reference("out against the list path", out, listed_out, low_out, dtype)
    assert_close_to_reference("lse against the list path", lse, listed_lse, low_lse, dtype)


def banded(dims: Dims, device, keys_seen: list[tuple[int, int, int]]) -> KeyIntervals:
    """Intervals where no row sees any key except ``keys_seen``'s (key, first row, end row)."""
    start = torch.zeros(1, 1, dims.seqlen_k, dtype=torch.int32)
    end = torch.zeros_like(start)
    for key, first, stop in keys_seen:
        start[..., key], end[..., key] = first, stop
    return KeyIntervals(start.to(device), end.to(device))


@pytest.mark.parametrize("causal", CAUSAL)
def test_scan_finds_lone_keys_and_skips_nothing_between(causal, device):
    """A key seen by one row only, far from the others; whole key blocks seen by no row between
    seen ones; rows that see nothing (output 0, LSE -inf). Walking from the first to the last
    seen key must still find every seen pair."""
    dims = Dims(1, 70, 200, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    intervals = banded(dims, device, [(3, 5, 6), (150, 0, 70), (199, 60, 61), (90, 30, 31),
                                      (0, 40, 42)])
    out, lse, plan = forward(q, k, v, intervals, None, causal)
    assert plan.scan_keys
    assert_matches_the_reference(q, k, v, intervals, None, causal, out, lse)


def full_run_intervals(pattern: str, dims: Dims, device) -> KeyIntervals:
    """Intervals whose tiles hold runs of blocks every row sees, which the scan walks with no
    mask read: a sliding window (runs inside the band), every key to every row (with causal:
    runs up to the diagonal, the last block partial), and two runs split by unseen keys."""
    lq, lk = dims.seqlen_q, dims.seqlen_k
    keys = torch.arange(lk, dtype=torch.int32)
    if pattern == "sliding":
        start, end = keys - 24, keys + 20
    elif pattern == "every":
        start, end = torch.zeros_like(keys), torch.full_like(keys, lq)
    else:  # two runs: keys 16-47 and 64-95 seen by every row, a gap of 16 unseen keys
        seen = ((keys >= 16) & (keys < 48)) | ((keys >= 64) & (keys < 96))
        start, end = torch.zeros_like(keys), torch.where(seen, lq, 0).int()
    return KeyIntervals(start.view(1, 1, lk).to(device), end.view(1, 1, lk).to(device))


@pytest.mark.parametrize("pattern", ("sliding", "every", "two-runs"))
@pytest.mark.parametrize("causal", CAUSAL)
def test_scan_walks_runs_of_full_blocks(pattern, causal, device):
    dims = Dims(1, 70, 101, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float32, device)
    bias = random_bias(dims.operand_shape("1", "Hk", "1", "Lk"), torch.float32, device)
    intervals = full_run_intervals(pattern, dims, device)
    out, lse, plan = forward(q, k, v, intervals, bias, causal)
    assert plan.scan_keys
    assert_matches_the_reference(q, k, v, intervals, bias, causal, out, lse)


def test_kept_scan_plans_follow_each_calls_values_bit_for_bit(device, monkeypatch):
    """New intervals of one form take the kept plan, which reads only their values: the bits of
    planning each call afresh, with values that move the seen keys from call to call."""
    dims = Dims(2, 37, 53, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    bias = random_bias(dims.operand_shape("B", "Hk", "1", "Lk"), torch.float16, device)
    sets = [same_dtype(random_intervals(dims, "Hk", "B", device, seed=s), torch.int32)
            for s in range(3)]
    sets.append(banded(dims, device, [(52, 0, 37)]))  # one key, the last block's
    sets[-1] = KeyIntervals(sets[-1].start.expand(2, 2, -1), sets[-1].end.expand(2, 2, -1))

    monkeypatch.setattr(call_plan, "MAX_INTERVAL_PLANS", 0)
    afresh = [forward(q, k, v, KeyIntervals(s.start, s.end), bias, True)[:2] for s in sets]
    monkeypatch.undo()
    made = forward_plans_made(monkeypatch)
    with AllocationWatch():  # fresh allocations are poisoned
        for s, want in zip(sets, afresh):
            got = forward(q, k, v, KeyIntervals(s.start, s.end), bias, True)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert got[2].scan_keys
    # The broadcast set is a form of its own (its strides); each form planned once.
    assert len(made) == 2


def test_scan_reads_no_activity_map_and_compacts_no_list(device, monkeypatch):
    dims = Dims(1, 40, 50, heads_q=4, heads_kv=2, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    intervals = same_dtype(random_intervals(dims, "Hk", "1", device), torch.int32)

    def never(*args, **kwargs):
        raise AssertionError("the scan path made an activity map or a list")

    monkeypatch.setattr(IntervalActivityPass, "__call__", never)
    monkeypatch.setattr(ListCompaction, "__call__", never)
    for _ in range(2):  # planned, then from the kept plan
        assert forward(q, k, v, KeyIntervals(intervals.start, intervals.end), None, True)[2] \
            .scan_keys


def plan_of(q, k, v, intervals, **options):
    return forward(q, k, v, intervals, None, True, **options)[2]


def test_which_calls_scan(device, monkeypatch):
    """Scan: new intervals, start and end of one dtype and layout, no gradient, at most
    ``FORWARD_SCAN_MAX_KEYS`` keys. Not: a gradient wanted, mixed dtypes or strides, longer
    keys, the head dims ``FORWARD_SCAN_SKIPS_HEAD_DIMS`` names, prepared intervals."""
    dims = Dims(1, 20, 48, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    drawn = random_intervals(dims, "1", "1", device)
    start, end = drawn.start.int(), drawn.end.int()
    assert plan_of(q, k, v, KeyIntervals(start, end)).scan_keys
    assert not plan_of(q, k, v, KeyIntervals(start.long(), end)).scan_keys
    wide = torch.zeros(1, 1, 2 * dims.seqlen_k, dtype=torch.int32, device=device)
    strided = wide[..., ::2].copy_(end)
    assert not plan_of(q, k, v, KeyIntervals(start, strided)).scan_keys
    both = wide.clone()
    both[..., ::2].copy_(start)  # one layout, key stride 2: scans
    assert plan_of(q, k, v, KeyIntervals(both[..., ::2], wide[..., ::2])).scan_keys

    with torch.no_grad():
        prepared = prepare_mask(KeyIntervals(start, end), q, k, True)
        dmattn_func(q, k, v, prepared, None, True)
    ((kept, _),) = prepared.plans.values()
    assert not kept.scan_keys

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    dmattn_func(*leaves, KeyIntervals(start, end), None, True)
    assert not next(reversed(call_plan._interval_plans.values()))[0].scan_keys

    monkeypatch.setattr(tuning, "FORWARD_SCAN_MAX_KEYS", dims.seqlen_k - 1)
    call_plan._interval_plans.clear()  # plans are kept by form, made under the old limit
    assert not plan_of(q, k, v, KeyIntervals(start, end)).scan_keys
    assert plan_of(q, k, v, KeyIntervals(start, end), forward_key_scan=True).scan_keys
    # Key splits each read their own share of the keys: two shares of 24 keys are in reach.
    assert plan_of(q, k, v, KeyIntervals(start, end), forward_key_splits=2).scan_keys
    monkeypatch.undo()
    monkeypatch.setattr(tuning, "FORWARD_SCAN_SKIPS_HEAD_DIMS", (dims.head_dim - 1, 128))
    call_plan._interval_plans.clear()
    assert not plan_of(q, k, v, KeyIntervals(start, end)).scan_keys


def test_forcing_a_scan_where_none_can_run_names_the_option(device):
    dims = Dims(1, 20, 48, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, torch.float16, device)
    intervals = random_intervals(dims, "1", "1", device)  # start int64, end int32
    with pytest.raises(ValueError, match=r"forward_key_scan.*one dtype and strides"):
        plan_of(q, k, v, intervals, forward_key_scan=True)
    with pytest.raises(ValueError, match=r"kernel_options\['forward_key_scan'\]: expected"):
        plan_of(q, k, v, intervals, forward_key_scan=1)


def test_a_graph_captured_without_gradients_follows_new_values(device):
    """A forward without gradients captured with new intervals: replays read whatever the
    captured start and end hold. Off the GPU the kept plan is called again on the tensors
    written in place, which must follow their values the same way."""
    dims = Dims(1, 64, 96, heads_q=4, heads_kv=2, head_dim=64)
    dtype = torch.bfloat16
    q, k, v = random_qkv(dims, dtype, device)
    bias = random_bias(dims.operand_shape("1", "Hk", "1", "Lk"), dtype, device)
    sets = [same_dtype(random_intervals(dims, "Hk", "1", device, seed=s), torch.int32)
            for s in range(3)]
    sets.append(banded(dims, device, [(95, 10, 64)]))
    sets[-1] = KeyIntervals(sets[-1].start.expand(1, 2, -1).contiguous(),
                            sets[-1].end.expand(1, 2, -1).contiguous())
    static = KeyIntervals(sets[0].start.clone(), sets[0].end.clone())

    def step(intervals):
        return forward(q, k, v, KeyIntervals(intervals.start, intervals.end), bias, True)

    assert step(static)[2].scan_keys  # plan and compile outside the capture
    if device.type == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step(static)[:2]

        def replay():
            graph.replay()
            return captured
    else:
        def replay():
            return step(static)[:2]
    for s in sets[1:]:
        static.start.copy_(s.start)
        static.end.copy_(s.end)
        got, want = replay(), step(s)[:2]
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
