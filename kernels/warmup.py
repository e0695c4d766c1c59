"""Compile ahead the kernels a model's calls will need, and count compiles.

A launch is compiled for a canonical form of its arguments (``forms.compile_form``), so the
lengths of a call change what it compiles only through two things: whether its lengths keep
its strides multiples of 16 (two variants of each kernel), and the schedule, which changes at a
few length thresholds (key splits where a short grid underfills the GPU, group packing for
decode-sized query lengths). ``warmup`` runs one forward and backward of the described form at
an aligned and an unaligned length next to each length given, which compiles both variants of
the schedule each length takes, so that later calls at other lengths of the same ranges
compile nothing. With a bool mask on a Hopper GPU it also calls with the every-pair mask
prepared (``prepare_mask``), the form that takes the Hopper forward's masked kernel.

A model whose mask is ``topk_intervals`` of a per-key bias (Doge) calls in one of two forms,
chosen by the length (``topk.orders_keys``): below the ordering threshold plain
intervals with the call's causality; from it on intervals with a key order, which the call
runs with K and V gathered (widened to the selection's heads where those are more) and
``is_causal`` False (``kernels.masks.key_order``). ``warmup(window=...)`` makes its interval masks
the same way, so each length takes the form a model's call at that length takes; where the
lengths lie on both sides of the threshold it also runs the lengths next to it on each side,
the ends of each form's range.

On a GPU the warm-up compiles in parallel: a first pass makes the calls with every launch only
handing the compile of its form to a thread pool (``launch.compile_only``), and waits for all
of them; a second pass makes the calls for real, which finds every kernel compiled (any form
the first pass did not reach compiles there, serially).
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from .interface import dmattn_func
from .masks.intervals import KeyIntervals
from .masks.topk import ORDER_MIN_KEYS_PER_WINDOW, ORDER_MIN_ROWS, kept_union, orders_keys
from .planning.backward import scheduled_as_captured
from .planning.backward_schedule import BackwardRoute, dkdv_takes_wide_tile, schedule_backward
from .planning.forward import interpreted
from .planning.forward_schedule import interval_tile_rows
from .planning.gather_decode import lists_pay
from .planning.inputs import AttnShape
from .planning.problem import OperandLayout, Problem
from .planning.tuning import (GATHER_MAX_KEPT_SHARE, GATHER_MAX_ROWS,
                              HOPPER_FORWARD_THREE_MAX_HEAD_DIM, HOPPER_FORWARD_THREE_MIN_LENGTH)
from .prepared import prepare_mask
from .runtime.device import capability, multiprocessors
from .runtime.forms import compiled_forms
from .runtime.launch import compile_only, launches_run
from .warmup_forms import (BIAS_FORMS, MASK_FORMS, PackedDocuments, form_call, form_calls,
                           form_inputs)


@dataclass(frozen=True)
class WarmupReport:
    """What ``warmup`` ran: the lengths, how many kernel forms it compiled (or, under the
    interpreter, would have), how many of those its parallel pass did not reach (compiled one
    at a time in the calls that ran), the threads that compiled, and its wall time in
    seconds."""

    seqlens: tuple[int, ...]
    compiled: int
    seconds: float
    compiled_serially: int = 0
    workers: int = 1


def warmup_lengths(seqlen: int) -> tuple[int, int]:
    """An aligned (a multiple of 16) and an unaligned length beside ``seqlen``: the two variants
    of every kernel that lengths in its schedule's range compile."""
    if seqlen < 1:
        raise ValueError(f"warmup: seqlens must be positive, got {seqlen}")
    aligned = max(16, seqlen - seqlen % 16)
    unaligned = seqlen if seqlen % 16 else seqlen + 1
    return aligned, unaligned


