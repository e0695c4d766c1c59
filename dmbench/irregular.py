"""The built-in suite of hard shapes behind ``dmbench equiv --irregular``.

It covers: odd and unequal lengths (Lq > Lk gives rows that see nothing under causality),
Lq = 1 (with and without a mask or bias), Lk = 4095, D = 40/80/96/192/256, MHA/GQA/MQA, all 24 broadcast shapes of the mask and
of the bias, fully masked rows (every ``random`` mask with a query axis has them), window >= Lk,
every mask kind and all three dtypes; key-interval masks (topk from a bias and from its own
score, sliding, documents) with awkward Lk, empty intervals (keys topk never keeps, documents of
length 0), a key seen by a single row (a sliding window of 1, documents of length 1), GQA, MQA
and decode; decode under top-W masks that keep at most 1/8 of the keys (what ours reads
through its gather route without gradients); the varlen format with sequences of length 0 and 1
and packed totals that are not multiples of 16, and the same documents as bool and intervals.

``large=False`` keeps every case tiny so the whole suite runs in a few minutes under the CPU
interpreter; ``large=True`` scales lengths and heads to realistic GPU sizes.
"""

from __future__ import annotations

import itertools

from .case import AXIS_TOKENS, Case
from .sweep import Sweep, Timing

ALL_SHAPES = tuple("x".join(t) for t in itertools.product(*AXIS_TOKENS))
HEAD_DIMS = (40, 80, 96, 192, 256)
DTYPES = ("bf16", "fp16")


def _scaled(large: bool, small: int, big: int) -> int:
    return big if large else small


def irregular_cases(large: bool) -> tuple[Case, ...]:
    lq = _scaled(large, 17, 1025)
    lk = _scaled(large, 33, 2049)
    batch = 2
    gqa = (_scaled(large, 4, 16), _scaled(large, 2, 4))
    cases = []

    # Every mask shape and every bias shape, paired off so each appears once; causal and the
    # dtype alternate so both settings meet many shapes.
    for i, (mask_shape, bias_shape) in enumerate(zip(ALL_SHAPES, ALL_SHAPES[7:] + ALL_SHAPES[:7])):
        cases.append(Case(batch, *gqa, lq, lk, 40, None, i % 2 == 0, DTYPES[i % 2], "random",
                          mask_shape, bias_shape, i))

    # Lengths: decoding, 4095 keys, Lq > Lk (empty causal rows), a single key.
    long_k = _scaled(large, 4095, 65535)
    cases += [
        Case(1, 1, 1, 3, 4095, 16, 100, True, "bf16", "topk", bias="kv_row"),
        Case(1, 2, 1, 1, long_k, 64, None, False, "bf16", "none", bias="kv_row"),
        Case(batch, *gqa, 1, lk, 64, 16, True, "fp16", "sliding", bias="q_full"),
        Case(batch, *gqa, lk, lq, 64, None, True, "bf16", "none", bias="shared"),
        Case(batch, *gqa, lq, 1, 32, None, False, "fp16", "random", bias="kv_full"),
        Case(1, 2, 2, _scaled(large, 97, 4095), _scaled(large, 97, 4095), 80, None, True, "bf16",
             "none", bias="none"),
        # Decode without mask or bias: the packed backward, over many key shares, and with
        # three query rows per head of the group.
        Case(batch, *gqa, 1, long_k, 80, None, True, "bf16", "none", bias="none"),
        Case(batch, *gqa, 3, lk, 40, None, True, "fp16", "none", bias="none"),
    ]

    # Head dims that are not powers of two, and the largest one.
    for i, head_dim in enumerate(HEAD_DIMS):
        cases.append(Case(1, 2, 1, lq, lq, head_dim, 8, True, DTYPES[i % 2], "sliding",
                          bias="kv_full", seed=i))

    # MHA, GQA, MQA under topk and block_topk; windows at, below and beyond Lk.
    block_k = _scaled(large, 130, 4097)  # several 64-key blocks plus a tail
    heads_variants = ((2, 2), gqa, (gqa[0], 1))
    for i, (hq, hkv) in enumerate(heads_variants):
        cases.append(Case(1, hq, hkv, lq, block_k, 32, block_k // 3, i % 2 == 0, "bf16",
                          "block_topk", bias="kv_row", seed=i))
        cases.append(Case(1, hq, hkv, lq, lk, 32, lk + 31, True, "fp16", "topk", bias="q_full",
                          seed=i))
    cases += [
        Case(1, 2, 1, lq, lk, 64, lk, True, "bf16", "sliding", bias="none"),
        Case(1, 2, 1, lq, lk, 64, 5, False, "fp32", "topk", bias="kv_row"),
        Case(1, 2, 1, lq, lk, 64, None, True, "fp32", "random", bias="shared"),
    ]
    return tuple(cases) + interval_cases(large)


