"""The Hopper route's backward: which problems it covers, and its plan. The kernel is
``hopper_device.attention_backward`` (Gluon, sm_90a): a program per key block of one (batch,
key head), dK and dV in registers, dQ added to a float32 accumulator by TMA reduce-adds.

It covers fp16 or bf16 at head dims up to 128 that are multiples of 8, with q, k, v and
grad_out laid out for TMA, on a GPU of compute capability 9.0: the dense backward (causal or
not, any lengths, GQA/MQA); a bool mask of a row per query row that TMA can read, or
KeyIntervals (their words, as prepared or as the forward's lists read them; intervals the
forward read as given run the Triton backward), each key block walking the activity lists of
the forward's map (``backward_list_tile`` puts its tile among the map's); ``deterministic=True``
without a mask, dQ's adds ordered by key block; and a bias of one row per (batch, head) with
its gradient (the gradient's rows as ``dbias.plan_dbias`` plans them, summed and cast by the
launch that casts the accumulators: ``hopper_backward_buffers``);
with ``kernel_options['backward_documents']``, a prepared packed batch's documents, each key
block walking its own sequence's query blocks (``documents_backward_gap``).
The schedule's default takes it where it leads the Triton backward (``takes_hopper_backward``);
``kernel_options['backward'] = 'hopper'`` forces it. A call whose addresses a descriptor cannot
take runs the Triton backward of the same schedule's default.
"""

from __future__ import annotations

import torch

from ..runtime.arith import LOG2E, ceil_div
from ..runtime.launch import DescriptorLaunch
from ..runtime.routes import note_route
from ..runtime.tma import TmaSpec
from . import tuning
from .documents import document_key_blocks, tile_bound
from .hopper_backward_buffers import HopperBackwardBuffers
from .hopper_forward import (GLUON_MISSING, INTERVAL_WORDS, NO_MASK, bias_row_gap,
                             documents_gap, hopper_operands_gap, mask_kind)
from .hopper_forward_launch import (HopperForwardLaunch, block_head_dim, gluon_dtype,
                                    mask_geometry, nvmma_spec)
from .problem import Problem, tma_strides

try:
    from triton.experimental.gluon import language as gl
    from ..hopper_device.attention_backward import attention_backward
except ImportError:  # a Triton without Gluon's Hopper modules (``GLUON_MISSING`` says why)
    attention_backward = None


def backward_bias_gap(problem: Problem) -> str | None:
    """Why the Hopper backward does not take ``problem``'s bias (one line), or None: a bias
    of one row per (batch, head), and with one query row in all (a packed batch's too) no
    gradient, which is then planned as a full (Lq, Lk) bias's."""
    gap = bias_row_gap(problem)
    if gap is None and problem.bias_grad and problem.shape.seqlen_q == 1:
        gap = "its bias gradient sums a key's rows: not yet one query row"
    return gap


def hopper_backward_gap(problem: Problem) -> str | None:
    """Why the Hopper backward does not cover ``problem`` (one line), or None where it does."""
    if GLUON_MISSING:
        return GLUON_MISSING
    if problem.bias is not None:
        gap = backward_bias_gap(problem)
        if gap is not None:
            return gap
    if problem.mask is not None:
        if problem.mask.one_row and not problem.intervals:
            return ("it takes bool masks with a row per query row and KeyIntervals; not yet a "
                    "mask of one row for every query row")
        if problem.deterministic:
            return ("with a mask its dQ partials are added in any order: not bitwise "
                    "reproducible")
    return hopper_operands_gap(problem)


def documents_backward_gap(problem: Problem) -> str | None:
    """Why the Hopper backward cannot walk ``problem``'s packed documents each in its own key
    blocks (one line), or None: as ``hopper_forward.documents_gap`` says, with dQ's adds in
    any order, and a bias as ``hopper_backward_gap`` takes it."""
    gap = documents_gap(problem)
    if gap is None and problem.deterministic:
        gap = ("over documents its dQ partials are added in any order: not bitwise "
               "reproducible")
    if gap is None and problem.bias is not None:
        gap = backward_bias_gap(problem)
    return gap or hopper_operands_gap(problem, reads_mask=False)


