"""The kernels' arguments, by name: each is one NamedTuple that Triton passes as a tuple, so a
launch reads like a sentence and a kernel takes a few dozen parameters, not a hundred.

* ``Layout``: a broadcast mask, bias or bias-gradient buffer as (b, h, m, n) strides and the
  divisor that maps a query head to its head (query head h reads head h // head_div).
* ``SeqStrides``: a (B, L, H, D) tensor's (batch, position, head) strides; head_dim has stride 1.
* ``ListStrides``: an active-tile list table's (batch, head, row) strides (``_blocks``).
* ``Sizes``: the problem's sizes, which every kernel reads.
* ``*Pointers``: each kernel's tensors. They are the only arguments that change from call to
  call of one plan (``launch.PlannedLaunch``); an argument a launch does not read is given any
  tensor (its kernel never dereferences it).

Inside a kernel the fields are read by name (``q_strides.stride_l``, ``ptrs.mask``).

What a kernel is compiled for: Triton specializes every int on == 1 and on divisibility by 16,
so a new sequence length would compile new kernels wherever a length or a stride that follows
it changes class. The launcher (``runtime.forms.compile_form``) compiles each launch for a canonical
stand-in of its ints instead, by the rules each tuple states here:

* ``ALIGNED_FIELDS``: strides that place a tile's base address. Only their common alignment
  pays (a vectorized load needs the whole offset to be a multiple of 16 elements), so the
  kernel is compiled either for all of them being multiples of 16 (as they are) or for none;
  ``ALIGNED_ONLY_IF`` names the field value without which alignment cannot pay (a mask or
  bias read along keys with a stride other than 1, such as KeyIntervals' (start, end) pairs).
* ``KEPT_FIELDS``: values compiled for as they are: those fixed by the call's form (a unit key
  stride, a head divisor, head counts) and the lengths in ``Sizes``, which Triton compiles for
  by class (1, a multiple of 16, or other).
* every other int (list strides, grid counts, a length passed alone) is compiled for as
  unknown, except 1.

A model with equal query and key lengths then compiles at most two variants of each kernel
across all lengths (besides the schedule's own few decisions): one for lengths that are
multiples of 16, which keep its strides multiples of 16 too, and one for the rest.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Layout(NamedTuple):
    stride_b: int
    stride_h: int
    stride_m: int
    stride_n: int
    head_div: int

    ALIGNED_FIELDS = ("stride_b", "stride_h", "stride_m")
    ALIGNED_ONLY_IF = ("stride_n", 1)  # key loads vectorize only along contiguous keys
    KEPT_FIELDS = ("stride_n", "head_div")


ABSENT = Layout(0, 0, 0, 0, 1)  # an absent mask or bias: HAS_MASK / HAS_BIAS are False


class SeqStrides(NamedTuple):
    stride_b: int
    stride_l: int
    stride_h: int

    ALIGNED_FIELDS = ("stride_b", "stride_l", "stride_h")


def seq_strides(t: torch.Tensor) -> SeqStrides:
    """(batch, position, head) strides of a (B, L, H, D) tensor whose head_dim stride is 1."""
    return SeqStrides(t.stride(0), t.stride(1), t.stride(2))


class ListStrides(NamedTuple):
    stride_b: int
    stride_h: int
    stride_row: int


NO_LISTS = ListStrides(0, 0, 0)


class Sizes(NamedTuple):
    heads_q: int
    group_size: int  # query heads per kv head
    seqlen_q: int
    seqlen_k: int

    # The lengths are compiled for as Triton would (1, a multiple of 16, or other): LSE, delta
    # and split-K partial rows are addressed by (row block, length) offsets, and the backward's
    # vector loads of them need that alignment.
    KEPT_FIELDS = ("heads_q", "group_size", "seqlen_q", "seqlen_k")


def sizes_of(shape) -> Sizes:
    """The ``Sizes`` of an ``inputs.AttnShape``."""
    return Sizes(shape.heads_q, shape.group_size, shape.seqlen_q, shape.seqlen_k)


class ForwardPointers(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    mask: torch.Tensor
    bias: torch.Tensor
    lists: torch.Tensor
    out_part: torch.Tensor  # split-K partials and their tiles' arrival counters
    lse_part: torch.Tensor
    counts: torch.Tensor
    mask_end: torch.Tensor  # KeyIntervals read as given (scan_keys): their end; mask: start


class KeptPointers(NamedTuple):
    mask: torch.Tensor  # bool mask bytes, KeyIntervals words, or (pairs) their start
    mask_end: torch.Tensor  # pairs: the intervals' end
    kept: torch.Tensor  # (list rows, capacity) int32
    counts: torch.Tensor  # (list rows,) int32
    chunk_counts: torch.Tensor  # (list rows, chunks) int32: kept keys per chunk of keys
    kept_bits: torch.Tensor  # (list rows, chunks x CHUNK / 32) int32: each key's verdict, a bit


class OnePassListPointers(NamedTuple):
    mask: torch.Tensor  # as KeptPointers
    mask_end: torch.Tensor
    kept: torch.Tensor  # (list rows, capacity) int32
    counts: torch.Tensor  # (list rows,) int32
    tickets: torch.Tensor  # (list rows,) int64: chunk tickets handed out, over every call
    statuses: torch.Tensor  # (list rows, chunks) int64: each chunk's published count


class GatherPointers(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    mask: torch.Tensor
    mask_end: torch.Tensor
    bias: torch.Tensor
    kept: torch.Tensor
    counts: torch.Tensor
    out_part: torch.Tensor  # key shares' partials and their tiles' arrival counters
    lse_part: torch.Tensor
    arrivals: torch.Tensor


class BackwardStrides(NamedTuple):
    """Every (B, L, H, D) tensor's strides in a backward launch (one kernel argument)."""

    q: SeqStrides
    k: SeqStrides
    v: SeqStrides
    do: SeqStrides
    out: SeqStrides
    dq: SeqStrides
    dk: SeqStrides
    dv: SeqStrides


