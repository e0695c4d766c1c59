"""Decode's gather route: a forward that reads only the keys its mask keeps
(``triton_device.gather_kernels``).

Three launches per call: the kept-key lists in two (one program per row of the mask's
(batch, head) rows and chunk of keys: the chunks' counts and a bit per key, then the chunks'
keys from the bits, after the counts before them), then the forward over them (one program
per batch and pack of query heads, times key shares), whose shares merge in the launch. With
``tuning.GATHER_ONE_LIST_PASS`` the lists take one launch (``_kept_list_kernel``: each chunk
adds the counts before it as they are published), the same lists.
Intervals from ``topk_intervals``' one-window selection (decode) come with their lists, which
the selection's last launch wrote: their calls launch the forward alone.
Nothing waits for the device: the lists' lengths stay on it, each share sizes itself from
them, and every buffer is sized on the host from the call's form (a list holds at most
``capacity`` keys), so a CUDA graph replays a step and ``torch.compile`` traces it.

A prepared mask (``prepare_mask``, or intervals a former call prepared) cannot change between
its calls (``PreparedMask.check_fresh``), and its plans are its own: the first call that runs
its list passes outside a CUDA graph capture (and outside ``launch.compile_only``) keeps the
lists with the plan, and later calls launch the forward alone. Lists made inside a capture
are not kept: they are written only when the graph replays.

The schedule takes the route for few query rows (``tuning.GATHER_MAX_ROWS``) with a bool mask,
or KeyIntervals that keep a small share of the keys, and no backward (``gather_tile``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.arith import LOG2E, ceil_div, contiguous_strides, next_power_of_2
from ..runtime.launch import PlannedLaunch, dot_options, launches_run
from ..runtime.scratch import WRITTEN_FIRST, Scratch
from ..triton_device.gather_kernels import (BOOL_MASK, INTERVAL_PAIRS, INTERVAL_WORDS,
                                            _gather_decode_kernel, _kept_counts_kernel,
                                            _kept_keys_kernel, _kept_list_kernel,
                                            _kept_word_keys_kernel)
from . import tuning
from .operands import (ABSENT, GatherPointers, KeptPointers, Layout, OnePassListPointers,
                       SeqStrides, seq_strides, sizes_of)
from .problem import Problem


@dataclass(frozen=True)
class GatherTile:
    """The gather route's launch: ``block_m`` tile rows (``group_pack`` query heads x the
    query rows), key blocks of ``block_n`` list entries, ``key_splits`` shares per list, and
    lists of at most ``capacity`` keys."""

    block_m: int
    block_n: int
    group_pack: int
    key_splits: int
    capacity: int
    num_warps: int

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n} pack {self.group_pack} splits "
                f"{self.key_splits} capacity {self.capacity}")


def kept_bound(problem: Problem) -> int:
    """The most keys one list can hold: as ``prepare_mask`` counted them, else the mask's
    bound on the keys its query rows keep together (``KeyIntervals.max_kept``), else every
    key."""
    seqlen_k = problem.shape.seqlen_k
    bound = problem.kept_keys if problem.kept_keys is not None else problem.max_kept
    return seqlen_k if bound is None else max(1, min(seqlen_k, bound))


def count_kept_keys(mask, seqlen_q: int, seqlen_k: int, is_causal: bool) -> int:
    """The most keys that the query rows together keep in one (batch, head) of ``mask``
    (a checked ``BroadcastOperand``): the length the gather route's longest list will have.
    O(B x H x Lq x Lk) for a bool mask, O(B x H x Lk) for intervals; one read back to the
    host."""
    diagonal = seqlen_k - seqlen_q
    keys = torch.arange(seqlen_k, device=mask.view.device)
    if mask.interval_source is not None:
        start, end = (t.to(torch.int64) for t in mask.interval_source)
        lo = start.clamp(min=0)
        if is_causal:
            lo = torch.maximum(lo, keys - diagonal)
        kept = lo < end.clamp(max=seqlen_q)
    else:
        keep = mask.view.bool()
        if is_causal:
            rows = torch.arange(seqlen_q, device=keys.device)[:, None]
            keep = keep & (keys[None, :] <= rows + diagonal)
        kept = keep.any(dim=2)
    return int(kept.sum(-1).max())


def gather_gap(problem: Problem) -> str | None:
    """Why the gather route does not cover ``problem`` (one line), or None where it does."""
    if problem.mask is None:
        return "it reads the keys a mask keeps: the call has no mask"
    if problem.shape.seqlen_q > tuning.GATHER_MAX_ROWS:
        return (f"it takes at most {tuning.GATHER_MAX_ROWS} query rows, not "
                f"{problem.shape.seqlen_q}")
    if not problem.forward_only:
        return "it has no backward: the call wants gradients"
    if problem.intervals and not (problem.interval_pair or problem.prepared):
        return ("it reads KeyIntervals prepared, or as the call gives them with start and end "
                "of one dtype and layout")
    return None


def gather_splits(programs: int, key_blocks: int, multiprocessors: int) -> int:
    """Key shares of each list: at most ``tuning.GATHER_PROGRAMS_PER_SM`` programs per
    multiprocessor in all (whole waves: rounded down), at least
    ``tuning.GATHER_MIN_BLOCKS_PER_SPLIT`` key blocks a share. The forward waits on gathered
    rows whose addresses come from the list, so it wants more programs in flight than the
    tile walk's split-K."""
    return max(1, min(tuning.GATHER_PROGRAMS_PER_SM * multiprocessors // programs,
                      key_blocks // tuning.GATHER_MIN_BLOCKS_PER_SPLIT, tuning.MAX_KEY_SPLITS))


def pack_of(problem: Problem) -> int:
    """Query heads per program: the GQA group where its heads share one mask head, else 1."""
    group = problem.shape.group_size
    return group if problem.mask.shared_by(group) else 1


def lists_pay(capacity: int, seqlen_k: int) -> bool:
    """Whether lists of at most ``capacity`` of ``seqlen_k`` keys are short enough for the
    route to take a call unforced: at most ``tuning.GATHER_MAX_KEPT_SHARE`` of the keys."""
    return capacity <= tuning.GATHER_MAX_KEPT_SHARE * seqlen_k


def gather_tile(problem: Problem, forced: bool = False) -> GatherTile | None:
    """The gather route's launch where the forward takes it, else None. Unforced, it takes a
    bool mask (``tuning.GATHER_TAKES_BOOL_MASKS``), whatever it keeps: read by the call, its
    list pass counts the kept keys on the device and each share of the forward sizes itself
    from the count; prepared, it takes the same route, so that preparing a mask never changes
    a call's bits. KeyIntervals it takes where their lists are bounded
    (``KeyIntervals.max_kept``, or a prepared mask's count) to at most
    ``tuning.GATHER_MAX_KEPT_SHARE`` of the keys."""
    if gather_gap(problem) is not None:
        return None
    capacity = kept_bound(problem)
    bool_mask = tuning.GATHER_TAKES_BOOL_MASKS and not problem.intervals
    if not (forced or bool_mask or lists_pay(capacity, problem.shape.seqlen_k)):
        return None
    shape = problem.shape
    pack = pack_of(problem)
    block_m = max(16, next_power_of_2(pack * shape.seqlen_q))
    tile = tuning.GATHER_INTERPRETED if problem.interpreted else tuning.GATHER
    programs = shape.batch * shape.heads_q // pack
    # A bool mask's shares are counted for every key, prepared or not: a list is cut into
    # shares by its count and the share count, so both cut it alike (the same bits).
    split_keys = shape.seqlen_k if bool_mask else capacity
    splits = gather_splits(programs, ceil_div(split_keys, tile.block_n), problem.multiprocessors)
    # 64 tile rows (16 query rows of a group of 4) over 4 warps took 255 registers and
    # spilled (ptxas, sm_90a, D128); 8 warps hold them.
    warps = 8 if block_m >= 64 and not problem.interpreted else tile.num_warps
    return GatherTile(block_m, tile.block_n, pack, splits, capacity, warps)


def mask_kind(mask_operand) -> int:
    if isinstance(mask_operand, tuple):
        return int(INTERVAL_PAIRS)
    return int(INTERVAL_WORDS if mask_operand.dtype == torch.int64 else BOOL_MASK)


class GatherDecodePlan:
    """The gather route's launches for one call signature: the list pass and the forward,
    planned once; a call passes its tensors."""

    def __init__(self, problem: Problem, tile: GatherTile, query, key, value,
                 mask_layout: Layout, bias_layout: Layout | None, mask_kind_code: int,
                 scan_rows: int):
        shape = problem.shape
        self.shape, self.device, self.tile = shape, query.device, tile
        # A prepared mask's lists, (kept, counts), once made (see the module docstring).
        self.keeps_lists = problem.prepared
        self.kept_lists: tuple[torch.Tensor, torch.Tensor] | None = None
        # Lists per (mask batch, mask head): a broadcast axis (stride 0) keeps one.
        list_batches = shape.batch if mask_layout.stride_b else 1
        list_heads = shape.heads_q // mask_layout.head_div
        list_rows = list_batches * list_heads
        # The shapes of lists a call may bring (``run``'s ``lists``).
        self.list_shapes = ((list_rows, tile.capacity), (list_rows,))
        self.out_shape = (shape.batch, shape.seqlen_q, shape.heads_q, shape.head_dim)
        self.lse_shape = (shape.batch, shape.heads_q, shape.seqlen_q)
        sizes = sizes_of(shape)
        chunk = tuning.GATHER_LIST_CHUNK if not problem.interpreted else 64
        num_chunks = ceil_div(shape.seqlen_k, chunk)
        list_args = (mask_layout, sizes, list_heads, scan_rows, num_chunks)
        list_options = dict(MASK_KIND=mask_kind_code, IS_CAUSAL=problem.is_causal, CHUNK=chunk,
                            num_warps=tuning.GATHER_LIST_WARPS, num_stages=1)
        self.counts = PlannedLaunch(_kept_counts_kernel, (list_rows, num_chunks), KeptPointers,
                                    list_args, **list_options)
        keys_kernel, parts, keys_options = _kept_keys_kernel, num_chunks, {}
        if tuning.GATHER_WORD_KEYS:
            # Whole chunks a part; under the interpreter two chunks, so parts add counts.
            words = max(tuning.GATHER_KEYS_WORDS if not problem.interpreted else 4, chunk // 32)
            keys_kernel, parts = _kept_word_keys_kernel, ceil_div(num_chunks * chunk // 32, words)
            keys_options = dict(WORDS=words)
        self.lists = PlannedLaunch(keys_kernel, (list_rows, parts), KeptPointers,
                                   (num_chunks, tile.capacity), CHUNK=chunk, COUNTS_BLOCK=256,
                                   num_warps=tuning.GATHER_LIST_WARPS, num_stages=1,
                                   **keys_options)
        self.one_pass = None
        if tuning.GATHER_ONE_LIST_PASS:
            self.one_pass = PlannedLaunch(_kept_list_kernel, (list_rows, num_chunks),
                                          OnePassListPointers, (*list_args, tile.capacity),
                                          LOOKBACK=32, **list_options)
        programs = shape.batch * shape.heads_q // tile.group_pack
        out_strides = SeqStrides(*contiguous_strides(self.out_shape)[:3])
        self.main = PlannedLaunch(
            _gather_decode_kernel, (programs, 1, tile.key_splits), GatherPointers,
            (seq_strides(query), seq_strides(key), seq_strides(value), out_strides,
             mask_layout, bias_layout or ABSENT, sizes, problem.softmax_scale * LOG2E,
             list_heads, list_heads if list_batches > 1 else 0, mask_layout.head_div,
             tile.capacity),
            MASK_KIND=mask_kind_code, HEAD_DIM=shape.head_dim, BLOCK_D=problem.block_d,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, GROUP_PACK=tile.group_pack,
            HAS_BIAS=bias_layout is not None,
            BIAS_ROW=bias_layout is not None and problem.bias.one_row
            and problem.bias.shared_by(tile.group_pack),
            IS_CAUSAL=problem.is_causal, SPLIT_KEYS=tile.key_splits > 1,
            ROW_TESTS=shape.seqlen_q > 1, **dot_options(query.dtype, problem.interpreted),
            num_warps=tile.num_warps, num_stages=2)
        part_shape = (tile.key_splits, shape.batch * shape.heads_q, shape.seqlen_q,
                      problem.block_d)
        parts = ((part_shape, torch.float32), (part_shape[:3], torch.float32),
                 ((programs,), torch.int32)) if tile.key_splits > 1 else ()
        # The list passes write every entry the forward reads (a list up to its count).
        lists = tuple((shape, torch.int32, WRITTEN_FIRST) for shape in (
            (list_rows, tile.capacity), (list_rows,)))
        if self.one_pass is None:  # the chunks' counts and bits
            lists += tuple((shape, torch.int32, WRITTEN_FIRST) for shape in (
                (list_rows, num_chunks), (list_rows, num_chunks * chunk // 32)))
        else:  # tickets and statuses: zeroed once, then never reset (each call's own tag)
            lists += (((list_rows,), torch.int64), ((list_rows, num_chunks), torch.int64))
        self._scratch = Scratch(query.device, *lists, *parts)
        self._scratch_with_lse = Scratch(query.device, (self.lse_shape, torch.float32), *lists,
                                         *parts)

    def run(self, query, key, value, mask_operand, bias, keep_lse: bool = True, lists=None):
        """(out (B, Lq, Hq, D), lse (B, Hq, Lq) float32 or None without ``keep_lse``).
        ``mask_operand``: the bool mask, interval words, or (start, end) as given. ``lists``:
        the kept keys and counts the mask's selection wrote (``KeyIntervals._kept_lists``, the
        keys the list passes would list, in the same order), or None; lists of another shape
        are not read."""
        start, end = mask_operand if isinstance(mask_operand, tuple) else (mask_operand,
                                                                          mask_operand)
        out = query.new_empty(self.out_shape)
        if keep_lse:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
            kept, counts, *passes = self._scratch.buffers()
        else:
            lse, kept, counts, *passes = self._scratch_with_lse.buffers()
        passes, parts = passes[:2], passes[2:]
        out_part, lse_part, arrivals = parts if parts else (lse, lse, counts)
        if self.kept_lists is not None:
            kept, counts = self.kept_lists
        elif lists is not None and tuple(t.shape for t in lists) == self.list_shapes:
            kept, counts = lists
        else:
            capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            keep = self.keeps_lists and launches_run() and not capturing
            if keep:
                kept, counts = torch.empty_like(kept), torch.empty_like(counts)
            if self.one_pass is not None:
                self.one_pass(start, end, kept, counts, *passes)
            else:
                self.counts(start, end, kept, counts, *passes)
                self.lists(start, end, kept, counts, *passes)
            if keep:
                self.kept_lists = kept, counts
        self.main(query, key, value, out, lse, start, end,
                  out if bias is None else bias, kept, counts, out_part, lse_part, arrivals)
        return out, (lse if keep_lse else None)
