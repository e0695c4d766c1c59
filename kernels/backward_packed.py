"""The backward of a few query rows per GQA group (decode), as one launch that reads K and V once.

The general backward runs dq programs (query blocks, walking keys) and dkdv programs (key
blocks, walking query blocks), so each reads K and V once: twice in all. With Lq = 1 there is
little to compute besides those reads and the dk, dv writes, so the second read is a third of
the backward's bytes (at B1 H32/8 Lk 65536 D128: 805 MB, and 537 MB read once; the general path
took 770 us on an H100, this one 203; results/notes.md, change 31). Here, as in the
forward's GROUP_PACK tiles, a tile's rows are every (query position, query head) of one GQA
group: row r is query position r // G of query head hk * G + r % G. One program owns a share
of the key blocks of one (batch, kv head): for each block it forms scores, probabilities and
dS for all of the group's rows at once, stores that block's dk and dv whole (no other program
touches them, so no partials) and adds the block's part of dq to a register tile. Key shares
merge their dq partials as the split backward does (``_partials``): the last share
of a group to arrive sums them in share order, so results are bitwise reproducible.

Used without a mask and without a bias (``packs_rows``); those calls keep the general path,
which walks only a mask's active tiles and owns the bias gradient's reductions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._checks import AttnShape
from ._launch import (LOG2E, PlannedLaunch, ceil_div, contiguous_strides, dot_options,
                      is_interpreted, key_splits, multiprocessors, next_power_of_2,
                      padded_head_dim, strides3)
from ._scratch import Scratch
from ._partials import last_share_arrived, store_partial, sum_partials
from ._score import (mma, operand_base, probs_from_lse, row_offsets, scores_log2, split_share,
                     tile_offsets, visible_keys)


@triton.jit
def _group_rows(ptr, b, offs_m, heads, stride_b, stride_m, stride_h):
    """Pointers to the packed rows (query position ``offs_m``, query head ``heads``) of batch
    ``b`` of a (B, L, H, D) tensor, shaped [rows, 1] for a tile's column offsets."""
    return ptr + b.to(tl.int64) * stride_b \
        + row_offsets(offs_m, heads, 1, stride_m, stride_h)[:, None]