def query_walks(problem: Problem, tile: tuning.HopperBackwardTile = tuning.HOPPER_BACKWARD
                ) -> list[int]:
    """The query blocks each key block's program walks for one query head without a mask
    (causal: from the first block whose rows see the key block's first key; bottom-right
    aligned), for the key blocks that some row sees."""
    shape = problem.shape
    query_blocks = ceil_div(shape.seqlen_q, tile.block_m)
    if not problem.is_causal:
        return [query_blocks] * ceil_div(shape.seqlen_k, tile.block_n)
    diagonal = shape.seqlen_k - shape.seqlen_q  # row r sees keys <= r + diagonal
    return [query_blocks - max(first_key - diagonal, 0) // tile.block_m
            for first_key in range(0, shape.seqlen_k, tile.block_n)
            if first_key - diagonal < shape.seqlen_q]


def mean_query_blocks(problem: Problem, tile: tuning.HopperBackwardTile = tuning.HOPPER_BACKWARD
                      ) -> float:
    """The mean number of query blocks a key block's program walks without a mask, over the
    programs that walk any (``query_walks``)."""
    walks = query_walks(problem, tile)
    return sum(walks) / len(walks) if walks else 0.0


def longest_walk_share(problem: Problem,
                       tile: tuning.HopperBackwardTile = tuning.HOPPER_BACKWARD,
                       split_heads: bool = False) -> float:
    """The longest program's walk over the mean work of a multiprocessor: a program walks its
    key block's query blocks for every query head of its GQA group, one after another (with
    ``split_heads``, for one query head), so the backward takes at least the longest walk, and
    at least the total over the multiprocessors. Above 1 the longest program outlasts the even
    share (a grid of fewer programs than multiprocessors, or a causal grid of long diagonal
    walks and few heads)."""
    return _longest_share(problem, query_walks(problem, tile), split_heads)


def _longest_share(problem: Problem, walks: list[int], split_heads: bool) -> float:
    if not walks:
        return 0.0
    # A whole group's program walks its key block once per head of the group: the group
    # cancels, leaving the programs of one head's walks.
    shape = problem.shape
    programs = shape.batch * (shape.heads_q if split_heads else shape.heads_kv)
    return max(walks) * problem.multiprocessors / (sum(walks) * programs)


def active_walk_share(problem: Problem) -> float | None:
    """The pairs in a prepared mask's active Hopper backward tiles (its counted
    ``ActivityMap.active_area``) over the unmasked walks' (``query_walks``, every mask batch
    and head), or None where the map did not count them."""
    activity = problem.activity
    if activity is None:
        return None
    tile = tuning.HOPPER_BACKWARD
    area = activity.active_area(tile.block_m, tile.block_n)
    if area is None:
        return None
    batch, heads = activity.active.shape[:2]
    walked = sum(query_walks(problem)) * batch * heads * tile.block_m * tile.block_n
    return area / walked if walked else 0.0


def captured_split(problem: Problem) -> bool:
    """Whether ``problem`` is a captured backward that splits long walks by GPU time
    (``tuning.HOPPER_BACKWARD_SPLIT_CAPTURED``): without a mask, or with a prepared mask whose
    active tiles keep at least ``tuning.HOPPER_BACKWARD_CAPTURED_MIN_ACTIVE_SHARE`` of the
    unmasked walks (``active_walk_share``), which the dense walks' shares then describe."""
    if not (problem.captured and tuning.HOPPER_BACKWARD_SPLIT_CAPTURED):
        return False
    if problem.mask is None:
        return True
    share = active_walk_share(problem)
    return share is not None and share >= tuning.HOPPER_BACKWARD_CAPTURED_MIN_ACTIVE_SHARE


def split_share_bound(problem: Problem) -> float:
    """The longest walk's share a grid of a program per query head may have:
    ``tuning.HOPPER_BACKWARD_CAPTURED_MAX_SPLIT_SHARE`` for a ``captured_split`` problem, else
    ``tuning.HOPPER_BACKWARD_MAX_LONGEST_WALK_SHARE``."""
    if captured_split(problem):
        return tuning.HOPPER_BACKWARD_CAPTURED_MAX_SPLIT_SHARE
    return tuning.HOPPER_BACKWARD_MAX_LONGEST_WALK_SHARE


