"""Sequences packed end to end, as flash-attn's varlen layout describes them.

``cu_seqlens`` is a 1-D int32 tensor of n + 1 ascending offsets starting at 0: sequence ``s``
holds packed positions ``[cu_seqlens[s], cu_seqlens[s + 1])``. Sequences of length 0 are
allowed. Everything here runs on the tensors' device in O(total + n) torch ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.scratch import graph_capturing


def _check_offsets_tensor(name: str, cu: torch.Tensor) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} dtype must be torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must be 1-D with n + 1 >= 2 offsets, got shape "
                         f"{tuple(cu.shape)}")


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int | None, device,
                     max_seqlen: int | None = None) -> None:
    """Check dtype, shape and device, then the values: ``cu[0] == 0``, non-decreasing,
    ``cu[-1] == total`` (when given) and no sequence longer than ``max_seqlen`` (when given).
    The value checks read their verdicts back from the device together: one synchronization.
    While ``torch.compile`` traces a call or a CUDA graph captures one they are skipped (a
    read-back would break the graph, and a replay may see other values); dtype, shape and
    device are still checked."""
    _check_offsets_tensor(name, cu)
    if cu.device != torch.device(device):
        raise ValueError(f"{name} must be on {device}, got {cu.device}")
    if torch.compiler.is_compiling() or graph_capturing(cu.device):
        return
    lengths = cu[1:] - cu[:-1]
    true = torch.ones((), dtype=torch.bool, device=cu.device)
    ok = torch.stack([
        cu[0] == 0,
        (lengths >= 0).all(),
        true if total is None else cu[-1] == total,
        true if max_seqlen is None else lengths.max() <= max_seqlen,
    ]).cpu()
    if not ok[0]:
        raise ValueError(f"{name} must start at 0, got {int(cu[0])}")
    if not ok[1]:
        raise ValueError(f"{name} must be non-decreasing offsets, got {cu.tolist()}")
    if not ok[2]:
        raise ValueError(f"{name} must end at the packed length {total}, got {int(cu[-1])}")
    if not ok[3]:
        raise ValueError(f"{name}: a sequence is longer than max_seqlen={max_seqlen} "
                         f"(longest {int(lengths.max())})")


@dataclass(frozen=True)
class PackedKeys:
    """For every packed key position: its sequence, and its sequence's offsets and lengths.

    All tensors are int64 of shape (total_k,): ``seq`` the sequence index, ``local`` the index
    within the sequence, ``key_start`` = cu_seqlens_k[seq], ``seqlen_k`` and ``seqlen_q`` the
    sequence's key and query lengths, ``query_start`` = cu_seqlens_q[seq].
    """

    seq: torch.Tensor
    local: torch.Tensor
    key_start: torch.Tensor
    seqlen_k: torch.Tensor
    query_start: torch.Tensor
    seqlen_q: torch.Tensor

    @classmethod
    def single(cls, seqlen_q: int, seqlen_k: int, device) -> "PackedKeys":
        """One sequence of ``seqlen_k`` keys and ``seqlen_q`` queries: ``build`` of the offsets
        [0, seqlen_q] and [0, seqlen_k], made without copying them to the device (so a CUDA
        graph can capture it)."""
        local = torch.arange(seqlen_k, device=device)
        zeros = torch.zeros_like(local)
        return cls(seq=zeros, local=local, key_start=zeros,
                   seqlen_k=torch.full_like(local, seqlen_k), query_start=zeros,
                   seqlen_q=torch.full_like(local, seqlen_q))

    @classmethod
    def build(cls, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
              total_k: int) -> "PackedKeys":
        """From checked offsets (see :func:`check_cu_seqlens`)."""
        cu_k = cu_seqlens_k.to(torch.int64)
        cu_q = cu_seqlens_q.to(torch.int64)
        positions = torch.arange(total_k, device=cu_k.device)
        # A key at p belongs to the last sequence that starts at or before p; empty sequences
        # share their start with the next one, and right=True skips past them. The offsets
        # are searched as given (int32, starting at 0): torch 2.11's inductor cannot lower a
        # search in a slice of them (``NotImplementedError: SliceView``).
        seq = torch.searchsorted(cu_seqlens_k, positions.to(cu_seqlens_k.dtype), right=True) - 1
        key_start = cu_k[seq]
        query_start = cu_q[seq]
        return cls(seq=seq, local=positions - key_start, key_start=key_start,
                   seqlen_k=cu_k[seq + 1] - key_start, query_start=query_start,
                   seqlen_q=cu_q[seq + 1] - query_start)