@triton.jit
def attn_bwd_packed_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, do_ptr, lse_ptr, dq_ptr, dk_ptr, dv_ptr, dq_part_ptr,
    count_ptr,
    stride_q_b, stride_q_m, stride_q_h,
    stride_k_b, stride_k_n, stride_k_h,
    stride_v_b, stride_v_n, stride_v_h,
    stride_do_b, stride_do_m, stride_do_h,
    stride_o_b, stride_o_m, stride_o_h,
    stride_dq_b, stride_dq_m, stride_dq_h,
    stride_dk_b, stride_dk_n, stride_dk_h,
    stride_dv_b, stride_dv_n, stride_dv_h,
    heads_q, group_size, seqlen_q, seqlen_k, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
):
    """dk and dv of key share ``program_id(0)`` of (batch, kv head) ``program_id(1)``, and its
    part of the group's dq."""
    split = tl.program_id(0)
    num_splits = tl.num_programs(0)
    pair = tl.program_id(1)
    num_pairs = tl.num_programs(1)
    heads_kv = heads_q // group_size
    b = pair // heads_kv
    first_head = (pair % heads_kv) * group_size

    rows = tl.arange(0, BLOCK_M)
    offs_m = rows // group_size
    heads = first_head + rows % group_size
    row_ok = offs_m < seqlen_q
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    in_range = row_ok[:, None] & d_ok[None, :]
    q = tl.load(_group_rows(q_ptr, b, offs_m, heads, stride_q_b, stride_q_m, stride_q_h)
                + offs_d[None, :], mask=in_range, other=0.0)
    do = tl.load(_group_rows(do_ptr, b, offs_m, heads, stride_do_b, stride_do_m, stride_do_h)
                 + offs_d[None, :], mask=in_range, other=0.0)
    o = tl.load(_group_rows(out_ptr, b, offs_m, heads, stride_o_b, stride_o_m, stride_o_h)
                + offs_d[None, :], mask=in_range, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(lse_ptr + (b * heads_q + heads).to(tl.int64) * seqlen_q + offs_m, mask=row_ok,
                  other=0.0)

    k_ptrs = operand_base(k_ptr, b, first_head, group_size, stride_k_b, stride_k_h) \
        + tile_offsets(offs_n0[:, None], offs_d[None, :], stride_k_n, 1)
    v_ptrs = operand_base(v_ptr, b, first_head, group_size, stride_v_b, stride_v_h) \
        + tile_offsets(offs_n0[:, None], offs_d[None, :], stride_v_n, 1)
    dk_ptrs = operand_base(dk_ptr, b, first_head, group_size, stride_dk_b, stride_dk_h) \
        + tile_offsets(offs_n0[:, None], offs_d[None, :], stride_dk_n, 1)
    dv_ptrs = operand_base(dv_ptr, b, first_head, group_size, stride_dv_b, stride_dv_h) \
        + tile_offsets(offs_n0[:, None], offs_d[None, :], stride_dv_n, 1)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, hi = split_share(tl.cdiv(seqlen_k, BLOCK_N), split, num_splits)
    for block in range(lo, hi):
        start_n = block * BLOCK_N
        offs_n = start_n + offs_n0
        kv_in_range = (offs_n[:, None] < seqlen_k) & d_ok[None, :]
        k = tl.load(k_ptrs + start_n.to(tl.int64) * stride_k_n, mask=kv_in_range, other=0.0)
        v = tl.load(v_ptrs + start_n.to(tl.int64) * stride_v_n, mask=kv_in_range, other=0.0)
        # Rows past Lq and keys past Lk score -inf, so they add nothing anywhere below.
        keep = visible_keys(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, q_ptr, False,
                            IS_CAUSAL)
        s = scores_log2(mma(q, tl.trans(k), DOT_PRECISION, WIDEN_DOTS), keep, 0.0, qk_scale,
                        False)
        p = probs_from_lse(s, lse[:, None])
        dp = mma(do, tl.trans(v), DOT_PRECISION, WIDEN_DOTS)
        ds = p * (dp - delta[:, None])
        dv = mma(tl.trans(p.to(do.dtype)), do, DOT_PRECISION, WIDEN_DOTS)
        dk = mma(tl.trans(ds.to(q.dtype)), q, DOT_PRECISION, WIDEN_DOTS) * sm_scale
        tl.store(dk_ptrs + start_n.to(tl.int64) * stride_dk_n, dk.to(dk_ptr.dtype.element_ty),
                 mask=kv_in_range)
        tl.store(dv_ptrs + start_n.to(tl.int64) * stride_dv_n, dv.to(dv_ptr.dtype.element_ty),
                 mask=kv_in_range)
        dq += mma(ds.to(k.dtype), k, DOT_PRECISION, WIDEN_DOTS)

    dq *= sm_scale
    store = True
    if SPLIT_KEYS:
        # Partials are (splits, B * Hk, BLOCK_M, BLOCK_D) fp32, one tile per share and group.
        store_partial(dq_part_ptr, dq, rows, row_ok, split, pair, num_pairs, BLOCK_M, BLOCK_D)
        store = last_share_arrived(count_ptr + pair, num_splits)
        if store:
            dq = sum_partials(dq_part_ptr, rows, row_ok, pair, num_pairs, BLOCK_M, num_splits,
                              BLOCK_M, BLOCK_D)
    if store:
        tl.store(_group_rows(dq_ptr, b, offs_m, heads, stride_dq_b, stride_dq_m, stride_dq_h)
                 + offs_d[None, :], dq.to(dq_ptr.dtype.element_ty), mask=in_range)


# Rows of a packed tile: Lq * G up to this many use the packed backward. 16 is the smallest
# tile tl.dot takes, so decode (Lq = 1) packs any group of up to 16 query heads.
PACKED_MAX_ROWS = 16


def packs_rows(fwd) -> bool:
    """Whether the backward of forward plan ``fwd`` takes the packed launch."""
    shape = fwd.shape
    return (fwd.mask is None and fwd.bias is None
            and shape.seqlen_q * shape.group_size <= PACKED_MAX_ROWS)


@dataclass(frozen=True)
class PackedConfig:
    block_n: int
    num_warps: int
    num_stages: int


def packed_config(block_d: int, dtype: torch.dtype, interpreted: bool) -> PackedConfig:
    """Key block, warps and stages. A program holds a BLOCK_N x BLOCK_D tile each of K, V, dk
    and dv, so larger head dims and fp32 take half the keys."""
    if interpreted:
        return PackedConfig(16, 4, 1)  # small blocks: test shapes span many, and key shares
    if dtype == torch.float32 or block_d > 128:
        return PackedConfig(32, 4, 2)
    # H100, B1 H32/8 D128 bf16, GPU time (flushed) at Lk 4096 / 65536 / 524288: 8 warps
    # 21.0 / 203 / 1531 us, 4 warps 25.3 / 226 / 1700; 128-key blocks (8 warps, 2 stages)
    # 30.3 / 223 / 1664; 32-key blocks 26.8 / 209 / 1528 (results/notes.md, change 31).
    return PackedConfig(64, 8, 3)


class PackedBackwardPlan:
    """The packed backward's launch for one forward plan and gradient signature; the same
    ``run`` as ``backward.BackwardPlan``."""

    def __init__(self, fwd, grad_out, query, key, value, dq, dk, dv):
        shape: AttnShape = fwd.shape
        interpreted = is_interpreted(attn_bwd_packed_kernel)
        block_d = padded_head_dim(shape.head_dim)
        block_m = max(16, next_power_of_2(shape.seqlen_q * shape.group_size))
        cfg = packed_config(block_d, fwd.dtype, interpreted)
        pairs = shape.batch * shape.heads_kv
        # Shares of at least 4 key blocks, to about two programs per multiprocessor, as the
        # forward's split-K.
        self.splits = key_splits(pairs, ceil_div(shape.seqlen_k, cfg.block_n),
                                 multiprocessors(fwd.device, interpreted))
        self.launch = PlannedLaunch(
            attn_bwd_packed_kernel, (self.splits, pairs),
            (*strides3(query), *strides3(key), *strides3(value), *strides3(grad_out),
             *contiguous_strides(fwd.out_shape)[:3], *strides3(dq), *strides3(dk),
             *strides3(dv), shape.heads_q, shape.group_size, shape.seqlen_q, shape.seqlen_k,
             fwd.softmax_scale * LOG2E, fwd.softmax_scale),
            HEAD_DIM=shape.head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
            IS_CAUSAL=fwd.is_causal, **dot_options(fwd.dtype, interpreted),
            SPLIT_KEYS=self.splits > 1, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        split = self.splits > 1
        self._scratch = Scratch(
            fwd.device,
            *(((self.splits, pairs, block_m, block_d), torch.float32),
              ((pairs,), torch.int32)) if split else ())

    def run(self, grad_out, query, key, value, out, lse, mask, bias, dq, dk, dv):
        """Fill ``dq``, ``dk``, ``dv``; there is no bias, so no bias gradient (None)."""
        dq_part, counts = self._scratch.buffers() or (lse, lse)
        self.launch(query, key, value, out, grad_out, lse, dq, dk, dv, dq_part, counts)
        return None
