"""What a transformers attention layer hands ``dmattn_func`` besides query, key and value.

A layer gets either None or a 2-D (B, Lk) key padding mask (``transformers.dmattn_mask`` makes
those for the plain causal and sliding-window patterns), packed documents as ``KeyIntervals``
(``document_intervals``), or transformers' complete 4-D mask for every other pattern. Padding
and sliding windows become ``KeyIntervals`` of shape (B or 1, 1, Lk), with causality left to
the kernel's flag: O(Lk) memory, never an (Lq, Lk) tensor. A 4-D mask is taken as the whole
truth (a float one as keep mask plus bias).

Doge keeps each row's ``keep_window`` visible keys of largest per-key bias. Over a causal,
optionally padded, row set that is ``kernels.topk_intervals`` of the bias with padded keys
ranked last, intersected with the padding intervals; over packed documents it is
``topk_intervals`` of the documents as packed sequences (``document_top_window``). Where the
visible set is neither (a 4-D mask, or a sliding window narrower than Lk and wider than the
keep window) the kept keys of a key need not form one run of rows, and the choice is a bool
(B, Hk, Lq, Lk) mask built ``ROWS_PER_TOPK_STEP`` rows at a time. Every path ranks equal
biases by key index, smaller first.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..masks.intervals import KeyIntervals
from ..topk_ops import topk_intervals

# Query rows per step of the bool top-W fallback: bounds its temporaries (the float scores and
# their sort) to batch * heads_kv * ROWS_PER_TOPK_STEP * seqlen_k elements.
ROWS_PER_TOPK_STEP = 1024


class Masking(NamedTuple):
    """What one attention call hands the kernel besides query, key and value."""

    attn_mask: KeyIntervals | torch.Tensor | None  # intervals, or bool (True = keep), 4-D
    attn_bias: torch.Tensor | None  # additive, 4-D broadcastable
    is_causal: bool


# -- the Llama family -------------------------------------------------------------------------

def causal_family_masking(attention_mask, seqlen_q: int, seqlen_k: int, is_causal: bool,
                          sliding_window: int | None, dtype: torch.dtype,
                          device: torch.device) -> Masking:
    """The kernel's mask, bias and causal flag for a Llama-family layer.

    ``attention_mask``: None or a 2-D (B, Lk) key padding mask (causality from the flag, the
    padding and the window as ``padding_intervals``), or a complete 4-D mask (bool, or float
    with the minimum value or -inf where masked, whose other entries become the bias, in
    ``dtype``).
    """
    if isinstance(attention_mask, KeyIntervals):  # packed documents (``document_intervals``)
        window = padding_intervals(None, seqlen_q, seqlen_k, sliding_window, device)
        return Masking(_intersect(attention_mask, window), None, is_causal)
    if attention_mask is not None and attention_mask.dim() == 4:
        return _complete_masking(attention_mask, seqlen_k, dtype)
    padding = None if attention_mask is None else key_padding(attention_mask, seqlen_k)
    return Masking(padding_intervals(padding, seqlen_q, seqlen_k, sliding_window, device), None,
                   is_causal)


def document_intervals(documents: torch.Tensor) -> KeyIntervals:
    """Packed documents as ``KeyIntervals`` (B, 1, L): ``documents`` (B, L) gives each
    position's document, in runs (transformers' packed-sequence indices, a cumulative count of
    restarts), and key j of the run [s, e) is seen by rows [s, e); causality is the flag's.
    O(B L) torch ops, no read-back."""
    seqlen = documents.shape[-1]
    positions = torch.arange(seqlen, device=documents.device).expand_as(documents)
    new = torch.ones_like(documents, dtype=torch.bool)
    new[:, 1:] = documents[:, 1:] != documents[:, :-1]
    last = torch.ones_like(new)
    last[:, :-1] = new[:, 1:]
    start = torch.where(new, positions, 0).cummax(-1).values
    end = torch.where(last, positions + 1, seqlen).flip(-1).cummin(-1).values.flip(-1)
    return KeyIntervals(start[:, None].to(torch.int32).contiguous(),
                        end[:, None].to(torch.int32).contiguous())


def key_padding(attention_mask: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """A 2-D key padding mask as bool (B, Lk), True = a real key."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask: expected None, a 2-D key padding mask or a 4-D mask, "
                         f"got shape {tuple(attention_mask.shape)}")
    if attention_mask.shape[-1] != seqlen_k:
        raise ValueError(f"attention_mask: a 2-D padding mask needs one entry per key "
                         f"({seqlen_k}), got shape {tuple(attention_mask.shape)}")
    return attention_mask.to(torch.bool)


