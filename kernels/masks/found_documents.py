"""KeyIntervals recognized as the documents of sequences packed end to end.

A batch of one whose keys and rows are the same L positions, cut into documents [s, e): key j
of a document is seen by rows [s, e), or, in the causal form, by rows [j, e). Such intervals
are what ``varlen.packed_intervals`` builds from offsets (it names them there); the same
documents handed to ``dmattn_func`` as KeyIntervals are recognized here, so that the Hopper
kernels can walk each document in its own tiles (``planning.documents``).
"""

from __future__ import annotations

import torch

from .intervals import KeyIntervals


def find_documents(intervals: KeyIntervals, seqlen_q: int,
                   is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """The documents that ``intervals`` are, as varlen names them (int32 offsets for the
    rows, the same for the keys, and whether each document is causal: the causal form, or
    the call's ``is_causal``), or None where they are not exactly some documents' (several
    batch or head rows that are not one row broadcast, rows and keys of other lengths, a
    key no row sees, documents of both forms). O(L) torch ops on the intervals' device and
    one read-back."""
    batch, heads, seqlen_k = intervals.shape
    start, end = intervals.start, intervals.end
    if (batch != 1 or seqlen_k != seqlen_q or seqlen_k == 0
            or (heads != 1 and (start.stride(1) != 0 or end.stride(1) != 0))):
        return None
    start, end = start[0, 0].to(torch.int64), end[0, 0].to(torch.int64)
    keys = torch.arange(seqlen_k, device=start.device)
    # A document is a run of keys with one end; it starts at the run's first key and ends
    # right after its last one.
    first = torch.ones_like(keys, dtype=torch.bool)
    first[1:] = end[1:] != end[:-1]
    last = torch.ones_like(first)
    last[:-1] = first[1:]
    document_start = torch.where(first, keys, 0).cummax(0).values
    fits = (end[last] == keys[last] + 1).all()
    causal_form = (start == keys).all()
    whole_form = (start == document_start).all()
    fits, causal_form, whole_form = torch.stack([fits, causal_form, whole_form]).tolist()
    if not fits or not (causal_form or whole_form):
        return None
    offsets = torch.cat([keys[first], keys.new_tensor([seqlen_k])]).to(torch.int32)
    # Both forms at once: every document is one key, seen by its one row either way.
    causal = bool(causal_form and not whole_form) or bool(is_causal)
    return offsets, offsets, causal
