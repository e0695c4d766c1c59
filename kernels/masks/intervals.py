"""Key intervals: an attention mask stored in O(Lk) memory.

``KeyIntervals(start, end)`` holds two integer tensors of shape (Bm, Hm, Lk). Query row ``i``
sees key ``j`` iff ``start[b, h, j] <= i < end[b, h, j]``; ``start >= end`` means never. It is
accepted as ``attn_mask`` wherever a bool mask is, with the same broadcast rule on its batch
axis (1 or B) and head axis (1, Hk or Hq; query head h reads head h // (Hq // Hm)). Stride-0
(``expand()``) views are allowed on any axis.

Every pattern in which each key is seen by one contiguous run of query rows fits: causal,
sliding window, document (packed) masks, prefix-LM, and flash-dmattn's top-W dynamic mask for
a per-key bias (``topk_intervals``).

What the kernels read, and the rule their tile skipping follows:

* ``kernel_operand()``: an int32 tensor (Bm', Hm', Lk, 2): each key's start, then its end.
* ``block_bounds(block_n)``: per block of ``block_n`` keys, the four bounds that decide whether
  a tile of query rows [m0, m1) by that key block may have a visible pair (active), and whether
  every pair of it is visible (full). See :class:`IntervalBlockBounds`. The kernels compute the
  same bounds on the device in one launch (``activity.interval_activity``); this is their
  definition in torch, which the tests hold that launch to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..runtime.arith import INT32_MAX, INT32_MIN
from .grouping import grouping_order

INDEX_DTYPES = (torch.int32, torch.int64)


def _check_index_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} dtype must be torch.int32 or torch.int64, got {t.dtype}")
    if t.dim() != 3:
        raise ValueError(f"{name} must be 3-D (batch, heads, seqlen_k), got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}")


@dataclass(frozen=True, eq=False)
class IntervalBlockBounds:
    """Per-key-block bounds of a :class:`KeyIntervals`, each int32 (Bm', Hm', num_blocks) with
    the leading axes of :meth:`KeyIntervals.kernel_operand`.

    * ``min_start`` / ``max_end``: over the block's non-empty intervals; a block with none has
      ``min_start = INT32_MAX`` and ``max_end = INT32_MIN``.
    * ``max_start`` / ``min_end``: over all of the block's intervals, empty ones included.

    A tile of query rows [m0, m1) by key block n may have a visible pair only if
    ``min_start < m1 and max_end > m0``. Every pair of it is visible if ``max_start <= m0 and
    min_end >= m1`` and the block lies wholly inside [0, Lk): keys past Lk do not count in any
    bound, so the caller checks that last condition. An empty interval (start >= end) gives
    ``max_start >= min_end``, so the full test already fails for a block that holds one.
    """

    block_n: int
    seqlen_k: int
    min_start: torch.Tensor
    max_end: torch.Tensor
    max_start: torch.Tensor
    min_end: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.min_start.shape[-1]

    def tiles(self, block_m: int, seqlen_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(active, full) bool tensors (Bm', Hm', num_row_blocks, num_blocks) for tiles of
        ``block_m`` query rows: the tests above applied to every tile. O(tiles) memory."""
        if block_m < 1:
            raise ValueError(f"block_m must be a positive int, got {block_m}")
        m0 = torch.arange(0, seqlen_q, block_m, device=self.min_start.device)
        m1 = (m0 + block_m).clamp(max=seqlen_q)
        m0, m1 = m0[:, None], m1[:, None]
        lo, hi = self.min_start[..., None, :], self.max_end[..., None, :]
        active = (lo < m1) & (hi > m0)
        blocks = torch.arange(self.num_blocks, device=self.min_start.device)
        complete = (blocks + 1) * self.block_n <= self.seqlen_k
        full = ((self.max_start[..., None, :] <= m0) & (self.min_end[..., None, :] >= m1)
                & complete)
        return active, full