def padding_intervals(padding: torch.Tensor | None, seqlen_q: int, seqlen_k: int,
                      sliding_window: int | None, device) -> KeyIntervals | None:
    """Key padding and a sliding window as intervals (B or 1, 1, Lk); None when neither hides
    a key. A padded key is seen by no row. With a window, key j is seen up to row
    j - (Lk - Lq) + window - 1 (bottom-right aligned: row i sees keys i - window < j, in key
    positions i + Lk - Lq); the rows before j are the causal flag's business."""
    windowed = sliding_window is not None and seqlen_k > sliding_window
    if padding is None and not windowed:
        return None
    end = torch.full((1, seqlen_k), seqlen_q, dtype=torch.int32, device=device)
    if windowed:
        keys = torch.arange(seqlen_k, dtype=torch.int32, device=device)
        end = torch.clamp(keys + (sliding_window - (seqlen_k - seqlen_q)), max=seqlen_q)[None]
    if padding is not None:
        end = torch.where(padding.to(device), end, 0)
    end = end[:, None, :]
    return KeyIntervals(torch.zeros_like(end), end)


def _complete_masking(mask: torch.Tensor, seqlen_k: int, dtype: torch.dtype) -> Masking:
    """A 4-D mask that already says everything: is_causal is off. Keys past ``seqlen_k`` are
    cut off, as transformers' eager attention does."""
    mask = mask[..., :seqlen_k]
    if mask.dtype == torch.bool:
        return Masking(mask, None, False)
    keep = mask > torch.finfo(mask.dtype).min
    bias = torch.where(keep, mask, torch.zeros((), dtype=mask.dtype, device=mask.device))
    return Masking(keep, bias.to(dtype), False)


# -- Doge -------------------------------------------------------------------------------------

def doge_masking(attention_mask, bias: torch.Tensor, seqlen_q: int, is_causal: bool,
                 sliding_window: int | None, keep_window: int) -> Masking:
    """The kernel's mask, bias and causal flag for a Doge layer.

    Visible keys are those of the Llama-family rule (``causal_family_masking``), except that a
    complete float mask hides every nonzero entry, as Doge's own mask does. With more keys than
    ``keep_window``, each row keeps its ``keep_window`` visible keys of largest bias, equal
    biases the smaller key index first. The bias goes to the kernel as it is, (B, Hk, 1, Lk).
    """
    seqlen_k = bias.shape[-1]
    documents = isinstance(attention_mask, KeyIntervals)
    if (attention_mask is not None and not documents and attention_mask.dim() == 4
            and attention_mask.is_floating_point()):
        attention_mask = attention_mask[..., :seqlen_k] == 0
    visible = causal_family_masking(attention_mask, seqlen_q, seqlen_k, is_causal,
                                    sliding_window, bias.dtype, bias.device)
    windowed = sliding_window is not None and seqlen_k > sliding_window
    if seqlen_k <= keep_window or (windowed and is_causal and sliding_window <= keep_window):
        return visible._replace(attn_bias=bias)  # no row sees more than keep_window keys
    if documents and not windowed:  # each row ranks its own document's keys
        return Masking(document_top_window(visible.attn_mask, bias, keep_window, is_causal),
                       bias, is_causal)
    if windowed or isinstance(visible.attn_mask, torch.Tensor):
        return Masking(_bool_top_window(visible, bias, seqlen_q, keep_window), bias, False)
    ranking = bias
    if attention_mask is not None:  # padded keys rank below every real one
        padded = ~key_padding(attention_mask, seqlen_k)[:, None, None, :]
        ranking = bias.detach().masked_fill(padded, float("-inf"))
    chosen = topk_intervals(ranking, keep_window, seqlen_q=seqlen_q, is_causal=is_causal)
    return Masking(_intersect(chosen, visible.attn_mask), bias, is_causal)


