"""Random cases behind ``dmbench equiv --random N``: a fuzz of the whole case space.

Each case draws every axis at once: batch, heads (MHA, GQA, MQA), query and key lengths from
awkward sizes (1, odd, one past a tile, Lq > Lk), head dims that are not powers of two, dtype,
causality, every mask kind in every format that can express it (bool, intervals, varlen), the
mask's broadcast shape, windows from 1 to past Lk, document mixes drawn or given (with documents
of length 0 and 1), and every bias kind or broadcast shape. A draw that no format can run is
drawn again. The same count and seed give the same cases, so a failing row is reproduced by its
``case_id`` (or by rerunning the same command); each case's own seed draws its tensors.

``large=False`` keeps cases small enough for the CPU interpreter; ``large=True`` draws GPU sizes
(lengths to 4095, 16 query heads).
"""

from __future__ import annotations

import random

from .irregular import ALL_SHAPES
from .case import (BIAS_KINDS, FORMAT_MASKS, FULL_MASK_SHAPE, WINDOW_MASKS, Case, case_problem,
                   format_problem)
from .sweep import Sweep, Timing

SMALL_LENGTHS = (1, 2, 5, 17, 33, 64, 65, 97)
LARGE_LENGTHS = (1, 17, 97, 255, 1025, 2049, 4095)
SMALL_HEADS = ((1, 1), (2, 2), (2, 1), (4, 2), (4, 1), (6, 3))
LARGE_HEADS = ((8, 8), (8, 2), (16, 4), (16, 1), (12, 3))
SMALL_HEAD_DIMS = (16, 40, 64, 80)
LARGE_HEAD_DIMS = (40, 64, 80, 96, 128, 192, 256)
# Most draws at 16 bits; fp32 is the accuracy path.
DTYPE_WEIGHTS = (("bf16", 4), ("fp16", 4), ("fp32", 1))
FORMAT_WEIGHTS = (("bool", 3), ("intervals", 2), ("varlen", 1))
MAX_DRAWS_PER_CASE = 100


def _weighted(rng: random.Random, pairs) -> str:
    values, weights = zip(*pairs)
    return rng.choices(values, weights=weights)[0]


def _documents(rng: random.Random, seqlen: int) -> tuple[int, ...]:
    """Explicit document lengths summing to ``seqlen``, with empty and one-token documents."""
    lengths, left = [], seqlen
    while left > 0:
        n = min(left, rng.choice((0, 1, 1, 2, max(1, seqlen // 3), rng.randint(1, left))))
        lengths.append(n)
        left -= n
    if rng.random() < 0.5:
        lengths.insert(rng.randrange(len(lengths) + 1), 0)
    return tuple(lengths)


def _draw(rng: random.Random, large: bool) -> Case:
    lengths = LARGE_LENGTHS if large else SMALL_LENGTHS
    heads_q, heads_kv = rng.choice(LARGE_HEADS if large else SMALL_HEADS)
    seqlen_q = rng.choice(lengths)
    seqlen_k = seqlen_q if rng.random() < 0.4 else rng.choice(lengths)
    # The format first, so that the interval and varlen paths get their share of the draws.
    mask_format = _weighted(rng, FORMAT_WEIGHTS)
    mask = rng.choice(FORMAT_MASKS[mask_format])
    documents = None
    window = None
    if mask == "document":
        seqlen_k = seqlen_q = max(seqlen_q, seqlen_k)
        if rng.random() < 0.5:
            documents = _documents(rng, seqlen_q)
    if mask in WINDOW_MASKS and documents is None:
        window = rng.randint(1, seqlen_k + 32)
    mask_shape = rng.choice(ALL_SHAPES) if mask in ("none", "random") else FULL_MASK_SHAPE
    if mask == "none":
        mask_shape = FULL_MASK_SHAPE
    bias = rng.choice(tuple(BIAS_KINDS) + tuple(rng.sample(ALL_SHAPES, 2)))
    if mask_format != "bool" and rng.random() < 0.6:
        bias = rng.choice(("none", "kv_row"))  # what topk intervals and varlen take most
    return Case(batch=rng.choice((1, 2)), heads_q=heads_q, heads_kv=heads_kv, seqlen_q=seqlen_q,
                seqlen_k=seqlen_k, head_dim=rng.choice(LARGE_HEAD_DIMS if large else SMALL_HEAD_DIMS),
                window=window, causal=rng.random() < 0.5, dtype=_weighted(rng, DTYPE_WEIGHTS),
                mask=mask, mask_shape=mask_shape, bias=bias, seed=rng.randrange(2**31),
                mask_format=mask_format, documents=documents)


def random_cases(count: int, seed: int, large: bool) -> tuple[Case, ...]:
    """``count`` distinct runnable cases drawn from ``seed`` (the same arguments, the same cases)."""
    rng = random.Random(seed)
    cases: list[Case] = []
    seen: set[str] = set()
    draws = 0
    while len(cases) < count:
        draws += 1
        if draws > MAX_DRAWS_PER_CASE * count:
            raise RuntimeError(f"drew {draws} cases for {count} runnable ones")  # a bug, not input
        case = _draw(rng, large)
        if case_problem(case) or format_problem(case) or case.case_id in seen:
            continue
        seen.add(case.case_id)
        cases.append(case)
    return tuple(cases)


def random_sweep(count: int, seed: int, large: bool, backends: tuple[str, ...]) -> Sweep:
    size = "GPU sizes" if large else "CPU sizes"
    return Sweep(name="random", path=f"<random suite: {count} cases, seed {seed}, {size}>",
                 backends=backends, timing=Timing(), check=True,
                 cases=random_cases(count, seed, large))
