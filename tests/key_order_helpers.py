"""Inputs of the key-order tests (``test_key_order``, ``test_key_order_reads``): a selection
bias for ``topk_intervals`` and an attention bias named by its axes."""

from __future__ import annotations

import torch


def selection(dims, heads, device, seed=0):
    """A (B, heads, 1, Lk) selection bias; ``heads`` is "1", "Hk" or "Hq"."""
    count = {"1": 1, "Hk": dims.heads_kv, "Hq": dims.heads_q}[heads]
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(dims.batch, count, 1, dims.seqlen_k, generator=generator).to(device)


def axes_bias(dims, axes, dtype, device):
    """An attention bias of the shape ``axes`` names ("1", "B", "Hk", "Hq", "Lq", "Lk"),
    requiring a gradient."""
    sizes = {"1": 1, "B": dims.batch, "Hk": dims.heads_kv, "Hq": dims.heads_q,
             "Lq": dims.seqlen_q, "Lk": dims.seqlen_k}
    generator = torch.Generator().manual_seed(7)
    bias = torch.randn([sizes[a] for a in axes], generator=generator)
    return bias.to(device=device, dtype=dtype).requires_grad_()