def ordering_threshold(window: int, is_causal: bool, rows: int = 1) -> int:
    """The shortest length L at which ``topk_intervals`` gives the intervals of a call with
    L query rows, L keys and ``rows`` (batch x head) selection rows a key order
    (``orders_keys``); every longer length gets one too (its saving grows with L)."""
    low = max(ORDER_MIN_ROWS, ORDER_MIN_KEYS_PER_WINDOW[bool(is_causal)] * window)
    high = low
    while not orders_keys(high, high, window, is_causal, rows):
        high *= 2
    while low < high:  # the first ordered length in [low, high]
        middle = (low + high) // 2
        if orders_keys(middle, middle, window, is_causal, rows):
            high = middle
        else:
            low = middle + 1
    return low


def window_lengths(lengths, window: int, is_causal: bool, rows: int = 1) -> tuple[int, ...]:
    """``lengths`` (warm-up lengths), and where some of them fall below the ordering threshold
    and some at or above it, an aligned and an unaligned length on each side next to it: the
    ends of the plain form's range and the ordered form's."""
    return threshold_lengths(lengths, ordering_threshold(window, is_causal, rows))


def first_length(holds, limit: int) -> int | None:
    """The shortest length L <= ``limit`` at which ``holds(L)`` (a rule that, once true, holds
    for every longer length), or None where it does not hold at ``limit``."""
    if not holds(limit):
        return None
    low, high = 1, limit
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if holds(middle) else (middle + 1, high)
    return low


def square_problem(seqlen: int, batch: int, heads_q: int, heads_kv: int, head_dim: int, dtype,
                   device, is_causal: bool, gpu: tuple[int, int] | None = None) -> Problem:
    """A dense call of ``seqlen`` query rows and keys on ``device`` (a GPU of compute
    capability ``gpu``), its operands laid out for TMA: what the schedule's shape rules read."""
    device = torch.device(device)
    on_interpreter = interpreted()
    shape = AttnShape(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen,
                      seqlen_k=seqlen, head_dim=head_dim)
    return Problem(shape, dtype, device, on_interpreter,
                   multiprocessors(device, on_interpreter), is_causal=is_causal,
                   softmax_scale=1.0, capability=gpu, tma_operands=True)


def wide_tile_threshold(batch: int, heads_q: int, heads_kv: int, head_dim: int, dtype,
                        device, limit: int) -> int | None:
    """The shortest length L <= ``limit`` at which a call with L query rows and L keys takes
    dkdv's wide tile by the shape rule (``backward_schedule.dkdv_takes_wide_tile``; every longer
    length does too), or None."""
    return first_length(lambda seqlen: dkdv_takes_wide_tile(square_problem(
        seqlen, batch, heads_q, heads_kv, head_dim, dtype, device, is_causal=False)), limit)


def hopper_backward_threshold(batch: int, heads_q: int, heads_kv: int, head_dim: int, dtype,
                              device, is_causal: bool, limit: int,
                              whole_groups: bool = False) -> int | None:
    """The shortest length L <= ``limit`` from which a call with L query rows and L keys takes
    the Hopper backward by default (``hopper_backward.takes_hopper_backward``: its query blocks
    walked per key block grow with L), or with ``whole_groups`` takes it with a program per GQA
    group rather than per query head (``backward_schedule.split_heads``: the longest walk's
    share falls with L); None: never, or not on this GPU."""
    gpu = capability(torch.device(device), interpreted())
    if gpu is None:
        return None

    def holds(seqlen: int) -> bool:  # the default schedule's own decision
        backward = schedule_backward(square_problem(
            seqlen, batch, heads_q, heads_kv, head_dim, dtype, device, is_causal, gpu), {})
        return (backward.route is BackwardRoute.HOPPER
                and not (whole_groups and backward.split_heads))

    return first_length(holds, limit)