class BackwardLayouts(NamedTuple):
    """The broadcast operands and list tables of a backward launch (one kernel argument)."""

    mask: Layout
    bias: Layout
    dbias: Layout
    q_lists: ListStrides  # dq's lists: query blocks on rows
    kv_lists: ListStrides  # dkdv's lists: key blocks on rows


# The backward's pointer tuples name each tensor alike, so that the dq and dkdv programs read
# the fused launch's tuple as they read their own launch's.
class DqPointers(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    do: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor  # stored by dq for dkdv
    dq: torch.Tensor
    dq_part: torch.Tensor
    mask: torch.Tensor
    bias: torch.Tensor
    dbias: torch.Tensor
    q_lists: torch.Tensor
    dq_counts: torch.Tensor


class DkdvPointers(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor  # read only where delta comes from the output (the fused launch)
    do: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dk_part: torch.Tensor
    dv_part: torch.Tensor
    mask: torch.Tensor
    bias: torch.Tensor
    dbias: torch.Tensor  # the gradient buffer, or per-query-head rows (group rows)
    kv_lists: torch.Tensor
    kv_counts: torch.Tensor
    dbias_sum: torch.Tensor  # group rows summed into here


class FusedPointers(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    do: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor  # unused: each program computes delta itself
    dq: torch.Tensor
    dq_part: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dk_part: torch.Tensor
    dv_part: torch.Tensor
    mask: torch.Tensor
    bias: torch.Tensor
    dbias: torch.Tensor
    q_lists: torch.Tensor
    kv_lists: torch.Tensor
    dq_counts: torch.Tensor
    kv_counts: torch.Tensor
    dbias_sum: torch.Tensor


class PackedPointers(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    do: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dq_part: torch.Tensor
    counts: torch.Tensor
    mask: torch.Tensor
    bias: torch.Tensor
    dbias: torch.Tensor