def splitting_balances(problem: Problem) -> bool:
    """Whether a program per query head brings the grid's longest walk within
    ``split_share_bound`` of the even share where whole GQA groups do not come within
    ``tuning.HOPPER_BACKWARD_MAX_LONGEST_WALK_SHARE`` (B1 H16/4 L4096 causal: 2.0 whole, 0.5
    split)."""
    walks = query_walks(problem)
    whole = _longest_share(problem, walks, False)
    return (whole > tuning.HOPPER_BACKWARD_MAX_LONGEST_WALK_SHARE
            and _longest_share(problem, walks, True) <= split_share_bound(problem))


def takes_hopper_backward(problem: Problem, split_heads: bool = False) -> bool:
    """The schedule's default: the Hopper backward where it covers the problem, each key
    block's program walks enough query blocks to lead the Triton backward
    (``tuning.HOPPER_BACKWARD_MIN_QUERY_BLOCKS`` and the measurements beside it), key-ordered
    top-W intervals keep enough pairs that the call is not bound by the route's host time
    (``tuning.HOPPER_BACKWARD_MIN_ORDERED_PAIRS``), and no program's walk (one per query head
    with ``split_heads``) outlasts the grid's even share by much
    (``tuning.HOPPER_BACKWARD_MAX_LONGEST_WALK_SHARE``; ``split_share_bound`` split)."""
    if hopper_backward_gap(problem) is not None:
        return False
    if problem.deterministic:
        if problem.is_causal:
            return False
        least = tuning.HOPPER_BACKWARD_DETERMINISTIC_MIN_QUERY_BLOCKS
    elif problem.shape.head_dim > 64:
        least = tuning.HOPPER_BACKWARD_WIDE_MIN_QUERY_BLOCKS
    else:
        least = tuning.HOPPER_BACKWARD_MIN_QUERY_BLOCKS
    walks = query_walks(problem)
    if not walks or sum(walks) / len(walks) < least:
        return False
    if (ordered_walks(problem)
            and ordered_pairs(problem) < tuning.HOPPER_BACKWARD_MIN_ORDERED_PAIRS):
        return False
    most = (split_share_bound(problem) if split_heads
            else tuning.HOPPER_BACKWARD_MAX_LONGEST_WALK_SHARE)
    return _longest_share(problem, walks, split_heads) <= most


def backward_list_tile(problem: Problem) -> tuple[int, int] | None:
    """The (query rows, keys) tile of the masked Hopper backward's lists where it may walk this
    problem's mask, else None: the activity map a prepared mask builds must divide it."""
    if problem.mask is None or hopper_backward_gap(problem) is not None:
        return None
    return tuning.HOPPER_BACKWARD.block_m, tuning.HOPPER_BACKWARD.block_n