def document_top_window(documents: KeyIntervals, bias: torch.Tensor, keep_window: int,
                        is_causal: bool) -> KeyIntervals:
    """Per row, the ``keep_window`` keys of largest ``bias`` (B, Hk, 1, L) among its own
    document's visible ones, for packed documents (``document_intervals``, (B, 1, L)): as
    (B, Hk, L) intervals in row coordinates.

    The batch's documents go end to end to ``topk_intervals`` as packed sequences, one per
    document. Their offsets come from a sort of the documents' first positions, padded with
    empty sequences to B * L of them, so that no count is read back to size them (the
    offsets' value check still reads back, outside torch.compile). The chosen rows, in each
    document's own coordinates, are shifted by its first position in the row."""
    batch, heads, _, seqlen = bias.shape
    total = batch * seqlen
    flat = torch.arange(total, device=bias.device)
    row_start = flat.view(batch, seqlen) - torch.arange(seqlen, device=bias.device)
    first = (documents.start[:, 0].long() + row_start).flatten() == flat
    offsets = torch.where(first, flat, total).sort().values
    cu_seqlens = torch.cat([offsets, offsets.new_full((1,), total)]).to(torch.int32)
    packed = bias[:, :, 0, :].transpose(0, 1).reshape(heads, total)
    chosen = topk_intervals(packed, keep_window, is_causal=is_causal, cu_seqlens_k=cu_seqlens)

    def rows(bound: torch.Tensor) -> torch.Tensor:
        return (bound.reshape(heads, batch, seqlen).transpose(0, 1) + documents.start).contiguous()

    return KeyIntervals(rows(chosen.start), rows(chosen.end))


def _intersect(a: KeyIntervals, b: KeyIntervals | None) -> KeyIntervals:
    """The keys both see, read in ``a``'s key order (any order gives the same attention; the
    padding only empties or shortens runs, so a's grouping still holds)."""
    if b is None:
        return a
    return a.keeping_subset(torch.maximum(a.start, b.start), torch.minimum(a.end, b.end))


def _bool_top_window(visible: Masking, bias: torch.Tensor, seqlen_q: int,
                     keep_window: int) -> torch.Tensor:
    """Per row, the ``keep_window`` keys of largest bias among ``visible``'s (all of them when
    fewer), as a bool (B, Hk, Lq, Lk) mask made without a graph. NaN ranks as -inf."""
    seqlen_k = bias.shape[-1]
    keep = torch.zeros(bias.shape[:2] + (seqlen_q, seqlen_k), dtype=torch.bool,
                       device=bias.device)
    ranking = bias.detach()
    ranking = ranking.masked_fill(torch.isnan(ranking), float("-inf"))
    with torch.no_grad():
        for start in range(0, seqlen_q, ROWS_PER_TOPK_STEP):
            rows = slice(start, min(start + ROWS_PER_TOPK_STEP, seqlen_q))
            seen = _visible_rows(visible, rows, seqlen_q, seqlen_k, bias.device)
            scores = ranking.masked_fill(~seen, float("-inf"))
            order = scores.sort(dim=-1, descending=True, stable=True).indices
            keep[:, :, rows].scatter_(-1, order[..., :keep_window], True)
            keep[:, :, rows] &= seen
    return keep


def _visible_rows(masking: Masking, rows: slice, seqlen_q: int, seqlen_k: int,
                  device) -> torch.Tensor:
    """Query rows ``rows`` of ``masking``'s mask and causal flag, as one bool
    (Bm, Hm, rows, Lk) tensor."""
    visible = masking.attn_mask
    index = torch.arange(rows.start, rows.stop, device=device)[:, None]
    if isinstance(visible, KeyIntervals):
        visible = (visible.start[..., None, :] <= index) & (index < visible.end[..., None, :])
    elif visible is not None and visible.shape[2] != 1:
        visible = visible[:, :, rows]
    if masking.is_causal:
        causal = (torch.arange(seqlen_k, device=device) <= index + (seqlen_k - seqlen_q))
        visible = causal[None, None] if visible is None else visible & causal
    if visible is None:
        return torch.ones(1, 1, rows.stop - rows.start, seqlen_k, dtype=torch.bool, device=device)
    return visible.expand(-1, -1, rows.stop - rows.start, seqlen_k)
