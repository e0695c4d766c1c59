"""Inputs for one case, generated on the target device from the case's seed: q, k, v, the bias
(its shape from ``case.BIAS_KINDS``) and the mask in the case's format (``dmbench.masks``).

The mask's build from its random draws can be timed (``time_build``): ``mask_build`` is the
wall time of one build after a warm-up one, which every backend that takes the mask counts in
its ``build_ms``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .case import Case, shape_from_tokens
from .documents import Documents, PackedLayout
from .mask_views import kept_pairs
from .masks import draw_source, mask_builder
from .timing import BuildStep, timed_build

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

__all__ = ["Problem", "TORCH_DTYPES", "make_problem", "shape_from_tokens"]


@dataclass
class Problem:
    """Canonical-layout inputs: q (B, Lq, Hq, D), k/v (B, Lk, Hk, D), mask, bias.

    ``mask`` is a bool tensor, ``kernels.KeyIntervals`` or None: the case's mask in its format,
    and for ``varlen`` the documents' intervals (what the reference and the backends that do
    not take the packed layout read). ``documents`` and ``packed`` belong to document masks
    (``packed`` to the varlen format only)."""

    case: Case
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: object
    bias: torch.Tensor | None
    kept_pairs: int  # kept (batch, query head, i, j) entries after mask and causality
    documents: Documents | None = None
    packed: PackedLayout | None = None
    mask_build: BuildStep | None = None

    @property
    def active_fraction(self) -> float:
        c = self.case
        return self.kept_pairs / (c.batch * c.heads_q * c.seqlen_q * c.seqlen_k)


def make_problem(case: Case, device: torch.device, requires_grad: bool = False,
                 time_build: bool = False) -> Problem:
    """Generate q, k, v, bias and mask for ``case`` on ``device`` from ``case.seed``.

    With ``requires_grad`` the q, k, v and bias tensors are leaves that require grad. With
    ``time_build`` the mask is built twice and the second build timed (``mask_build``).
    """
    dtype = TORCH_DTYPES[case.dtype]
    gen = torch.Generator(device=device)
    gen.manual_seed(case.seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    q = randn(case.batch, case.seqlen_q, case.heads_q, case.head_dim)
    k = randn(case.batch, case.seqlen_k, case.heads_kv, case.head_dim)
    v = randn(case.batch, case.seqlen_k, case.heads_kv, case.head_dim)
    bias = randn(*shape_from_tokens(case.bias_shape, case)) if case.bias_shape else None
    source = draw_source(case, bias, gen, device)
    builder = mask_builder(case, source, device)
    build = None
    if builder is None:
        built = source.mask
    elif time_build:
        built, build = timed_build(builder.build, device, builder.name)
    else:
        built = builder.build()
    mask, packed = built, None
    if isinstance(built, PackedLayout):
        mask, packed = source.documents.intervals(case.causal, device), built
    if requires_grad:
        for t in (q, k, v, bias):
            if t is not None:
                t.requires_grad_(True)
    return Problem(case, q, k, v, mask, bias, kept_pairs(case, mask), source.documents, packed,
                   build)