@dataclass(frozen=True, eq=False)
class KeyIntervals:
    """A mask given per key as the run of query rows that sees it: row ``i`` sees key ``j`` iff
    ``start[b, h, j] <= i < end[b, h, j]`` (``start >= end``: no row does).

    ``start`` and ``end``: int32 or int64 tensors of one shape (Bm, Hm, Lk) on one device;
    stride-0 views are allowed. Values may be any integers (negative or past the last row);
    only their order relative to the rows matters. Immutable: writing into the tensors after
    handing them to a call is not supported.
    """

    start: torch.Tensor
    end: torch.Tensor
    # A permutation of the keys per (batch, head), (Bm, Hm, Lk) int64, in which calls read the
    # keys (``kernels.masks.key_order``); results do not depend on it. Set by ``with_key_order``
    # and ``topk_intervals``, never from outside: an order that is not a permutation would
    # go unnoticed.
    _key_order: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # At most this many distinct keys kept by all query rows together, per (batch, head),
    # where known (``topk_intervals`` sets it: W + Lq - 1 causal, W not): decode's gather
    # route sizes its kept-key lists by it and takes the route where they hold a small share
    # of the keys. A bound that is wrong drops keys past it.
    max_kept: int | None = field(default=None, compare=False)
    # At most this many keys kept by any one query row, per (batch, head), where known
    # (``topk_intervals`` sets its window W; ``prepare_mask`` the most a bool mask read as
    # runs keeps in a row). Only the Hopper forward's default route reads it: a tile of
    # key-ordered intervals walks about W / 128 key blocks (``hopper_forward.takes_hopper``).
    # A wrong bound changes a route, never a result. Set there, never from outside.
    _row_kept: int | None = field(default=None, compare=False, repr=False)
    # The kept keys of every (batch, head) in key order, (Bm x Hm, max_kept) int32, and their
    # counts, (Bm x Hm,) int32, as the selection wrote them (``topk_intervals`` of one window
    # per row, at decode sizes): decode's gather route reads them instead of building its
    # lists. Set by ``topk_intervals``, never from outside: lists that disagree with start and
    # end would go unnoticed.
    _kept_lists: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, compare=False,
                                                                 repr=False)
    # Intervals that are exactly the documents of a packed batch (``varlen.packed_intervals``
    # without a caller's mask): their int32 offsets (cu_seqlens_q, cu_seqlens_k) and whether
    # each sequence is causal. The Hopper forward may then walk each sequence's own tiles
    # (``planning.documents``). Set there, never from outside: offsets that disagree with
    # start and end would go unnoticed.
    _documents: tuple[torch.Tensor, torch.Tensor, bool] | None = field(
        default=None, compare=False, repr=False)
    # The runs of a bool mask that ``prepare_mask`` reads as intervals (``prepared
    # ._as_intervals``), whose calls check the bool mask for writes: their preparation, made
    # before any capture, serves captured calls too (``prepared.prepared_intervals``). Set
    # there, never from outside: intervals a caller writes in place between graph replays
    # must be read by the captured call itself.
    _runs_of_prepared_mask: bool = field(default=False, compare=False, repr=False)
    # Tile lists built by the calls made with these intervals, per call form (see
    # ``prepared.prepared_intervals``): a later call of the same form skips that work.
    _preparations: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    # Intervals with an order: the reordered intervals their calls run with, per call form
    # (``key_order.reordered_intervals``), so later calls get the same object and its
    # preparations.
    _reordered: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    # Intervals with an order: the gather indices of K, V and the bias their calls read the
    # keys with, per call form (``key_order.reorder_keys``).
    _gather_indices: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    # Intervals with an order: what an eager call reads in that order and how
    # (``key_order.KeyOrderReads``), per call form (``key_order.key_order_reads``).
    _reads: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self):
        _check_index_tensor("KeyIntervals start", self.start)
        _check_index_tensor("KeyIntervals end", self.end)
        if tuple(self.start.shape) != tuple(self.end.shape):
            raise ValueError(f"KeyIntervals start and end must have one shape, got "
                             f"{tuple(self.start.shape)} and {tuple(self.end.shape)}")
        if self.start.device != self.end.device:
            raise ValueError(f"KeyIntervals start and end must be on one device, got "
                             f"{self.start.device} and {self.end.device}")
        if self.max_kept is not None and (type(self.max_kept) is not int or self.max_kept < 1):
            raise ValueError(f"KeyIntervals max_kept must be a positive int or None, got "
                             f"{self.max_kept!r}")

    @property
    def key_order(self) -> torch.Tensor | None:
        """The order in which calls read the keys (see :meth:`with_key_order`), or None for
        their own order."""
        return self._key_order

    def with_key_order(self) -> "KeyIntervals":
        """These intervals with a key order that groups keys seen by similar rows.

        Attention does not depend on the order of its keys, but tile skipping does: where the
        kept keys scatter (flash-dmattn's top-W mask keeps, at row i, the W keys with the
        largest bias among the first i), nearly every tile holds a kept pair and the work
        grows with Lq * Lk. ``dmattn_func`` reads the keys of intervals that carry an order in
        that order (K, V, the bias and the intervals gathered, the gradients scattered back),
        so that the work follows the kept pairs. The order costs one sort of Lk per (batch,
        head) here and copies of K and V (and their gradients) per call; it pays where few
        of the visible keys are kept. ``topk_intervals`` sets it by that rule.
        """
        return self.keeping_subset(self.start, self.end,
                                   key_order=grouping_order(self.start, self.end))

    def keeping_subset(self, start: torch.Tensor, end: torch.Tensor, *,
                       key_order: torch.Tensor | None = None,
                       documents: tuple | None = None) -> "KeyIntervals":
        """New intervals ``start``, ``end`` of these intervals' shape whose every row keeps
        some of the keys these keep (the same intervals, or narrower ones), so the bounds
        these carry hold for them and are carried: ``max_kept`` and the most keys one row
        keeps. The key order is ``key_order`` where given, else these intervals' own (any
        order gives the same attention). Facts that tie the intervals to other tensors (the
        kept-key lists, a packed batch's documents) are not carried: ``documents`` names the
        new intervals' own. The sites that rebuild intervals keeping some of these's keys
        come through here (``with_key_order``, ``prepared`` naming documents, warm-up's fresh
        intervals, the transformers padding intersection), so a new bound is carried in one
        place; ``key_order._reorder`` (keys moved) and ``ops.host_mask`` (rebuilt from a
        custom op's arguments) carry what they need themselves."""
        return KeyIntervals(start, end,
                            self._key_order if key_order is None else key_order,
                            max_kept=self.max_kept, _row_kept=self._row_kept,
                            _documents=documents)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(Bm, Hm, Lk)."""
        return tuple(self.start.shape)

    @property
    def device(self) -> torch.device:
        return self.start.device

    def check_against(self, batch: int, heads_q: int, heads_kv: int, seqlen_q: int,
                      seqlen_k: int, device=None, name: str = "attn_mask") -> int:
        """Check that these intervals fit a call with these sizes; return the head divisor
        (query head h reads head h // divisor). Raises ValueError naming ``name``."""
        bm, hm, lk = self.shape
        if device is not None and self.device != torch.device(device):
            raise ValueError(f"{name} must be on query's device {device}, got {self.device}")
        if bm not in (1, batch):
            raise ValueError(f"{name}.start dimension 0 (batch) must be one of "
                             f"{sorted({1, batch})}, got shape {self.shape}")
        if hm not in (1, heads_kv, heads_q):
            raise ValueError(f"{name}.start dimension 1 (heads) must be one of "
                             f"{sorted({1, heads_kv, heads_q})}, got shape {self.shape}")
        if lk != seqlen_k:
            raise ValueError(f"{name}.start dimension 2 (seqlen_k) must be {seqlen_k}, got shape "
                             f"{self.shape}")
        if seqlen_q > INT32_MAX:
            raise ValueError(f"{name}: seqlen_q must be below 2**31 for key intervals, got "
                             f"{seqlen_q}")
        return heads_q // hm

    def to_dense(self, seqlen_q: int) -> torch.Tensor:
        """The bool mask (Bm, Hm, Lq, Lk) these intervals stand for. It is O(Lq * Lk): for
        tests and the eager reference only, never for the kernels."""
        rows = torch.arange(seqlen_q, device=self.device)[:, None]
        return (self.start[..., None, :] <= rows) & (rows < self.end[..., None, :])

    def _collapsed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """start and end with each batch or head axis that both broadcast (stride 0) cut to
        size 1, so no work is spent on copies of one row."""
        start, end = self.start, self.end
        for axis in (0, 1):
            if start.shape[axis] > 1 and start.stride(axis) == 0 and end.stride(axis) == 0:
                start = start.narrow(axis, 0, 1)
                end = end.narrow(axis, 0, 1)
        return start, end

    def kernel_operand(self) -> torch.Tensor:
        """An int32 tensor (Bm', Hm', Lk, 2): key j's start at [..., j, 0] and its end at
        [..., j, 1], interleaved as the kernels read them, in rows of an even number of keys
        (a view of (Bm', Hm', Lk + Lk % 2, 2)), so that the int64 word per key the kernels
        read (``planning.inputs.interval_words``) has rows 16 bytes apart at any Lk, as TMA
        requires of the Hopper kernels' mask operand.

        Bm' is Bm, or 1 when both tensors broadcast over batch with stride 0; Hm' likewise
        (a size-1 axis broadcasts like any mask axis). Values are clamped into [0, 2**31 - 1],
        which keeps their meaning for every row 0 <= i < 2**31 - 1. Made once per plan.
        """
        start, end = self._collapsed()
        keys = start.shape[-1]
        padded = torch.empty((*start.shape[:-1], keys + keys % 2, 2), dtype=torch.int32,
                             device=start.device)
        pairs = padded[..., :keys, :]
        pairs[..., 0] = start.clamp(0, INT32_MAX)
        pairs[..., 1] = end.clamp(0, INT32_MAX)
        return pairs

    def block_bounds(self, block_n: int) -> IntervalBlockBounds:
        """Per block of ``block_n`` keys, the bounds of :class:`IntervalBlockBounds`, in
        O(Bm' * Hm' * Lk) torch ops (the last block padded with neutral values)."""
        start, end = self.kernel_operand().unbind(-1)
        return block_bounds(start, end, block_n)


def most_kept_in_a_row(start: torch.Tensor, end: torch.Tensor, seqlen_q: int) -> int:
    """The most keys any one of rows 0..``seqlen_q``-1 keeps under intervals ``start`` and
    ``end`` (..., Lk), over every leading index: +1 at each key's first row and -1 past its
    last, summed down the rows. O(leading x (Lq + Lk)) work and one device sync."""
    first = start.long().clamp(0, seqlen_q)
    past = torch.maximum(end.long().clamp(0, seqlen_q), first)
    lead = start.shape[:-1]
    steps = torch.zeros(*lead, seqlen_q + 1, dtype=torch.int32, device=start.device)
    steps.scatter_add_(-1, first, torch.ones_like(first, dtype=torch.int32))
    steps.scatter_add_(-1, past, torch.full_like(past, -1, dtype=torch.int32))
    return int(steps.cumsum(-1).amax())


def block_bounds(start: torch.Tensor, end: torch.Tensor, block_n: int) -> IntervalBlockBounds:
    """The :class:`IntervalBlockBounds` of int32 ``start`` and ``end`` (..., Lk) per block of
    ``block_n`` keys (the last block padded with neutral values)."""
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 1:
        raise ValueError(f"block_n must be a positive int, got {block_n!r}")
    lk = start.shape[-1]
    blocks = -(-lk // block_n)
    pad = blocks * block_n - lk

    def per_block(values: torch.Tensor, fill: int) -> torch.Tensor:
        values = torch.nn.functional.pad(values, (0, pad), value=fill)
        return values.view(*values.shape[:-1], blocks, block_n)

    empty = start >= end
    min_start = per_block(start.masked_fill(empty, INT32_MAX), INT32_MAX).amin(-1)
    max_end = per_block(end.masked_fill(empty, INT32_MIN), INT32_MIN).amax(-1)
    max_start = per_block(start, INT32_MIN).amax(-1)
    min_end = per_block(end, INT32_MAX).amin(-1)
    return IntervalBlockBounds(block_n, lk, min_start, max_end, max_start, min_end)