def ordered_backward_threshold(batch: int, heads_q: int, heads_kv: int, head_dim: int, dtype,
                               device, window: int, limit: int) -> int | None:
    """The shortest length L <= ``limit`` from which a call with L query rows and L keys under
    key-ordered top-``window`` intervals takes the Hopper backward by default (it keeps enough
    pairs: ``tuning.HOPPER_BACKWARD_MIN_ORDERED_PAIRS``); None: never, or not on this GPU."""
    gpu = capability(torch.device(device), interpreted())
    if gpu is None:
        return None

    def holds(seqlen: int) -> bool:  # the default schedule's own decision
        ordered = replace(square_problem(seqlen, batch, heads_q, heads_kv, head_dim, dtype,
                                         device, False, gpu),
                          mask=OperandLayout((batch, heads_kv, 1, seqlen), heads_q // heads_kv),
                          tma_mask=True, intervals=True, row_kept=window)
        return schedule_backward(ordered, {}).route is BackwardRoute.HOPPER

    return first_length(holds, limit)


def threshold_lengths(lengths, threshold: int | None) -> tuple[int, ...]:
    """``lengths``, and where some lie below ``threshold`` and some at or above it, an aligned
    and an unaligned length on each side next to it: the ends of both forms' ranges."""
    lengths = set(lengths)
    if threshold is not None and min(lengths) < threshold <= max(lengths):
        below = threshold - 1
        lengths |= {below - below % 16, below if below % 16 else below - 1}
        lengths |= {threshold + (-threshold) % 16, threshold if threshold % 16 else threshold + 1}
    return tuple(sorted(lengths))


def gather_threshold(window: int, query_rows: int, is_causal: bool) -> int:
    """The shortest cache length at which decode calls of ``query_rows`` rows under a
    top-``window`` selection take the gather route (``gather_decode.lists_pay``); every longer
    cache does too."""
    kept = kept_union(window, query_rows, 2**62, is_causal)
    threshold = math.ceil(kept / GATHER_MAX_KEPT_SHARE)  # then the rule's own compare decides
    while not lists_pay(kept, threshold):
        threshold += 1
    while threshold > 1 and lists_pay(kept, threshold - 1):
        threshold -= 1
    return threshold


def call_lengths(seqlens, *, batch: int, heads_q: int, heads_kv: int, head_dim: int, dtype,
                 device, mask: str, backward: bool, window: int | None,
                 selection_heads: int | None, is_causal: bool,
                 query_rows: int | None = None) -> tuple[int, ...]:
    """The lengths ``warmup`` calls at: an aligned and an unaligned length next to each of
    ``seqlens`` (``warmup_lengths``), and where those lie on both sides of a length at which
    the schedule changes, the two ends of each side (``threshold_lengths``): the ordering
    threshold with a ``window``, the Hopper forward's three consumer warpgroups without a mask
    at head dims up to 64, the forward's interval tile with interval masks
    (``forward_schedule.interval_tile_rows``), and dkdv's wide tile and the Hopper backward
    (on a Hopper GPU; with a ``window``, under key-ordered intervals too) with ``backward``.
    Decode calls (``query_rows``: the lengths are the caches') change form at one cache length
    only, with a ``window``: where they start to take the gather route
    (``gather_threshold``)."""
    lengths = sorted({length for seqlen in seqlens for length in warmup_lengths(int(seqlen))})
    if query_rows is not None:
        if window is not None:
            lengths = list(threshold_lengths(lengths, gather_threshold(window, query_rows,
                                                                       is_causal)))
        return tuple(lengths)
    if window is not None:
        rows = batch * (heads_kv if selection_heads is None else selection_heads)
        lengths = list(window_lengths(lengths, window, is_causal, rows))
    if mask == "none" and head_dim <= HOPPER_FORWARD_THREE_MAX_HEAD_DIM:
        # the Hopper forward takes three consumer warpgroups from one length
        # (``hopper_forward.takes_three_consumers``)
        lengths = list(threshold_lengths(lengths, HOPPER_FORWARD_THREE_MIN_LENGTH))
    if mask in ("intervals", "documents"):  # the forward's tile changes at one length
        lengths = list(threshold_lengths(lengths, interval_tile_rows(
            dtype, head_dim, interpreted())))
    if backward:  # dkdv's tile changes at one length (K and V widened to heads_q by an order)
        for kv_heads in {heads_kv, heads_q if selection_heads == heads_q else heads_kv}:
            lengths = list(threshold_lengths(lengths, wide_tile_threshold(
                batch, heads_q, kv_heads, head_dim, dtype, device, max(lengths))))
        # and the Hopper backward takes over at one length, its programs whole GQA groups
        # (rather than query heads) from another
        for whole_groups in (False, True):
            lengths = list(threshold_lengths(lengths, hopper_backward_threshold(
                batch, heads_q, heads_kv, head_dim, dtype, device, is_causal, max(lengths),
                whole_groups)))
        if window is not None:  # and, under key-ordered top-W intervals, at another
            lengths = list(threshold_lengths(lengths, ordered_backward_threshold(
                batch, heads_q, heads_kv, head_dim, dtype, device, window, max(lengths))))
    return tuple(lengths)


def takes_masked_hopper(query: torch.Tensor) -> bool:
    """Whether calls with ``query``'s device and dtype may take the Hopper forward's masked form:
    16-bit on a GPU of compute capability 9.0 (the forms' other conditions are the call's)."""
    return (query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16)
            and capability(query.device, False) == (9, 0))


