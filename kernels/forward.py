"""Forward kernel and its launcher.

Online softmax follows FlashAttention-2's names: ``m_i`` running row max (log2 domain), ``l_i``
running row sum of exp2(s - m_i), ``acc`` un-normalized output. Axis letters: b batch, h head,
m query position, n key position, d head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._blocks import ActivityMap, block_list_strides, shared_granularity, tile_activity
from ._checks import CheckedInputs
from ._launch import (ABSENT_OPERAND, LOG2E, PlannedLaunch, bias_has_one_row, ceil_div,
                      contiguous_strides, dot_options, edge_slots, grid_chunk_rows,
                      is_interpreted, key_splits, multiprocessors, next_power_of_2,
                      operand_args, operand_pointer, padded_head_dim, strides3)
from ._partials import last_share_arrived, split_rows, store_partial
from ._scratch import Scratch
from ._score import (LN2, block_at, block_list_row, causal_block_split, clamp_index,
                     grid_position, interior_span, mma, operand_base,
                     query_tile_scores, row_offsets, split_share, tile_offsets)


@triton.jit
def _attn_fwd_inner(
    acc, m_i, l_i, q, offs_m, offs_n0, d_ok,
    k_ptrs, v_ptrs, stride_k_n, stride_v_n,
    mask_ptrs, stride_mask_n, bias_ptrs, stride_bias_n,
    block_list_ptr, first_block, num_blocks,
    seqlen_q, seqlen_k, qk_scale,
    BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_ROW: tl.constexpr, CAUSAL_TILES: tl.constexpr, USE_LIST: tl.constexpr,
    INTERIOR: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
):
    """Fold ``num_blocks`` key blocks into the online softmax state.

    Pointers address key block 0. Blocks are ``first_block + i``, or with USE_LIST the i-th
    entry of the active-tile list, so a sparse mask walks only its active tiles, branch-free.
    The next block's index is read one iteration ahead so that tile addresses never wait on
    it. (Also carrying the next mask tile across iterations was measured 1.7x slower at
    L=16384, D=64: the int1 tile costs registers.)
    INTERIOR blocks lie inside both lengths and below the causal diagonal: no range or causal
    test per pair, only the mask (if any), read through row-clamped pointers.
    """
    block = block_at(block_list_ptr, first_block, 0, num_blocks, USE_LIST)
    for i in range(num_blocks):
        start_n = block * BLOCK_N
        offs_n = start_n + offs_n0
        block = block_at(block_list_ptr, first_block, i + 1, num_blocks, USE_LIST)
        s, k, kv_in_range = query_tile_scores(
            q, offs_m, offs_n, d_ok, start_n, k_ptrs, stride_k_n, mask_ptrs, stride_mask_n,
            bias_ptrs, stride_bias_n, seqlen_q, seqlen_k, qk_scale, HAS_MASK, HAS_BIAS,
            BIAS_ROW, CAUSAL_TILES, INTERIOR, DOT_PRECISION, WIDEN_DOTS)
        # -- update m_i, l_i; an all -inf row so far shifts by 0 instead of -inf (NaN guard)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs + start_n.to(tl.int64) * stride_v_n, mask=kv_in_range, other=0.0)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, WIDEN_DOTS)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, mask_ptr, bias_ptr, list_ptr,
    out_part_ptr, lse_part_ptr, count_ptr,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n, mask_head_div,
    stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n, bias_head_div,
    stride_list_b, stride_list_h, stride_list_m,
    stride_q_b, stride_q_m, stride_q_h,
    stride_k_b, stride_k_n, stride_k_h,
    stride_v_b, stride_v_n, stride_v_h,
    stride_o_b, stride_o_m, stride_o_h,
    heads_q, group_size, seqlen_q, seqlen_k, qk_scale, chunk_rows,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_PACK: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_ROW: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    SPLIT_KEYS: tl.constexpr, EDGE_SLOTS: tl.constexpr,
):
    # A tile has BLOCK_M rows. With GROUP_PACK = G > 1 (GQA), row r is query position
    # start_m + r // G of query head hx * G + r % G: the G heads sharing a KV head share one
    # program, so K, V and the (group-shared) mask are read once for all of them.
    QUERY_ROWS: tl.constexpr = BLOCK_M // GROUP_PACK
    # Later query blocks see more keys under causal: they start first (see grid_position).
    m_block, head_program = grid_position(tl.program_id(0), tl.cdiv(seqlen_q, QUERY_ROWS),
                                          chunk_rows, IS_CAUSAL)
    start_m = m_block * QUERY_ROWS
    heads_grid = heads_q // GROUP_PACK
    b = head_program // heads_grid
    first_head = (head_program % heads_grid) * GROUP_PACK
    # Split-K (decode): axis 2 cuts this row block's key blocks into contiguous shares.
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    rows = tl.arange(0, BLOCK_M)
    offs_m = start_m + rows // GROUP_PACK
    heads = first_head + rows % GROUP_PACK
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM  # folds away when HEAD_DIM == BLOCK_D
    row_ok = offs_m < seqlen_q

    q = tl.load(q_ptr + b.to(tl.int64) * stride_q_b
                + row_offsets(offs_m, heads, 1, stride_q_m, stride_q_h)[:, None] + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_ptrs = operand_base(k_ptr, b, first_head, group_size, stride_k_b, stride_k_h) \
        + tile_offsets(offs_n0[:, None], offs_d[None, :], stride_k_n, 1)
    v_ptrs = operand_base(v_ptr, b, first_head, group_size, stride_v_b, stride_v_h) \
        + tile_offsets(offs_n0[:, None], offs_d[None, :], stride_v_n, 1)
    # Mask and bias rows past seqlen_q read the last row: interior tiles load unpredicated.
    safe_m = clamp_index(offs_m, seqlen_q)
    mask_ptrs = mask_ptr + b.to(tl.int64) * stride_mask_b \
        + row_offsets(safe_m, heads, mask_head_div, stride_mask_m, stride_mask_h)[:, None] \
        + offs_n0.to(tl.int64)[None, :] * stride_mask_n
    if BIAS_ROW:  # one query row shared by the tile's heads: address it once (see load_bias)
        bias_rows = operand_base(bias_ptr, b, first_head, bias_head_div, stride_bias_b,
                                 stride_bias_h) + tl.zeros([1, 1], dtype=tl.int64)
    else:
        bias_rows = bias_ptr + b.to(tl.int64) * stride_bias_b \
            + row_offsets(safe_m, heads, bias_head_div, stride_bias_m, stride_bias_h)[:, None]
    bias_ptrs = bias_rows + offs_n0.to(tl.int64)[None, :] * stride_bias_n

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Key blocks [0, interior_end) need no per-pair range or causal test; the rest (the
    # diagonal band and a partial last block) do. Split-K shares [lo, hi) cut across both.
    num_full, num_blocks = causal_block_split(start_m, QUERY_ROWS, BLOCK_N, seqlen_q, seqlen_k,
                                              IS_CAUSAL)
    interior_end = tl.minimum(num_full, seqlen_k // BLOCK_N)
    if HAS_MASK:
        # Causal is already folded into the lists. When packed, the host guarantees that the
        # tile's heads share one mask head. List positions: [0, full) full tiles (no mask
        # read), then partial tiles, interior ones [full, mid) before edge ones [mid, count).
        block_list, count, full = block_list_row(
            list_ptr, stride_list_b, stride_list_h, stride_list_m, b, first_head,
            mask_head_div, m_block)
        _, mid = interior_span(block_list + full, count - full, 0, interior_end, EDGE_SLOTS)
        mid += full
        # Split-K: this program's share [lo, hi) of the positions, cut into the three spans.
        lo, hi = split_share(count, split, num_splits)
        full = tl.minimum(tl.maximum(full, lo), hi)
        mid = tl.minimum(tl.maximum(mid, lo), hi)
        # Full tiles: every pair visible, so no mask read and no per-pair test.
        acc, m_i, l_i = _attn_fwd_inner(
            acc, m_i, l_i, q, offs_m, offs_n0, d_ok, k_ptrs, v_ptrs, stride_k_n, stride_v_n,
            mask_ptrs, stride_mask_n, bias_ptrs, stride_bias_n,
            block_list + lo, 0, full - lo, seqlen_q, seqlen_k, qk_scale,
            BLOCK_N, False, HAS_BIAS, BIAS_ROW, False, True, True, DOT_PRECISION, WIDEN_DOTS)
        inner_list, inner_first, inner_count = block_list + full, 0, mid - full
        edge_list, edge_first, edge_count = block_list + mid, 0, hi - mid
    else:
        # The same two spans as ranges of key blocks (the list pointer is unused).
        lo, hi = split_share(num_blocks, split, num_splits)
        mid = tl.minimum(tl.maximum(interior_end, lo), hi)
        inner_list, inner_first, inner_count = list_ptr, lo, mid - lo
        edge_list, edge_first, edge_count = list_ptr, mid, hi - mid
    # Interior key blocks, then the causal diagonal and a partial last key block.
    acc, m_i, l_i = _attn_fwd_inner(
        acc, m_i, l_i, q, offs_m, offs_n0, d_ok, k_ptrs, v_ptrs, stride_k_n, stride_v_n,
        mask_ptrs, stride_mask_n, bias_ptrs, stride_bias_n,
        inner_list, inner_first, inner_count, seqlen_q, seqlen_k, qk_scale,
        BLOCK_N, HAS_MASK, HAS_BIAS, BIAS_ROW, False, HAS_MASK, True, DOT_PRECISION, WIDEN_DOTS)
    acc, m_i, l_i = _attn_fwd_inner(
        acc, m_i, l_i, q, offs_m, offs_n0, d_ok, k_ptrs, v_ptrs, stride_k_n, stride_v_n,
        mask_ptrs, stride_mask_n, bias_ptrs, stride_bias_n,
        edge_list, edge_first, edge_count, seqlen_q, seqlen_k, qk_scale,
        BLOCK_N, HAS_MASK, HAS_BIAS, BIAS_ROW, IS_CAUSAL, HAS_MASK, False, DOT_PRECISION,
        WIDEN_DOTS)

    # Rows that saw no key: l_i == 0, m_i == -inf -> output 0 and LSE -inf, never 0/0.
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    # LSE rows of (B, Hq, Lq). The row predicate keeps a partial last block from writing into
    # the next head's rows (the LSE race seen in other Triton attention ports).
    bh = b * heads_q + heads  # each row's (batch x head) row
    lse_rows = bh.to(tl.int64) * seqlen_q + offs_m
    store = True
    if SPLIT_KEYS:
        # Partials are (splits, B*Hq, Lq, BLOCK_D) fp32 (and (splits, B*Hq, Lq) for the LSE);
        # the last split of the tile to finish combines them (``_partials``).
        num_bh = tl.num_programs(0) // tl.cdiv(seqlen_q, QUERY_ROWS) * GROUP_PACK
        store_partial(out_part_ptr, out, offs_m, row_ok, split, bh, num_bh, seqlen_q, BLOCK_D)
        tl.store(lse_part_ptr + split_rows(split, bh, num_bh, seqlen_q) + offs_m, lse,
                 mask=row_ok)
        store = last_share_arrived(count_ptr + tl.program_id(0), num_splits)
        if store:
            out, lse = _combine_splits(out_part_ptr, lse_part_ptr, offs_m, row_ok, bh, num_bh,
                                       seqlen_q, num_splits, BLOCK_M, BLOCK_D)
    if store:
        tl.store(out_ptr + b.to(tl.int64) * stride_o_b
                 + row_offsets(offs_m, heads, 1, stride_o_m, stride_o_h)[:, None]
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + lse_rows, lse, mask=row_ok)


@triton.jit
def _combine_splits(out_part_ptr, lse_part_ptr, offs_m, row_ok, bh, num_bh, seqlen_q,
                    num_splits, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """(out, lse) of rows ``offs_m`` of (batch x head) rows ``bh`` merged over the key splits'
    partials (laid out as ``_partials.split_rows`` says): out = sum_s exp(lse_s - lse) * out_s,
    lse = logsumexp_s lse_s."""
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(lse_part_ptr + split_rows(s, bh, num_bh, seqlen_q) + offs_m,
                                  mask=row_ok, other=float("-inf"), cache_modifier=".cg"))
    m_shift = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: weights stay 0
    weight_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s in range(num_splits):
        rows = split_rows(s, bh, num_bh, seqlen_q) + offs_m
        w = tl.exp(tl.load(lse_part_ptr + rows, mask=row_ok, other=float("-inf"),
                           cache_modifier=".cg") - m_shift)
        part = tl.load(out_part_ptr + tile_offsets(rows[:, None], offs_d[None, :], BLOCK_D, 1),
                       mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
        weight_sum += w
        acc += w[:, None] * part
    empty = weight_sum == 0.0
    out = acc / tl.where(empty, 1.0, weight_sum)[:, None]
    lse = tl.where(empty, float("-inf"), m_shift + tl.log(tl.where(empty, 1.0, weight_sum)))
    return out, lse


@dataclass(frozen=True)
class ForwardConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def forward_config(block_d: int, dtype: torch.dtype, interpreted: bool,
                   has_mask: bool) -> ForwardConfig:
    """Tiles per head dim, from sweeps on an H100 (notes in results/notes.md)."""
    if interpreted:
        # Small, unequal tiles so that test shapes span several tiles (skips, partial tiles,
        # the causal edge with BLOCK_M != BLOCK_N). Same tiles as the interpreted dq kernel.
        return ForwardConfig(32, 16, 4, 1)
    if dtype == torch.float32:
        # fp32 tiles take twice the shared memory; fp32 is for accuracy checks, not speed.
        return ForwardConfig(64, 32, 4, 2 if block_d <= 128 else 1)
    if block_d <= 64:
        # 64-row blocks measured 1.4-1.6x faster than 128 at D=64 (L=16384, H2/1: twice the
        # programs for few heads, and a shorter critical path on causal rows).
        return ForwardConfig(64, 64, 4, 3)
    if block_d <= 128:
        # With a mask, 128-row tiles amortize the list walk better (0.66 vs 0.74 ms at
        # B2 H16/4 L4096 causal); without one, 64-row tiles win (0.37 vs 0.44 ms).
        return ForwardConfig(128, 64, 8, 3) if has_mask else ForwardConfig(64, 64, 4, 3)
    return ForwardConfig(64, 32, 4, 2)


@dataclass(frozen=True)
class ForwardTiling:
    """The forward's launch shape: its config, how many GQA heads share a tile (``pack``) and
    the tile's rows, of which ``block_m // pack`` are query positions."""

    cfg: ForwardConfig
    pack: int
    block_m: int

    @property
    def query_rows(self) -> int:
        return self.block_m // self.pack

    @property
    def list_tile(self) -> tuple[int, int]:
        """(query rows, key cols) of the tiles whose active-tile list the forward walks."""
        return self.query_rows, self.cfg.block_n


