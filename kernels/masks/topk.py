"""flash-dmattn's dynamic top-W mask for a per-key bias, as :class:`KeyIntervals`.

The mask: at query row ``i``, keep the ``window`` visible keys with the largest bias (every
visible key when at most ``window`` are visible). Visible means every key, or ``j <= i + Lk -
Lq`` with bottom-right causality. Ranking: key ``k`` beats key ``j`` when its bias is larger, or
equal with a smaller index. A NaN bias ranks as -inf (below every number, tied with -inf).

Why each key is kept for one run of rows: visible sets only grow with the row, so the number of
visible keys that beat ``j`` only grows too. Key ``j`` is kept from the first row that sees it,
``start_j`` (0, or ``max(0, j - (Lk - Lq))`` when causal), until the row at which the W-th key
that beats it becomes visible. Without causality every key is visible at once, so ``j`` is kept
for every row iff fewer than W keys beat it. With causality the W-th key that beats ``j`` to
become visible is the one with the W-th smallest position among those that beat ``j``; with the
keys sorted by (bias descending, index ascending), those are the keys ranked before ``j``. So
for every key we need the W-th smallest value of a range of the permutation "position by rank".

``_kth_smallest`` answers all those queries at once in O(L log L) torch ops with a wavelet
matrix over positions: at each bit of the position, from the highest, the permutation is split
stably into the keys with a 0 bit and those with a 1 bit (a prefix sum gives each key's place);
every query looks at how many 0-bit keys its range holds, steps into the half that holds its
answer and records the bit. Each level is used by every query before the next is built, so the
memory is O(L) per row whatever the depth.

On CUDA tensors, and on CPU tensors under Triton's interpreter (as every kernel of this package
runs there), the causal selection takes Triton kernels instead (``_wavelet``): one launch per
bit level, and one that walks every query down all levels and writes the intervals. They give
the bits of the torch ops, and keep every level's rank table (L / 4 bytes a level per row).
CPU tensors without the interpreter, and selections without causality (no wavelet matrix),
take the torch ops. ``USE_KERNELS = False`` sends every call to the torch ops.

The entry point, ``kernels.topk_intervals`` (``kernels.topk_ops``), checks its arguments and
calls ``_rows_direct`` for dense rows and ``_packed`` for packed sequences; on a GPU it replays
the dense selection as a CUDA graph, and under ``torch.compile`` it calls both as custom ops.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..runtime.arith import ceil_div, next_power_of_2
from ..runtime.launch import PlannedLaunch, is_interpreted
from ..triton_device.selection_kernels import _few_rows_kernel, _top_window_kernel
from . import wavelet as _wavelet
from .grouping import grouping_order
from .intervals import KeyIntervals
from .packed_seqlens import PackedKeys, check_cu_seqlens


# Keys per step of ``_top_window_kernel``'s walks along a slice of a row, the most slices a
# row is cut into, and the 8-bit digits (from the top of a float32's ordered bits) that tell
# a dtype's values apart: bfloat16 has 16 bits, float16 19 (its 10 mantissa bits sit 13
# above float32's lowest). One program per row walking it whole took 77 us at B8 Hk8 Lk32768
# (H200): ~3 us a step of 4096 keys; 16 slices of 2048 keys, 49 us for the three launches.
TOP_WINDOW_BLOCK = 2048
TOP_WINDOW_MAX_SLICES = 32
# Causal selections of at most this many query rows (decode, speculative or chunked) take
# ``_few_rows``: one top-W selection and a few small torch ops, where the wavelet matrix's
# launches (one per bit level and a sort) cost 0.5-0.9 ms at B8 Hk8 Lk32768 on the H200.
FEW_ROWS_MAX = 16
# ... whose work after the selection is one launch (``_few_rows_kernel``: one program per row,
# keys per step) where the torch ops were ~35 launches, ~1.3 ms of host time per eager step
# at Lq4 on the H200's host (B8 Hk8 Lk32768 W2048: 0.25 ms of GPU time). Measured there, a whole
# eager selected step (selection and attention): Lq4 1009 -> 140 us, Lq16 1026 -> 251 us, Lq1
# (one window, no finish) 111 us either way; the same intervals bitwise.
FEW_ROWS_KERNEL = True
FEW_ROWS_BLOCK = 1024
# The selection's launches, planned per form (rows, length, row stride, dtype, device, window,
# query rows), the least recently made dropped first: ``runtime.launch`` plans every call's
# launch anew, host time a kept plan skips (not measured apart: the whole eager select step
# read 157-176 us of host time on the H200's host either way, noisily).
MAX_WINDOW_FORMS = 16
_window_launches: OrderedDict = OrderedDict()
KEY_DIGITS = {torch.bfloat16: 2, torch.float16: 3, torch.float32: 4}

# False: every call takes the torch ops, on every device (to compare the two paths). Read at
# call time; a CUDA graph already captured keeps the path it captured.
USE_KERNELS = True


def _kth_smallest(values: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                  k: torch.Tensor) -> torch.Tensor:
    """Per row r and query q: the k[r, q]-th smallest (from 0) of ``values[r, lo:hi]``.

    ``values``: (R, n) int64 in [0, n), distinct within a row. ``lo``, ``hi``, ``k``: (R, m)
    int64 with 0 <= lo <= hi <= n (every query stays inside the arrays). The answer is the
    k-th smallest when 0 <= k < hi - lo, and some value in [0, 2**bits) otherwise.
    """
    rows, n = values.shape
    bits = max(1, (n - 1).bit_length())
    places = torch.arange(n, device=values.device)
    zeros_before = torch.zeros(rows, n + 1, dtype=torch.int64, device=values.device)
    answer = torch.zeros_like(k)
    current = values
    for level in range(bits):
        shift = bits - 1 - level
        bit = (current >> shift) & 1
        zeros_before[:, 1:] = torch.cumsum(1 - bit, dim=1)
        zeros_total = zeros_before[:, -1:]
        # -- step every query into the half (0 bits first) that holds its answer
        zeros_lo = zeros_before.gather(1, lo)
        zeros_hi = zeros_before.gather(1, hi)
        zeros_in = zeros_hi - zeros_lo
        left = k < zeros_in
        answer |= (~left).to(torch.int64) << shift
        k = torch.where(left, k, k - zeros_in)
        lo = torch.where(left, zeros_lo, zeros_total + lo - zeros_lo)
        hi = torch.where(left, zeros_hi, zeros_total + hi - zeros_hi)
        # -- stable partition by this bit for the next level
        if level + 1 < bits:
            before = zeros_before[:, :-1]
            place = torch.where(bit == 0, before, zeros_total + places - before)
            current = torch.empty_like(current).scatter_(1, place, current)
    return answer


def _rank_order(bias: torch.Tensor, group: torch.Tensor | None) -> torch.Tensor:
    """(R, n) positions sorted by (group, bias descending, position); NaN ranks as -inf."""
    bias = torch.nan_to_num(bias, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    order = torch.sort(bias, dim=-1, descending=True, stable=True).indices
    if group is not None:
        by_group = torch.sort(group.gather(-1, order), dim=-1, stable=True).indices
        order = order.gather(-1, by_group)
    return order


def _intervals(bias: torch.Tensor, window: int, is_causal: bool, seqlen_q: int | None,
               keys: PackedKeys | None) -> tuple[torch.Tensor, torch.Tensor]:
    """start and end, (R, n) int64 or int32 in each sequence's own row coordinates, for the
    bias (R, n) of the packed keys ``keys`` describes, or with ``keys`` None of one sequence of
    n keys and ``seqlen_q`` queries. Causal selections on CUDA (and on the CPU under Triton's
    interpreter) take the kernels of ``_wavelet``, which give int32 directly."""
    rows, n = bias.shape
    packed = keys is not None
    order = _rank_order(bias, keys.seq.expand(rows, n) if packed else None)
    if is_causal and USE_KERNELS and _wavelet.runs_kernels(bias.device, n):
        return _wavelet.causal_intervals(order, window, seqlen_q, keys)
    if keys is None:
        keys = PackedKeys.single(seqlen_q, n, bias.device)
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(n, device=bias.device).expand(rows, n))
    # A sequence's ranks begin where its positions begin, so the keys that beat key p are
    # those ranked key_start[p] .. rank[p] - 1.
    lo = keys.key_start.expand(rows, n)
    kept_all = rank - lo < window
    seqlen_q = keys.seqlen_q.expand(rows, n)
    if not is_causal:
        return torch.zeros_like(rank), torch.where(kept_all, seqlen_q, 0)
    offset = keys.seqlen_k - keys.seqlen_q
    start = (keys.local - offset).clamp(min=0).expand(rows, n)
    # Keys with fewer than W beating keys ask too (any k, lo <= hi is a valid query); their
    # answer is not used.
    wth = _kth_smallest(order, lo.contiguous(), rank, torch.full_like(rank, window - 1)) - lo
    # The W-th beating key becomes visible at row wth - offset: the first row without p.
    end = torch.where(kept_all, seqlen_q, torch.minimum((wth - offset).clamp(min=0), seqlen_q))
    return start, end


# Below these ratios of visible keys to the window, a key order saves too little to pay for
# its copies of K and V (counted tiles, ``kernels.masks.key_order``: causal top-2048 at L = 4096
# skips 10% more tiles sorted, at 8192 1.8x as many). Without causality every row sees all
# Lk keys, so the kept keys fill W of Lk positions in order, Lk / W of every tile otherwise.
ORDER_MIN_KEYS_PER_WINDOW = {True: 4, False: 2}
# Query rows below which a call is decode-like: its K and V copies cost as much as the keys
# the order lets it skip.
ORDER_MIN_ROWS = 256
# An ordered call costs ~0.17-0.30 ms of host time more than a plain one (the gathers of K, V
# and the bias; H100 host, one process), so the order must save more GPU time than that. The
# estimate (``saved_tiles``) in 128 x 64 tiles, summed over the selection's (batch, head)
# rows, against H100 forwards (plain / ordered ms, D128 unless named):
#   B1 H8/2 L2048 W256: 358 tiles, 0.072 / 0.205;  H2/1 L16384 D64 W32: 1960, 0.097 / 0.188;
#   H16/4 L4096 W1024: 1950, 0.268 / 0.340 (D32 0.171 / 0.346);
#   H2/1 L16384 D64 W4096: 7780, 0.388 / 0.212;  H2/1 L16384 D64 W256: 15800, 0.332 / 0.171;
#   B2 H16/4 L8192 W1024: 23500, 1.98 / 0.71;  H16/4 L16384 W2048 (longctx): 4.03 / 1.94.
ORDER_MIN_SAVED_TILES = 5000
# Under Triton's interpreter (CPU tests) the shape rules above alone decide, so that small
# test shapes take the ordered path as the GPU's long calls do.
ORDER_MIN_SAVED_TILES_INTERPRETED = 0


def saved_tiles(seqlen_q: int, seqlen_k: int, window: int, is_causal: bool) -> float:
    """128 x 64 tiles a key order saves one (batch, head) row of a top-``window`` selection,
    estimated from the shape: in key order a row tile walks about min(visible keys / 64,
    window / 2) key blocks (the kept keys of a random bias scatter one to a block until the
    blocks run out; small windows keep fewer distinct keys, as the largest biases stay kept);
    in the order, about 1.2 tiles for every tile's worth of kept pairs."""
    offset = seqlen_k - seqlen_q
    if is_causal:
        rows = max(0, min(seqlen_q, seqlen_k - offset))  # rows that see a key
        first = max(0, -offset)
        visible_mean = max(0.0, offset + first + (rows + 1) / 2)
        # rows whose visible keys number fewer than the window keep all of them
        short = max(0, min(rows, window - offset - first - 1))
        kept = short * (offset + first) + short * (short + 1) / 2 + (rows - short) * window
    else:
        visible_mean = seqlen_k
        kept = seqlen_q * min(seqlen_k, window)
    plain = -(-seqlen_q // 128) * min(visible_mean / 64, window / 2)
    return plain - 1.2 * kept / (128 * 64)


def orders_keys(seqlen_q: int, seqlen_k: int, window: int, is_causal: bool,
                rows: int = 1) -> bool:
    """Whether ``topk_intervals`` gives its intervals a key order (``order_keys=None``), for
    ``rows`` (batch x head) rows of the selection."""
    if (seqlen_q < ORDER_MIN_ROWS
            or seqlen_k < ORDER_MIN_KEYS_PER_WINDOW[bool(is_causal)] * window):
        return False
    least = (ORDER_MIN_SAVED_TILES_INTERPRETED if is_interpreted(_wavelet._level_kernel)
             else ORDER_MIN_SAVED_TILES)
    return rows * saved_tiles(seqlen_q, seqlen_k, window, is_causal) >= least


def kept_union(window: int, seqlen_q: int, seqlen_k: int, is_causal: bool) -> int:
    """The most distinct keys a top-``window`` selection keeps over all its query rows, per
    (batch, head): each row keeps at most W; with causality each row sees one key more than
    the row before, which enters the top W at most in place of one key, so Lq rows keep at
    most W + Lq - 1 keys; without it every row keeps the same W."""
    return min(seqlen_k, window + seqlen_q - 1 if is_causal else window)


def _rows_direct(bias, window, seqlen_q, is_causal, ordered=False) -> tuple[torch.Tensor, ...]:
    """int32 (start, end) of the (R, Lk) bias rows, one sequence each, and with ``ordered``
    their key order (``grouping.grouping_order``); capturable."""
    if _one_window_form(is_causal, seqlen_q, ordered):
        return _one_window(bias, window, seqlen_q)[:2]
    if _few_rows_form(bias, window, seqlen_q, is_causal, ordered):
        return _few_rows(bias, window, seqlen_q)[:2]
    start, end = _intervals(bias, window, is_causal, seqlen_q, None)
    start, end = start.to(torch.int32), end.to(torch.int32)
    return (start, end, grouping_order(start, end)) if ordered else (start, end)


def _one_window_form(is_causal, seqlen_q, ordered) -> bool:
    """Whether every query row keeps the same W keys (``_one_window``)."""
    return not ordered and (not is_causal or seqlen_q == 1)


def _few_rows_form(bias, window, seqlen_q, is_causal, ordered) -> bool:
    """Whether a causal selection takes ``_few_rows``: at most ``FEW_ROWS_MAX`` query rows,
    a window of at least that many keys and fewer than the first row sees, on the kernels."""
    first_row_keys = bias.shape[1] - seqlen_q + 1
    return (is_causal and not ordered and 1 < seqlen_q <= FEW_ROWS_MAX
            and seqlen_q <= window < first_row_keys and _runs_top_window(bias, first_row_keys))


def _few_rows(bias, window, seqlen_q, with_lists: bool = False) -> tuple:
    """Causal int32 (start, end) of the (R, Lk) bias rows for a few query rows (Lq - 1 = e
    keys past the first row's, key Lk - Lq + t first seen by row t), from one top-W selection
    of the first row's keys (``_top_window``, with its lists). Of those W, the first W - e
    (by rank) stay to the last row: only e later keys can push a key out. Each of the other
    2e candidates (the selection's last e, the e later keys) is beaten by c = W - e + (the
    last e that beat it) of the first row's keys, and leaves at the row that sees the
    (W - c)-th later key beating it: row t for key Lk - Lq + t (never: Lq; at once: 0). The
    bits of ``_intervals``: end = 0 where W keys of the first row beat a key, whatever its
    start. Then, with ``with_lists``, the keys some row keeps as decode's gather route lists
    them ((R, W + e) int32 in key order: the selection's W, then the later keys some row
    keeps; and (R,) int32 counts), else None. After the selection, one launch
    (``_few_rows_kernel``, where ``FEW_ROWS_KERNEL``) or the torch ops below."""
    rows, n = bias.shape
    offset = n - seqlen_q  # row r sees keys <= r + offset
    extra = seqlen_q - 1
    if bias.stride(-1) != 1:
        bias = bias.contiguous()
    first_row = bias[:, :offset + 1]
    if FEW_ROWS_KERNEL:  # the selection's lists alone: the kernel writes the rest
        _, _, (kept, _) = _top_window(first_row, window, 1, with_lists=True,
                                      with_intervals=False)
        return _few_rows_launch(bias, kept, window, seqlen_q, with_lists)
    _, _, (kept, _) = _top_window(first_row, window, 1, with_lists=True)
    kept = kept.long()  # (R, W) in key order: the stable sort ranks ties by key
    inf = float("inf")
    values = torch.nan_to_num(bias.gather(1, kept).float(), nan=-inf, posinf=inf, neginf=-inf)
    last = torch.sort(values, dim=1, descending=True, stable=True).indices[:, window - extra:]
    last_keys, last_values = kept.gather(1, last), values.gather(1, last)
    later_keys = torch.arange(offset + 1, n, device=bias.device).expand(rows, extra)
    later_values = torch.nan_to_num(bias[:, offset + 1:].float(), nan=-inf, posinf=inf,
                                    neginf=-inf)
    keys = torch.cat((last_keys, later_keys), dim=1)[:, :, None]  # (R, 2e, 1)
    values_c = torch.cat((last_values, later_values), dim=1)[:, :, None]

    def beating(other_values, other_keys):  # (R, 2e, e): other key k beats candidate j
        return ((other_values[:, None, :] > values_c)
                | ((other_values[:, None, :] == values_c) & (other_keys[:, None, :] < keys)))

    needed = extra - beating(last_values, last_keys).sum(-1)  # later keys that push it out
    seen = torch.cumsum(beating(later_values, later_keys), dim=-1)  # by row 1 .. e
    reached = seen >= needed[:, :, None]
    leaves = torch.where(reached.any(-1), reached.to(torch.int32).argmax(-1) + 1, seqlen_q)
    leaves = torch.where(needed <= 0, 0, leaves).to(torch.int32)
    end = torch.zeros((rows, n), dtype=torch.int32, device=bias.device)
    end.scatter_(1, kept, seqlen_q)
    end.scatter_(1, last_keys, leaves[:, :extra])
    end[:, offset + 1:] = leaves[:, extra:]
    start = (torch.arange(n, dtype=torch.int32, device=bias.device) - offset).clamp_(min=0)
    lists = None
    if with_lists:  # the later keys some row keeps, moved to the front in key order
        later_kept = leaves[:, extra:] > torch.arange(1, seqlen_q, device=bias.device)
        front = torch.sort((~later_kept).to(torch.uint8), dim=1, stable=True).indices
        lists = (torch.cat((kept, later_keys.gather(1, front)), dim=1).to(torch.int32),
                 (window + later_kept.sum(1)).to(torch.int32))
    return start.expand(rows, n).contiguous(), end, lists


def _few_rows_launch(bias, kept, window, seqlen_q, with_lists) -> tuple:
    """``_few_rows``'s outputs from ``_few_rows_kernel`` (bias rows of unit key stride and the
    first row's top-W list); its launch planned once per form."""
    rows, n = bias.shape
    form = ("few rows", rows, n, bias.stride(0), bias.dtype, bias.device, window, seqlen_q,
            with_lists)
    planned = _planned_launches(form, lambda: PlannedLaunch(
        _few_rows_kernel, (rows,), None, (n, bias.stride(0), window, seqlen_q), num_warps=4,
        num_stages=1, DIGITS=KEY_DIGITS[bias.dtype], BLOCK=FEW_ROWS_BLOCK,
        E=next_power_of_2(FEW_ROWS_MAX), WRITE_LIST=with_lists))
    start = torch.empty((rows, n), dtype=torch.int32, device=bias.device)
    end = torch.empty_like(start)
    lists = None
    if with_lists:
        lists = (torch.empty((rows, window + seqlen_q - 1), dtype=torch.int32,
                             device=bias.device),
                 torch.empty((rows,), dtype=torch.int32, device=bias.device))
    planned(bias, kept, start, end, *(lists or (start, start)))  # unread stand-ins
    return start, end, lists


def _runs_top_window(bias, n) -> bool:
    """Whether rows of ``n`` values of ``bias``'s dtype and device take ``_top_window``."""
    return USE_KERNELS and bias.dtype in KEY_DIGITS and _wavelet.runs_kernels(bias.device, n)


def _one_window(bias, window, seqlen_q, with_lists: bool = False) -> tuple:
    """int32 (start, end) of the (R, Lk) bias rows where every query row keeps the same keys:
    without causality, or with one query row (decode), which sees every key; then, with
    ``with_lists``, the kept keys as decode's gather route lists them ((R, W) int32 in key
    order, and (R,) int32 counts), else None. Where the kernels run
    (``_wavelet.runs_kernels``; a 16- or 32-bit float bias): a radix select of the W-th
    largest bias per row and the keys above it or tied with it by index
    (``_top_window_kernel``), which writes the lists too. Elsewhere the same from
    ``torch.topk``'s W-th value in torch ops, without lists. No sort either way."""
    rows, n = bias.shape
    if window >= n:
        return (torch.zeros((rows, n), dtype=torch.int32, device=bias.device),
                torch.full((rows, n), seqlen_q, dtype=torch.int32, device=bias.device), None)
    if _runs_top_window(bias, n):
        return _top_window(bias if bias.stride(-1) == 1 else bias.contiguous(), window,
                           seqlen_q, with_lists)
    ranked = torch.nan_to_num(bias, nan=float("-inf"), posinf=float("inf"),
                              neginf=float("-inf"))
    threshold = torch.topk(ranked, window, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above = ranked > threshold
    ties = ranked == threshold
    room = window - above.sum(-1, keepdim=True, dtype=torch.int32)
    kept = above | (ties & (torch.cumsum(ties, -1, dtype=torch.int32) <= room))
    start = torch.zeros((rows, n), dtype=torch.int32, device=bias.device)
    return start, kept.to(torch.int32) * seqlen_q, None


def _top_window(bias, window, seqlen_q, with_lists: bool, with_intervals: bool = True
                ) -> tuple:
    """``_one_window`` by ``_top_window_kernel``'s launches, bias rows of unit key stride;
    without ``with_intervals`` start and end are None (the lists alone are written). The
    launches are planned once per form (``_window_launches``)."""
    rows, n = bias.shape
    form = (rows, n, bias.stride(0), bias.dtype, bias.device, window, seqlen_q,
            TOP_WINDOW_BLOCK, TOP_WINDOW_MAX_SLICES, with_lists, with_intervals)
    scratch_len, launches = _planned_launches(form, lambda: _plan_top_window(
        rows, n, bias.stride(0), bias.dtype, window, seqlen_q, with_lists, with_intervals))
    scratch = torch.empty(scratch_len, dtype=torch.int32, device=bias.device)
    start = end = None
    if with_intervals:
        start = torch.empty((rows, n), dtype=torch.int32, device=bias.device)
        end = torch.empty_like(start)
    lists = None
    if with_lists:
        lists = (torch.empty((rows, window), dtype=torch.int32, device=bias.device),
                 torch.empty((rows,), dtype=torch.int32, device=bias.device))
    kept, counts = lists or (scratch, scratch)  # unread stand-ins where not written
    for planned_launch in launches:
        planned_launch(bias, scratch, scratch if start is None else start,
                       scratch if end is None else end, kept, counts)
    return start, end, lists


def _planned_launches(form: tuple, make):
    """The selection's launches of ``form``, made by ``make()`` on first use and kept in
    ``_window_launches`` (the least recently made dropped first)."""
    planned = _window_launches.get(form)
    if planned is None:
        planned = _window_launches[form] = make()
        while len(_window_launches) > MAX_WINDOW_FORMS:
            _window_launches.popitem(last=False)
    return planned


def _plan_top_window(rows, n, stride_row, dtype, window, seqlen_q, with_lists: bool,
                     with_intervals: bool) -> tuple[int, tuple]:
    """(the int32 scratch's length, the launches) of one selection form. The slices are
    about one step of ``TOP_WINDOW_BLOCK`` keys each, at most ``TOP_WINDOW_MAX_SLICES``; their
    number is the grid's (not compiled in)."""
    digits = KEY_DIGITS[dtype]
    block, most = TOP_WINDOW_BLOCK, TOP_WINDOW_MAX_SLICES
    slices = min(ceil_div(n, block), most)
    slice_len = ceil_div(n, slices * block) * block
    launches = tuple(
        PlannedLaunch(_top_window_kernel, (rows, slices), None,
                      (n, stride_row, window, seqlen_q, slice_len), num_warps=8, num_stages=2,
                      DIGIT=digit, DIGITS=digits, SLICES=most, BLOCK=block,
                      WRITE_LIST=with_lists, WRITE_INTERVALS=with_intervals)
        for digit in range(digits + 1))
    return digits * rows * (most * 256 + 2), launches


def _check_packed(bias) -> None:
    if bias.dim() != 2:
        raise ValueError(f"bias must be (H, total_k) with cu_seqlens, got shape "
                         f"{tuple(bias.shape)}")
    if bias.shape[0] == 0:
        raise ValueError(f"bias must have at least one head, got shape {tuple(bias.shape)}")


def _packed(bias, window, is_causal, cu_seqlens_q, cu_seqlens_k) -> KeyIntervals:
    _check_packed(bias)
    total_k = bias.shape[1]
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, bias.device)
    if cu_seqlens_q is None:
        cu_seqlens_q = cu_seqlens_k
    else:
        check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, bias.device)
        if cu_seqlens_q.shape != cu_seqlens_k.shape:
            raise ValueError(f"cu_seqlens_q must have the shape of cu_seqlens_k "
                             f"{tuple(cu_seqlens_k.shape)}, got {tuple(cu_seqlens_q.shape)}")
    if total_k == 0:
        raise ValueError("cu_seqlens_k: the packed keys must not all be empty (total_k = 0)")
    keys = PackedKeys.build(cu_seqlens_q, cu_seqlens_k, total_k)
    start, end = _intervals(bias, window, is_causal, None, keys)
    return KeyIntervals(start[None].to(torch.int32), end[None].to(torch.int32))

