"""The top-W keys of per-key bias rows where every query row keeps the same W (one query row,
or no causality): ``masks.topk``'s decode selection, as a radix select spread over the GPU.

Each bias is read as an unsigned 32-bit key that sorts as the value does (float32 bits, the
sign bit flipped for positives, every bit for negatives; NaN as -inf, -0.0 as +0.0), keeping
only the top ``DIGITS`` bytes that tell the dtype's values apart (bfloat16: 2, float16: 3,
float32: 4; a negative value's lower bits are set by the flip and are cleared).

``_top_window_kernel`` runs ``DIGITS + 1`` times over the grid (rows, slices), each row cut
into slices of keys. Launch d < DIGITS histograms byte d (from the top) of the keys of its
slice whose higher bytes match the prefix of T, the W-th largest key, found so far; each
program first finds that prefix itself from the previous launch's histograms (summed over the
row's slices: the highest bin where the count from the top reaches W). The last launch finds
T and writes every key's verdict: kept when above T, or equal to T and among the first
``W - above`` such keys in key order (equal biases rank the smaller index first), as the
interval [0, Lq) or [0, 0). A slice's ties before it are the last histograms' counts of T's
byte in the slices before it, so no launch counts ties.

With ``WRITE_LIST`` the last launch also writes each row's kept keys in key order, the list
decode's gather route reads (``planning.gather_decode``): a slice's kept keys go after those of
the slices before it, which are the keys above T there (for each byte d, the keys whose higher
bytes match T's and whose byte d is above T's: launch d's histograms) and the first of their
ties. A row keeps exactly W keys, so its list is W long.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ordered_keys(bias_row, offs, n, DIGITS: tl.constexpr):
    """uint32 keys of the biases at ``offs``, their bits below the top ``DIGITS`` bytes
    cleared; keys past ``n`` are 0, below every bias's key."""
    x = tl.load(bias_row + offs, mask=offs < n, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.uint32, bitcast=True)
    negative = (bits >> 31) != 0
    keys = tl.where(negative, ~bits, bits | 0x80000000)
    low: tl.constexpr = 32 - 8 * DIGITS
    return tl.where(offs < n, (keys >> low) << low, 0)