def forward_tiling(checked: CheckedInputs, dtype: torch.dtype,
                   interpreted: bool) -> ForwardTiling:
    shape = checked.shape
    cfg = forward_config(padded_head_dim(shape.head_dim), dtype, interpreted,
                         checked.mask is not None)
    pack = group_pack(checked, cfg.block_m)
    block_m = cfg.block_m
    if pack > 1:
        # Decode-sized Lq: just enough rows for the group's heads (tl.dot needs 16).
        block_m = max(16, min(block_m, pack * next_power_of_2(shape.seqlen_q)))
    return ForwardTiling(cfg, pack, block_m)


def mask_activity(checked: CheckedInputs, tiling: ForwardTiling, is_causal: bool,
                  later_tiles: tuple = ()) -> ActivityMap:
    """The mask's activity map, in tiles that divide the forward's list tile and every
    (query rows, key cols) tile in ``later_tiles`` (the backward's)."""
    sub_rows, sub_cols = shared_granularity((tiling.list_tile,) + tuple(later_tiles))
    return tile_activity(checked.mask, checked.shape, sub_rows, sub_cols, is_causal)


class ForwardPlan:
    """Everything a forward call needs besides its tensors, worked out once per call
    signature (shapes, strides, dtypes, device, mask and bias layout, causality and scale):
    tiles, grid, key splits and the planned launches. The interface keeps plans by signature,
    so that a repeat call only allocates its outputs and launches. The backward reads the
    problem's layout from here too (``shape``, ``mask``, ``bias``, ``activity``...).

    ``activity`` is a prepared activity map of the mask; without one, the mask is read here,
    into a map fine enough for the tiles in ``later_tiles`` too (the backward's, when one will
    follow), so that their lists come from the map alone.
    """

    def __init__(self, checked: CheckedInputs, query, key, value, is_causal: bool,
                 activity: ActivityMap | None = None, later_tiles: tuple = ()):
        shape = checked.shape
        interpreted = is_interpreted(_attn_fwd_kernel)
        tiling = forward_tiling(checked, query.dtype, interpreted)
        if checked.mask is not None and activity is None:
            activity = mask_activity(checked, tiling, is_causal, later_tiles)
        cfg, pack, query_rows = tiling.cfg, tiling.pack, tiling.query_rows
        block_d = padded_head_dim(shape.head_dim)
        self.shape, self.dtype, self.device = shape, query.dtype, query.device
        self.is_causal, self.softmax_scale = bool(is_causal), checked.softmax_scale
        self.mask = operand_args(checked.mask) if checked.mask is not None else None
        self.bias = operand_args(checked.bias) if checked.bias is not None else None
        self.bias_shape = checked.bias.original_shape if checked.bias is not None else None
        self.bias_one_row = bias_has_one_row(checked)
        self.activity = activity
        lists = None
        if checked.mask is not None:
            lists = activity.lists(*tiling.list_tile, transposed=False)
        self.list_table = lists.table if lists is not None else None
        self.backward_plans: dict = {}  # kept here by kernels.backward, per grad signature

        row_blocks = ceil_div(shape.seqlen_q, query_rows)
        num_bh = shape.batch * shape.heads_q
        self.splits = key_splits(row_blocks * num_bh // pack,
                                 ceil_div(shape.seqlen_k, cfg.block_n),
                                 multiprocessors(query.device, interpreted))
        self.out_shape = (shape.batch, shape.seqlen_q, shape.heads_q, shape.head_dim)
        self.lse_shape = (shape.batch, shape.heads_q, shape.seqlen_q)
        self.part_shape = (self.splits, num_bh, shape.seqlen_q, block_d)
        out_strides = contiguous_strides(self.out_shape)[:3]
        self.main = PlannedLaunch(
            _attn_fwd_kernel, (row_blocks * (num_bh // pack), 1, self.splits),
            (*(self.mask or ABSENT_OPERAND).as_args(), *(self.bias or ABSENT_OPERAND).as_args(),
             *block_list_strides(lists, shape.batch),
             *strides3(query), *strides3(key), *strides3(value), *out_strides,
             shape.heads_q, shape.group_size, shape.seqlen_q, shape.seqlen_k,
             checked.softmax_scale * LOG2E,
             grid_chunk_rows(num_bh // pack, row_blocks, 1 if pack > 1 else shape.group_size,
                             self.is_causal, multiprocessors(query.device, interpreted))),
            HEAD_DIM=shape.head_dim, BLOCK_D=block_d,
            BLOCK_M=tiling.block_m, BLOCK_N=cfg.block_n, GROUP_PACK=pack,
            HAS_MASK=checked.mask is not None, HAS_BIAS=checked.bias is not None,
            BIAS_ROW=self.bias_one_row and shared_by_group(checked.bias, pack),
            IS_CAUSAL=self.is_causal,
            **dot_options(query.dtype, interpreted), SPLIT_KEYS=self.splits > 1,
            EDGE_SLOTS=edge_slots(query_rows, cfg.block_n),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        # Split-K partials and their tiles' arrival counters, and an LSE for calls that
        # neither return nor save one, are scratch.
        parts = (((self.part_shape, torch.float32), (self.part_shape[:3], torch.float32),
                  ((self.main.grid[0],), torch.int32))
                 if self.splits > 1 else ())
        self._scratch = Scratch(query.device, *parts)
        self._scratch_with_lse = Scratch(query.device, (self.lse_shape, torch.float32), *parts)

    def run(self, query, key, value, mask, bias,
            keep_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out (B, Lq, Hq, D), lse (B, Hq, Lq) float32, or None without ``keep_lse``) for
        tensors of this plan's signature; ``mask`` is the bool mask (or its uint8 view) and
        ``bias`` the bias, either may be None."""
        # ``new_empty`` takes dtype and device from ``query`` (the plan's own): 2.9 us of host
        # per call against 3.9 for ``torch.empty`` with both named (change 29).
        out = query.new_empty(self.out_shape)
        if keep_lse:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
            parts = self._scratch.buffers()
        else:
            lse, *parts = self._scratch_with_lse.buffers()
        out_part, lse_part, counts = parts if parts else (lse, lse, lse)
        self.main(query, key, value, out, lse, operand_pointer(mask, out),
                  operand_pointer(bias, out),
                  lse if self.list_table is None else self.list_table, out_part, lse_part,
                  counts)
        return out, (lse if keep_lse else None)


def shared_by_group(op, pack: int) -> bool:
    """Every query head of a packed GQA group reads the same head of this mask or bias."""
    return op is None or op.head_div % pack == 0


def group_pack(checked: CheckedInputs, block_m: int) -> int:
    """How many query heads of a GQA group share one forward tile (1 = no packing).

    Packing reads K, V and a group-shared mask once per group instead of once per head. It is
    used where that traffic dominates: with a mask (a (B, Hk, Lq, Lk) topk mask is read Hq/Hk
    times otherwise) and for decode-sized Lq, where one head's rows fill a tile poorly.
    The group must be a power of two that fits a tile, and the mask must be shared by it.
    """
    shape = checked.shape
    group = shape.group_size
    if group == 1 or group & (group - 1) or group > block_m:
        return 1
    if not shared_by_group(checked.mask, group):
        return 1
    if checked.mask is None and shape.seqlen_q >= block_m:
        return 1
    return group