def interval_cases(large: bool) -> tuple[Case, ...]:
    """Key-interval and varlen cases (see the module docstring)."""
    lq = _scaled(large, 17, 1025)
    lk = _scaled(large, 33, 2049)
    gqa = (_scaled(large, 4, 16), _scaled(large, 2, 4))
    # One batch row of documents: empty ones, single tokens, and a length that is not a
    # multiple of 16 (the packed batch of two rows is not one either).
    documents = (0, 1, 5, 0, 17, 1, 13, 0) if not large else (0, 1, 2000, 0, 1, 1500, 595)
    doc_len = sum(documents)
    cases = [
        # topk from a per-key bias, a small window: most keys' intervals are empty.
        Case(2, *gqa, lq, lk, 40, 5, True, "bf16", "topk", bias="kv_row", seed=41,
             mask_format="intervals"),
        # topk from its own score, MQA, Lq > Lk (rows that see nothing under causality).
        Case(1, gqa[0], 1, lk, lq, 64, 3, True, "fp16", "topk", seed=42, mask_format="intervals"),
        # A sliding window of one key: key j is seen by row j alone. fp32: each dv is then the
        # sum of two query heads' dout, which lands on a bf16 rounding tie often, and the
        # reference gradient is rounded to the input dtype, so a 16-bit run is an ulp (0.031
        # at |dv| ~ 4, over the bf16 floor) from it wherever its probability is not exactly 1.
        Case(1, 2, 1, lq, lq, 32, 1, True, "fp32", "sliding", bias="kv_row", seed=43,
             mask_format="intervals"),
        # Without causality: the last `window` keys seen by every row, the others by none.
        Case(1, 2, 1, lq, lk, 40, 9, False, "fp32", "sliding", seed=44, mask_format="intervals"),
        # Decode against intervals.
        Case(2, *gqa, 1, lk, 64, 7, True, "bf16", "topk", bias="kv_row", seed=45,
             mask_format="intervals"),
    ]
    # Head dims below their padded size, which take their own forward tiles with intervals.
    window = _scaled(large, 9, 300)
    for i, head_dim in enumerate((80, 192)):
        cases.append(Case(1, *gqa, lq, lk, head_dim, window, True, DTYPES[i], "topk",
                          bias="kv_row", seed=48 + i, mask_format="intervals"))
    # Decode under a top-W of a per-key bias that keeps at most 1/8 of the keys: without
    # gradients ours reads only the kept keys (the gather route), which the inference pass of
    # every check runs. Intervals and a bool mask, GQA and MQA, an odd Lk, 1, 4 and 16 rows.
    gather_k = _scaled(large, 203, 32771)
    cases += [
        Case(2, *gqa, 1, gather_k, 40, gather_k // 16, True, "bf16", "topk", bias="kv_row",
             seed=50, mask_format="intervals"),
        Case(2, gqa[0], 1, 4, gather_k, 256, gather_k // 20, True, "fp16", "topk",
             bias="kv_row", seed=51, mask_format="intervals"),
        Case(1, *gqa, 16, gather_k, 80, gather_k // 64, False, "bf16", "topk", bias="kv_row",
             seed=52),
    ]
    for fmt in ("bool", "intervals", "varlen"):
        cases.append(Case(2, *gqa, doc_len, doc_len, 40, None, True, "bf16", "document",
                          bias="kv_row", seed=46, mask_format=fmt, documents=documents))
    # Drawn documents, bidirectional, MQA, no bias.
    cases.append(Case(1, 2, 1, lk, lk, 64, 16, False, "fp16", "document", seed=47,
                      mask_format="varlen"))
    return tuple(cases)


def irregular_sweep(large: bool, backends: tuple[str, ...]) -> Sweep:
    size = "GPU sizes" if large else "CPU sizes"
    return Sweep(name="irregular", path=f"<built-in irregular suite, {size}>", backends=backends,
                 timing=Timing(), check=True, cases=irregular_cases(large))