@triton.jit
def _top_window_kernel(bias_ptr, hist_ptr, start_ptr, end_ptr, list_ptr, count_ptr, n,
                       stride_row, window, seqlen_q, slice_len, DIGIT: tl.constexpr,
                       DIGITS: tl.constexpr, SLICES: tl.constexpr, BLOCK: tl.constexpr,
                       WRITE_LIST: tl.constexpr, WRITE_INTERVALS: tl.constexpr = True):
    """Grid (rows, slices <= SLICES), launch ``DIGIT`` of 0..DIGITS (see the module
    docstring). Row r of the (rows, n) bias (unit key stride, ``stride_row`` apart), 1 <=
    ``window`` < n; slice s: keys [s x slice_len, (s + 1) x slice_len). The number of slices
    is the grid's, so that lengths compile nothing new; ``SLICES`` only bounds it and spaces
    the histograms. ``hist_ptr``: (DIGITS, rows, SLICES, 256) int32, then the state,
    (DIGITS, rows, 2) int32: the prefix of T and the keys above it before byte d, written by
    launch d's slice 0 for launch d + 1. The last launch writes
    int32 start (0) and end (Lq where kept, else 0), (rows, n), unless ``WRITE_INTERVALS`` is
    False, and with ``WRITE_LIST`` the kept keys, (rows, window) int32 in key order, and their
    number, (rows,) int32."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    rows = tl.num_programs(0).to(tl.int64)
    num_slices = tl.num_programs(1)
    bias_row = bias_ptr + row * stride_row
    bins = tl.arange(0, 256)
    slices = tl.arange(0, SLICES)
    state_ptr = hist_ptr + DIGITS * rows * SLICES * 256
    found = tl.zeros([], dtype=tl.uint32)  # T's bytes found so far, in place
    above = 0  # keys above that prefix
    if DIGIT > 0:
        if DIGIT > 1:
            state = state_ptr + ((DIGIT - 1) * rows + row) * 2
            found = tl.load(state).to(tl.uint32)
            above = tl.load(state + 1)
        hists = tl.load(hist_ptr + (((DIGIT - 1) * rows + row) * SLICES + slices[:, None]) * 256
                        + bins[None, :], mask=(slices < num_slices)[:, None], other=0)
        counts = tl.sum(hists, 0)
        at_or_above = tl.sum(counts, 0) - tl.cumsum(counts, 0) + counts
        bin = tl.max(tl.where(above + at_or_above >= window, bins, -1), 0)
        above += tl.sum(tl.where(bins == bin, at_or_above - counts, 0), 0)
        found = found | (bin.to(tl.uint32) << (32 - 8 * DIGIT))
        if DIGIT < DIGITS:
            if part == 0:
                state = state_ptr + (DIGIT * rows + row) * 2
                tl.store(state, found.to(tl.int32))
                tl.store(state + 1, above)
    first_key = part * slice_len
    if DIGIT < DIGITS:
        shift = 24 - 8 * DIGIT
        counts = tl.zeros([256], dtype=tl.int32)
        for first in range(first_key, first_key + slice_len, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            keys = _ordered_keys(bias_row, offs, n, DIGITS)
            if DIGIT == 0:
                same = offs < n
            else:
                same = (offs < n) & ((keys >> (shift + 8)) == (found >> (shift + 8)))
            counts += tl.histogram(((keys >> shift) & 0xFF).to(tl.int32), 256, mask=same)
        tl.store(hist_ptr + ((DIGIT * rows + row) * SLICES + part) * 256 + bins, counts)
    else:
        room = window - above
        # T's byte of the last histograms, in the slices before this one: the ties before it
        tied_before = tl.sum(tl.sum(tl.where((slices[:, None] < part) & (bins[None, :] == bin),
                                             hists, 0), 1), 0)
        listed = 0  # kept keys in the slices before this one
        if WRITE_LIST:
            for d in tl.static_range(DIGITS):
                earlier = tl.load(hist_ptr + ((d * rows + row) * SLICES + slices[:, None]) * 256
                                  + bins[None, :], mask=(slices < part)[:, None], other=0)
                t_byte = ((found >> (24 - 8 * d)) & 0xFF).to(tl.int32)
                listed += tl.sum(tl.sum(tl.where(bins[None, :] > t_byte, earlier, 0), 1), 0)
            listed += tl.minimum(tied_before, room)
            if part == 0:
                tl.store(count_ptr + row, window)
        out_row = row * n
        for first in range(first_key, first_key + slice_len, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            in_range = offs < n
            keys = _ordered_keys(bias_row, offs, n, DIGITS)
            tie = (keys == found) & in_range
            ties = tie.to(tl.int32)
            kept = (keys > found) | (tie & (tied_before + tl.cumsum(ties, 0) <= room))
            if WRITE_INTERVALS:
                tl.store(start_ptr + out_row + offs, tl.zeros([BLOCK], dtype=tl.int32),
                         mask=in_range)
                tl.store(end_ptr + out_row + offs, kept.to(tl.int32) * seqlen_q, mask=in_range)
            tied_before += tl.sum(ties, 0)
            if WRITE_LIST:
                taken = kept.to(tl.int32)
                slot = listed + tl.cumsum(taken, 0) - 1
                tl.store(list_ptr + row * window + slot, offs, mask=kept)
                listed += tl.sum(taken, 0)


@triton.jit
def _rank_codes(bias_row, keys, n, DIGITS: tl.constexpr):
    """uint64 codes of ``keys`` that order them as their rank does, lowest first: the ordered
    key (``_ordered_keys``) above, and for equal biases the larger key index lower (equal
    biases rank the smaller index first). Code o > code c: key o beats key c. Callers mask
    the codes of keys they do not use."""
    ordered = _ordered_keys(bias_row, keys, n, DIGITS).to(tl.uint64)
    return (ordered << 32) | (0x7FFFFFFF - keys).to(tl.uint64)


@triton.jit
def _leaving_rows(codes, last_codes, later_codes, extra, seqlen_q, E: tl.constexpr):
    """For candidate keys of ``codes`` ([E]): the first query row (1..e) that no longer keeps
    the key, Lq where every row does, 0 where the first row already drops it. ``last_codes``:
    the first row's e lowest-ranked kept keys, ``later_codes``: the e later keys in key order
    (row t first sees later key t - 1); each vector's entries past ``extra`` are unused (and
    the results for them unwritten)."""
    others = tl.arange(0, E)
    in_use = (others < extra)[None, :]
    # A candidate stays while fewer than e keys beat it: W - e of the first row's keys always
    # do, plus the last e and the later keys seen so far that beat it.
    beaten = tl.sum((in_use & (last_codes[None, :] > codes[:, None])).to(tl.int32), 1)
    needed = extra - beaten
    seen = tl.cumsum((in_use & (later_codes[None, :] > codes[:, None])).to(tl.int32), 1)
    reached = in_use & (seen >= needed[:, None])
    first = tl.min(tl.where(reached, others[None, :], E), 1)
    leaves = tl.where(first < E, first + 1, seqlen_q)
    return tl.where(needed <= 0, 0, leaves)


@triton.jit
def _few_rows_kernel(bias_ptr, kept_ptr, start_ptr, end_ptr, list_ptr, count_ptr, n,
                     stride_row, window, seqlen_q, DIGITS: tl.constexpr, BLOCK: tl.constexpr,
                     E: tl.constexpr, WRITE_LIST: tl.constexpr):
    """Grid (rows,): the causal intervals of Lq = ``seqlen_q`` <= E query rows (e = Lq - 1
    keys past the first row's, key n - Lq + t first seen by row t) from the first row's top-W
    list (``kept_ptr``: (rows, window) int32 in key order, ``_top_window_kernel``'s). Of the W,
    all but the e lowest-ranked stay to the last row; those e and the e later keys leave at the
    row ``_leaving_rows`` finds. Writes int32 start (the key's first row) and end, (rows, n),
    and with ``WRITE_LIST`` the keys some row keeps, (rows, window + e) int32: the W, then the
    later keys kept in key order, then the later keys dropped; and their count, (rows,)."""
    row = tl.program_id(0).to(tl.int64)
    bias_row = bias_ptr + row * stride_row
    kept_row = kept_ptr + row * window
    extra = seqlen_q - 1
    offset = n - seqlen_q  # row r sees keys <= r + offset
    slots = tl.arange(0, E)
    # The e lowest-ranked kept keys, one per pass: the lowest code above the previous one.
    last_codes = tl.zeros([E], dtype=tl.uint64)
    previous = tl.zeros([], dtype=tl.uint64)
    highest = ~tl.zeros([], dtype=tl.uint64)
    for j in range(0, extra):
        lowest = highest
        for first in range(0, window, BLOCK):
            offs = first + tl.arange(0, BLOCK)
            listed = offs < window
            keys = tl.load(kept_row + offs, mask=listed, other=0)
            codes = _rank_codes(bias_row, keys, n, DIGITS)
            above = listed & ((codes > previous) | (j == 0))
            lowest = tl.minimum(lowest, tl.min(tl.where(above, codes, highest), 0))
        last_codes = tl.where(slots == j, lowest, last_codes)
        previous = lowest
    in_use = slots < extra
    last_keys = (0x7FFFFFFF - (last_codes & 0xFFFFFFFF)).to(tl.int32)
    later_keys = offset + 1 + slots
    later_codes = _rank_codes(bias_row, later_keys, n, DIGITS)
    last_leave = _leaving_rows(last_codes, last_codes, later_codes, extra, seqlen_q, E)
    later_leave = _leaving_rows(later_codes, last_codes, later_codes, extra, seqlen_q, E)
    out_row = row * n
    for first in range(0, n, BLOCK):  # start: the first row that sees the key; end: 0
        offs = first + tl.arange(0, BLOCK)
        inside = offs < n
        tl.store(start_ptr + out_row + offs, tl.maximum(offs - offset, 0), mask=inside)
        tl.store(end_ptr + out_row + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=inside)
    tl.debug_barrier()  # the zeros are written before the kept keys' ends (other threads')
    for first in range(0, window, BLOCK):
        offs = first + tl.arange(0, BLOCK)
        listed = offs < window
        keys = tl.load(kept_row + offs, mask=listed, other=0)
        tl.store(end_ptr + out_row + keys, tl.full([BLOCK], 0, tl.int32) + seqlen_q,
                 mask=listed)
        if WRITE_LIST:
            tl.store(list_ptr + row * (window + extra) + offs, keys, mask=listed)
    tl.debug_barrier()  # ... and the last e's ends after them
    tl.store(end_ptr + out_row + last_keys, last_leave, mask=in_use)
    tl.store(end_ptr + out_row + later_keys, later_leave, mask=in_use)
    if WRITE_LIST:
        later_kept = in_use & (later_leave > slots + 1)
        kept_count = tl.sum(later_kept.to(tl.int32), 0)
        slot = tl.where(later_kept, tl.cumsum(later_kept.to(tl.int32), 0) - 1,
                        kept_count + tl.cumsum((in_use & ~later_kept).to(tl.int32), 0) - 1)
        tl.store(list_ptr + row * (window + extra) + window + slot, later_keys, mask=in_use)
        tl.store(count_ptr + row, window + kept_count)