def _check_window(window, selection_heads, mask: str, heads_q: int, heads_kv: int) -> None:
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"warmup: window must be a positive int or None, got {window!r}")
        if mask != "intervals":
            raise ValueError(f"warmup: window needs mask='intervals' (the top-window mask is "
                             f"key intervals), got mask={mask!r}")
    if selection_heads is None:
        return
    if window is None:
        raise ValueError("warmup: selection_heads needs a window (the heads of the bias the "
                         "window ranks)")
    if selection_heads.__class__ is not int or selection_heads not in (1, heads_kv, heads_q):
        raise ValueError(f"warmup: selection_heads must be one of "
                         f"{sorted({1, heads_kv, heads_q})} (1, heads_kv or heads_q), got "
                         f"{selection_heads!r}")


def warmup(*, seqlens, heads_q: int, head_dim: int, heads_kv: int | None = None,
           batch: int = 1, dtype: torch.dtype = torch.bfloat16, device=None,
           mask: str = "none", bias: str = "none", is_causal: bool = False,
           backward: bool | None = None, workers: int | None = None,
           window: int | None = None, selection_heads: int | None = None,
           query_rows: int | None = None, graphs: bool = False) -> WarmupReport:
    """Compile the kernels that calls of this form at lengths near ``seqlens`` will use.

    Runs one call (and its backward, with ``backward``; with interval masks then also a call
    without a gradient, as evaluation makes) at an aligned and an unaligned length
    next to each length in ``seqlens`` (``warmup_lengths``), with a mask twice: every pair
    visible and a scattered half (once with a ``window``: the selection's). ``mask`` is
    "none", "bool", "intervals" or "documents" (``dmattn_varlen_func`` over ``batch`` x the
    length tokens packed as documents, called twice with the same offsets, as a model's
    layers: the first makes its documents' tables itself, the second's packed mask is
    prepared, which takes other kernels), ``bias``
    "none", "kv_row" (B, Hk, 1, L; documents: (Hk, tokens)) or "full" (B, Hk,
    L, L); the call has the form a model's call of the same description has. Give the
    shortest and longest length a model uses: each schedule decision that follows the length
    (key splits where a short grid underfills the GPU, dkdv's stages) changes at one
    threshold, so lengths between them take forms the two ends compile; where dkdv's tile
    (``wide_tile_threshold``), the backward's route (``hopper_backward_threshold``, on a Hopper
    GPU) or, with interval masks, the forward's tile
    (``forward_schedule.interval_tile_rows``) changes between them, the lengths next to that
    threshold on each side run too (``call_lengths``). On the H100, after a warm-up at 1000
    and 8000, calls at 20 lengths between compiled nothing (``dmbench compile-cost --warmup``)
    before dkdv had a wide tile; with it, calls at 2048 and 2049 compiled one kernel each (the
    wide tile with head shares), which the lengths at that threshold now compile (not yet
    measured again on the GPU).

    ``window``: with mask "intervals", the calls' masks are ``topk_intervals`` of a random
    per-key bias with this window and ``is_causal``, as a model that keeps each row's
    ``window`` keys of largest bias (Doge) makes them: plain intervals below the ordering
    threshold (``ordering_threshold``: at least 256 and 4 windows causal, 2 windows not, and
    long enough for the order to save more than its host cost; it falls as the batch and the
    selection's heads grow) and intervals with a key order from it on, whose calls run with
    the keys gathered and ``is_causal`` False. Each length compiles the form of its side;
    where the warm-up lengths lie on both sides, the lengths next to the threshold on each
    side run too
    (``window_lengths``), so give the shortest and longest length as without a window.
    ``selection_heads``: the heads of the bias the window ranks, 1, ``heads_kv`` (the default:
    Doge ranks a (B, Hk, 1, L) bias) or ``heads_q`` (an order per query head, whose calls
    widen K and V to ``heads_q`` heads).

    ``query_rows``: decode. The calls have this many query rows (1 to
    ``tuning.GATHER_MAX_ROWS``: a decode step, speculative or chunked decode) against caches
    of lengths near ``seqlens``, without a backward, as a model generates; give the shortest
    and longest cache. With a ``window`` the caches at the length where the steps start to
    read only the kept keys (``gather_threshold``) run too. ``backward``: also run each call's
    backward (default: True, False with ``query_rows``).

    ``workers``: threads that compile at once on a GPU (default: the CPU count, at most 32);
    1 compiles each kernel when its call first launches it.

    ``graphs``: the calls will be captured into CUDA graphs too. A captured backward is
    scheduled by GPU time alone (``tuning.HOPPER_BACKWARD_SPLIT_CAPTURED``) and may take
    kernels an eager one does not; each call's backward then also runs once as a capture
    schedules it (``planning.backward.scheduled_as_captured``), so that capturing compiles
    nothing. It needs ``backward``.
    """
    if mask not in MASK_FORMS:
        raise ValueError(f"warmup: mask must be one of {', '.join(MASK_FORMS)}, got {mask!r}")
    if bias not in BIAS_FORMS:
        raise ValueError(f"warmup: bias must be one of {', '.join(BIAS_FORMS)}, got {bias!r}")
    if mask == "documents" and (bias == "full" or query_rows is not None):
        raise ValueError("warmup: mask='documents' (dmattn_varlen_func) takes bias 'none' or "
                         "'kv_row' and no query_rows")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                or workers < 1):
        raise ValueError(f"warmup: workers must be a positive int or None, got {workers!r}")
    seqlens = (seqlens,) if isinstance(seqlens, int) else tuple(seqlens)
    if not seqlens:
        raise ValueError("warmup: seqlens is empty; give the lengths a model will call with")
    heads_kv = heads_q if heads_kv is None else heads_kv
    _check_window(window, selection_heads, mask, heads_q, heads_kv)
    if query_rows is not None and (query_rows.__class__ is not int
                                   or not 1 <= query_rows <= GATHER_MAX_ROWS):
        raise ValueError(f"warmup: query_rows must be an int in [1, {GATHER_MAX_ROWS}] (a "
                         f"decode step's rows) or None, got {query_rows!r}")
    if backward is None:
        backward = query_rows is None
    elif backward.__class__ is not bool:
        raise ValueError(f"warmup: backward must be a bool or None, got {backward!r}")
    elif backward and query_rows is not None:
        raise ValueError("warmup: query_rows makes decode calls, which have no backward; "
                         "leave backward unset or False")
    if graphs.__class__ is not bool:
        raise ValueError(f"warmup: graphs must be a bool, got {graphs!r}")
    if graphs and not backward:
        raise ValueError("warmup: graphs warms the backward a CUDA graph capture schedules; "
                         "it needs backward (and no query_rows)")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = call_lengths(seqlens, batch=batch, heads_q=heads_q, heads_kv=heads_kv,
                           head_dim=head_dim, dtype=dtype, device=device, mask=mask,
                           backward=backward, window=window, selection_heads=selection_heads,
                           is_causal=is_causal, query_rows=query_rows)
    if window is not None:  # the selection's mask, whatever ``scattered`` says
        variants = (True,)
    else:  # every pair visible and a scattered half
        variants = (False, True) if mask not in ("none", "documents") else (False,)

    def make_calls():
        for seqlen in lengths:
            for scattered in variants:
                q, k, v, attn_mask, attn_bias = form_inputs(
                    batch, seqlen, heads_q, heads_kv, head_dim, dtype, device, mask, bias,
                    backward, scattered, window=window, selection_heads=selection_heads,
                    is_causal=is_causal, query_rows=query_rows)
                for _ in range(form_calls(mask)):
                    with torch.set_grad_enabled(backward):
                        out = form_call(q, k, v, attn_mask, attn_bias, is_causal)
                    if backward:
                        out.backward(torch.ones_like(out))
                    if graphs:  # the backward as a capture schedules it
                        with torch.enable_grad(), scheduled_as_captured():
                            out = form_call(q, k, v, attn_mask, attn_bias, is_causal)
                            out.backward(torch.ones_like(out))
                if mask == "bool" and not scattered and takes_masked_hopper(q) and launches_run():
                    # A prepared mask of mostly full tiles takes the Hopper forward's masked
                    # form (``hopper_forward.few_partial_tiles``), which a mask read by the
                    # call never reaches; preparing reads the mask, so only where launches run.
                    prepared = prepare_mask(attn_mask, q, k, is_causal=is_causal)
                    with torch.set_grad_enabled(backward):
                        out = dmattn_func(q, k, v, attn_mask=prepared, attn_bias=attn_bias,
                                          is_causal=is_causal)
                    if backward:
                        out.backward(torch.ones_like(out))
                if backward and mask == "intervals":
                    # Evaluation: without a gradient the forward may read new intervals
                    # itself (``forward_schedule.scan_keys``), a form of its own. New
                    # intervals with the same tensors: a second call with one object would
                    # prepare it.
                    fresh = attn_mask.keeping_subset(attn_mask.start, attn_mask.end)
                    with torch.no_grad():
                        dmattn_func(q, k, v, attn_mask=fresh, attn_bias=attn_bias,
                                    is_causal=is_causal)
                if backward and mask == "documents":
                    # Evaluation over new offsets: the first call, without a gradient, may
                    # read the packed mask itself, as above; the second walks the documents.
                    fresh = PackedDocuments(attn_mask.cu_seqlens.clone(), attn_mask.max_seqlen)
                    with torch.no_grad():
                        for _ in range(form_calls(mask)):
                            form_call(q, k, v, fresh, attn_bias, is_causal)

    before, started = compiled_forms(), time.perf_counter()
    on_gpu = torch.device(device).type == "cuda"
    threads = min(32, os.cpu_count() or 1) if workers is None else workers
    parallel = on_gpu and threads > 1
    if parallel:
        with ThreadPoolExecutor(threads) as pool, compile_only(pool):
            make_calls()
    reached = compiled_forms()
    make_calls()
    if on_gpu:
        torch.cuda.synchronize(device)
    return WarmupReport(tuple(lengths), compiled_forms() - before,
                        time.perf_counter() - started,
                        compiled_serially=compiled_forms() - reached,
                        workers=threads if parallel else 1)