class HopperBackwardPlan:
    """The Hopper backward for one forward plan and gradient signature (``problem``, the
    backward's, and ``bwd``, its schedule: the tile and the bias gradient's plan): boxes,
    layouts, grid and scalars fixed once. A call builds the loader's LSE and delta rows and
    zeroes the float32 accumulators (one launch), makes the descriptors and launches, then
    casts the accumulators and finishes the bias gradient (one launch): ``buffers``.
    ``fallback``: the plan of the Triton backward for calls whose addresses a descriptor cannot
    take (made on first need by ``make_fallback``)."""

    route = "hopper"

    def __init__(self, fwd, problem: Problem, bwd, make_fallback):
        tile, dbias = bwd.launches, bwd.dbias
        shape = problem.shape
        block_d = block_head_dim(shape.head_dim)
        element = gluon_dtype(problem.dtype)
        self.shape = shape
        self.q_spec = nvmma_spec([1, tile.block_m, 1, block_d], element)
        self.kv_spec = nvmma_spec([1, tile.block_n, 1, block_d], element)
        self.half_spec = nvmma_spec([1, tile.block_n // 2, 1, block_d], element)
        # A quarter of D per reduce-add.
        self.acc_spec = nvmma_spec([1, 1, tile.block_m, block_d // 4], gl.float32)
        self.row_spec = TmaSpec([1, tile.block_m], gl.NVMMASharedLayout(
            swizzle_byte_width=0, element_bitwidth=32, rank=2))
        self.kind = mask_kind(problem)  # NO_MASK, MASK_TILE or INTERVAL_WORDS
        # A bias row (the forward plan's layout of its broadcast view) and the plan of its
        # gradient's rows (``dbias.DbiasPlan``: summed over the group, or per query head).
        self.bias_layout, self.dbias = fwd.bias_layout, dbias
        if self.kind != NO_MASK:
            # A [BLOCK_M rows, BLOCK_N keys] box of a bool mask's bytes; KeyIntervals' words
            # the consumers load themselves.
            self.mask_box = [1, 1, tile.block_m, tile.block_n]
            self.mask_layout = gl.NVMMASharedLayout.get_default_for(self.mask_box, gl.uint8)
            self.list_tile = (tile.block_n, tile.block_m)  # keys on rows (transposed)
        self.lists_activity = fwd.lists_activity  # the map a call's lists come from
        # The last call's mask arguments, where the lists are the plan's own (a prepared
        # mask's): a later call with the same table and mask view reuses them.
        self.lists_kept = not fwd.lists_per_call
        self._kept_mask_args: tuple | None = None
        key_blocks = ceil_div(shape.seqlen_k, tile.block_n)
        units = shape.batch * (shape.heads_q if bwd.split_heads else shape.heads_kv)
        order_group = grid_order_group(problem, key_blocks, units)
        causal = problem.is_causal
        # Packed documents: every sequence's key blocks (``document_key_blocks``' order), built
        # once for prepared intervals (the plan is theirs), else per call from its offsets;
        # the grid is their bound, key heads inner.
        self.documents = self.document_blocks = None
        if bwd.documents:
            self.kind, order_group = NO_MASK, None
            causal = fwd.document_causal
            key_blocks = tile_bound(shape.seqlen_k, problem.documents, tile.block_n)
            self.document_blocks = (shape.seqlen_k, tile.block_n, tile.block_m, causal)
            if fwd.documents is not None:
                self.documents = self.call_documents(fwd.documents[:2])
        # Split heads: a program per query head of each key block, dK and dV reduce-added into
        # float32 accumulators (the bias gradient's plan is then a row per query head).
        self.split_heads = bwd.split_heads
        self.launch = DescriptorLaunch(
            attention_backward, (units * key_blocks,),
            (shape.seqlen_q, shape.seqlen_k, shape.heads_q, shape.heads_kv, shape.group_size,
             order_group or 1, problem.softmax_scale * LOG2E, problem.softmax_scale),
            num_warps=4, CAUSAL=causal, GROUPED_ORDER=order_group is not None,
            DOCUMENTS=self.document_blocks is not None, MASK_KIND=self.kind,
            DETERMINISTIC=problem.deterministic, HAS_BIAS=self.bias_layout is not None,
            BIAS_GRAD=dbias is not None, BIAS_GROUP_SUM=bool(dbias and dbias.sum_group),
            DQ_SPREAD=bwd.dq_spread, SPLIT_HEADS=self.split_heads,
            STAGES=tile.stages,
            CONSUMER_REGS=tile.consumer_regs, LOADER_REGS=tile.loader_regs)
        # Deterministic: a zeroed lock per (batch x query head, query block) orders dQ's adds.
        self.lock_count = (shape.batch * shape.heads_q * ceil_div(shape.seqlen_q, tile.block_m)
                           if problem.deterministic else 0)
        # dQ's float32 accumulator in dQ's own (B, Lq, Hq, D) order, the kernel's descriptor
        # over its (B, Hq, Lq, D) view: its cast to dQ reads it contiguously (H200, B1 Lq65536
        # H16 D128: 189 us, from (B, Hq, Lq, D) 346 us; backward 0.91-0.99x on varlen.yaml);
        # with ``bwd.dq_spread`` its columns in ``hopper_device.dq_columns``' order.
        self.buffers = HopperBackwardBuffers(shape, tile.block_m, self.split_heads,
                                             self.lock_count, dbias, bwd.dq_spread, fwd.device)
        self._kept_operands: tuple | None = None  # (views, ``_scratch_operands``)
        self._make_fallback = make_fallback
        self._fallback = None

    def call_documents(self, offsets: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        """(the key blocks' table, cu_q, cu_k) that the kernel walks packed documents by, for
        int32 ``offsets`` (cu_q, cu_k): ``document_key_blocks`` on their device, no
        read-back."""
        cu_q, cu_k = offsets
        return document_key_blocks(cu_q, cu_k, *self.document_blocks), cu_q, cu_k

    def run(self, grad_out, query, key, value, out, lse, mask, bias, dq, dk, dv,
            activity=None, document_offsets=None):
        """Fill ``dq``, ``dk``, ``dv``; return the bias gradient (or None). A masked
        call reads ``mask`` (the bool mask's (B, H, Lq, Lk) broadcast view) and the lists of
        the forward's activity map (``activity``: the call's own, for a plan with lists per
        call); a plan of unprepared packed documents their ``document_offsets`` (cu_q,
        cu_k)."""
        walks_documents = self.document_blocks is not None
        # KeyIntervals the forward read as given (start and end, no lists) go to the fallback.
        if (not HopperForwardLaunch.takes(grad_out, query, key, value, dq, dk, dv)
                or not tma_strides(grad_out) or isinstance(mask, tuple)
                or (walks_documents  # last keys written from registers
                    and not (dk.is_contiguous() and dv.is_contiguous()))):
            if self._fallback is None:
                self._fallback = self._make_fallback()
            return self._fallback.run(grad_out, query, key, value, out, lse, mask, bias, dq, dk,
                                      dv, activity)
        note_route("backward", self.route)
        buffers = self.buffers
        views = buffers.views()
        buffers.fill_rows(grad_out, out, lse, views)
        rows = views.rows
        rows_desc, dq_desc, dkv_descs = self._scratch_operands(views)
        if self.kind != NO_MASK:
            mask_args = self._mask_args(mask, activity)
        else:  # stand-ins the kernel never reads
            mask_args = (rows_desc, rows, 0, 0, 0, 1, 1, 0, 0, 0)
        locks = views.locks if views.locks is not None else rows  # rows: never read
        bias_grad = buffers.bias_buffer(views, query.device)
        bias_args = self._bias_args(bias, bias_grad, rows)
        if walks_documents:
            documents = self.documents or self.call_documents(document_offsets)
            document_args = (*documents, dk, dv, dk.stride(1), self.shape.head_dim)
        else:  # stand-ins the kernel never reads
            document_args = (rows, rows, rows, rows, rows, 0, 0)
        if not self.split_heads:
            dkv_descs = (self.half_spec(dk), self.half_spec(dv))
        self.launch(self.q_spec(query), self.kv_spec(key), self.kv_spec(value),
                    self.q_spec(grad_out), dq_desc, *dkv_descs, rows_desc, *mask_args,
                    *bias_args, locks, *document_args)
        return buffers.finish(views, dq, dk, dv, bias_grad)

    def _scratch_operands(self, views) -> tuple:
        """The kernel's operands in the scratch buffer: the rows' descriptor, dQ's
        accumulator's, and with split heads dK's and dV's accumulators' (float32, (B, Lk, Hk,
        D) order; else None). Kept with the views of a kept buffer (each view a torch op)."""
        kept = self._kept_operands
        if kept is not None and kept[0] is views:
            return kept[1]
        rows = views.rows
        dkv = None
        if self.split_heads:
            dkv = (self.acc_spec(views.dk_acc.transpose(1, 2)),
                   self.acc_spec(views.dv_acc.transpose(1, 2)))
        operands = (self.row_spec(rows.view(-1, rows.shape[-1])),
                    self.acc_spec(views.dq_acc.transpose(1, 2)), dkv)
        if self.buffers.keeps(views):
            self._kept_operands = (views, operands)
        return operands

    def _bias_args(self, bias, bias_grad, stand_in) -> tuple:
        """(bias, its batch, head and key strides, query heads per bias head; the gradient's
        rows (B, heads, 1, Lk), their batch and head strides): the kernel's bias arguments,
        ``stand_in`` for what the call does not have."""
        if self.bias_layout is None:
            return (stand_in, 0, 0, 0, 1, stand_in, 0, 0)
        layout = self.bias_layout
        grad = (stand_in, 0, 0) if bias_grad is None else (
            bias_grad, bias_grad.stride(0), bias_grad.stride(1))
        return (bias, layout.stride_b, layout.stride_h, layout.stride_n, layout.head_div,
                *grad)

    def _mask_args(self, mask: torch.Tensor, activity) -> tuple:
        """(the mask's descriptor, or KeyIntervals' words; the list table, its batch, head and
        key-block strides; query heads per list head and per mask head; 1 if the mask's batch
        is read else 0; the words' batch and head strides): the kernel's mask and list
        arguments for a call's mask (its (B, H, Lq, Lk) broadcast view; KeyIntervals' int64
        words with a query stride of 0). On the H200 host (torch.profiler) they took 27-45 us a
        call."""
        table = self.lists_activity(activity).lists(*self.list_tile, transposed=True).table
        form = (mask.data_ptr(), mask.shape, mask.stride())
        kept = self._kept_mask_args
        if kept is not None and kept[0] is table and kept[1] == form:
            return kept[2]
        heads_q = self.shape.heads_q
        words = self.kind == INTERVAL_WORDS
        shape, strides, mask_head_div, mask_batches = mask_geometry(mask, heads_q, words)
        if words:  # the kernel loads them itself, by the view's batch and head strides
            mask_arg, word_strides = mask, strides[:2]
        else:
            mask_arg = TmaSpec(self.mask_box, self.mask_layout, shape, strides)(
                mask.view(torch.uint8))
            word_strides = (0, 0)
        shared = table.shape[0] == 1 and self.shape.batch > 1
        args = (mask_arg, table, 0 if shared else table.stride(0), table.stride(1),
                table.stride(2), heads_q // table.shape[1], mask_head_div, mask_batches,
                *word_strides)
        if self.lists_kept:  # a prepared mask's: its plan's lists, its mask alive with it
            self._kept_mask_args = (table, form, args)
        return args


def ordered_pairs(problem: Problem) -> int:
    """The most (query, key) pairs key-ordered top-W intervals keep over the call: every
    query row of every batch and query head keeps at most ``row_kept`` keys."""
    shape = problem.shape
    return (shape.batch * shape.heads_q * shape.seqlen_q
            * min(problem.row_kept, shape.seqlen_k))


def ordered_walks(problem: Problem) -> bool:
    """Whether the call's mask is KeyIntervals of at most W keys a row read in their key
    order (``topk_intervals``' top-W form: causality folded in, so the call runs non-causal):
    the order puts the keys most rows keep in the first key blocks, which walk nearly every
    query block, and the rest in blocks of short walks."""
    return problem.intervals and problem.row_kept is not None and not problem.is_causal


def grid_order_group(problem: Problem, key_blocks: int, units: int) -> int | None:
    """Units (a (batch, key head), or a (batch, query head) with split heads) per group of
    the grid's order by key block (``tiles.KeyBlockWork``'s GROUPED_ORDER), for a grid of
    ``units`` x ``key_blocks`` programs: causal, enough that a group's programs fill
    ``tuning.HOPPER_BACKWARD_CAUSAL_GROUP_WAVES`` waves of one program per multiprocessor;
    for ``ordered_walks``, ``tuning.HOPPER_BACKWARD_ORDERED_GROUP_WAVES`` likewise, all
    ``units`` where it is None (every unit's first key blocks, the longest walks, start
    first). None: no groups (a causal grid's one order by key block where its tuning asks
    for none; a non-causal grid's order by unit)."""
    if problem.is_causal:
        waves = tuning.HOPPER_BACKWARD_CAUSAL_GROUP_WAVES
    elif ordered_walks(problem):
        waves = tuning.HOPPER_BACKWARD_ORDERED_GROUP_WAVES
        if waves is None:
            return units
    else:
        return None
    if waves is None:
        return None
    return max(1, ceil_div(int(waves * problem.multiprocessors), key_blocks))
