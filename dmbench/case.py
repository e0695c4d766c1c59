"""One benchmark problem (``Case``), the values its keys may take, and what it can express.

``mask_format`` says how the mask reaches the backends that take it natively: ``bool`` a dense
(B, Hk, Lq, Lk) mask; ``intervals`` a ``kernels.KeyIntervals`` (topk with a kv_row bias or its
own per-key score, sliding, document); ``varlen`` the packed layout of the documents (document
only; the bias per key or none). ``format_problem`` says why any other combination cannot be.

Shapes of masks and biases are written as four axis tokens joined by ``x``: batch ``1``/``B``,
heads ``1``/``Hk``/``Hq``, query ``1``/``Lq``, key ``1``/``Lk``; for example ``1xHqxLqx1``.

A pair of counts is written ``A/B`` (heads ``16/4``: query/kv; seqlen ``1/65536``: q/k);
``parse_pair`` reads that form wherever it is written (sweep files, command options).

Cases are built by ``dmbench.sweep`` (from YAML), ``dmbench.irregular`` and
``dmbench.random_suite``; a results row holds one case per line (``dmbench.results``).
"""

from __future__ import annotations

from dataclasses import dataclass

MASK_KINDS = ("none", "topk", "block_topk", "block_sparse", "sliding", "random", "document")
# Masks whose generation reads ``window`` (for document: the longest drawn document).
WINDOW_MASKS = ("topk", "block_topk", "block_sparse", "sliding", "document")
MASK_FORMATS = ("bool", "intervals", "varlen")
# The mask kinds each format can express (topk only with a per-key score, see format_problem).
FORMAT_MASKS = {"bool": MASK_KINDS, "intervals": ("topk", "sliding", "document"),
                "varlen": ("document",)}
BIAS_KINDS = {
    "none": None,
    "kv_row": "BxHkx1xLk",
    "kv_full": "BxHkxLqxLk",
    "q_full": "BxHqxLqxLk",
    "shared": "1x1xLqxLk",
}
FULL_MASK_SHAPE = "BxHkxLqxLk"
AXIS_TOKENS = (("1", "B"), ("1", "Hk", "Hq"), ("1", "Lq"), ("1", "Lk"))


@dataclass(frozen=True)
class Case:
    """One problem. Query is (batch, seqlen_q, heads_q, head_dim); key/value use heads_kv.

    Each field is also a column of the results CSV (``dmbench.results.CASE_COLUMNS``). The field
    order is part of the positional constructor and of ``repr``, which ``sweep_digest`` hashes:
    add a field at the end, with a default."""

    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    window: int | None = None
    causal: bool = False
    dtype: str = "bf16"
    mask: str = "none"
    mask_shape: str = FULL_MASK_SHAPE
    bias: str = "none"
    seed: int = 0
    mask_format: str = "bool"
    documents: tuple[int, ...] | None = None  # explicit document lengths of every batch row

    @property
    def bias_shape(self) -> str | None:
        """The bias shape in axis tokens, or None for no bias."""
        return BIAS_KINDS.get(self.bias, self.bias)

    @property
    def case_id(self) -> str:
        """A stable, readable key: the same parameters always give the same id."""
        window = "-" if self.window is None else self.window
        mask = self.mask if self.mask_shape == FULL_MASK_SHAPE else f"{self.mask}[{self.mask_shape}]"
        if self.documents is not None:
            mask += f"[{self.documents_text}]"
        if self.mask_format != "bool":
            mask += f":{self.mask_format}"
        return (f"B{self.batch}-H{self.heads_q}/{self.heads_kv}-Lq{self.seqlen_q}-"
                f"Lk{self.seqlen_k}-D{self.head_dim}-W{window}-"
                f"{'causal' if self.causal else 'full'}-{self.dtype}-{mask}-{self.bias}-s{self.seed}")

    @property
    def documents_text(self) -> str:
        """The explicit document lengths as written in the CSV ("0,1,5"), or ""."""
        return "" if self.documents is None else ",".join(map(str, self.documents))


def documents_from_text(text: str) -> tuple[int, ...] | None:
    """The inverse of ``Case.documents_text``: "0,1,5" -> (0, 1, 5), "" -> None."""
    return tuple(int(n) for n in text.split(",")) if text else None


def parse_pair(text: str) -> tuple[int, int] | None:
    """``"16/4"`` -> ``(16, 4)``: two unsigned integers joined by ``/`` (white space around each
    allowed), or None for any other text. Every parse of the ``A/B`` form goes through here;
    the caller checks the range and words its own error."""
    parts = text.split("/")
    if len(parts) != 2 or not all(p.strip().isdecimal() for p in parts):
        return None
    first, second = (int(p) for p in parts)
    return first, second


def shape_from_tokens(tokens: str, case: Case) -> tuple[int, int, int, int]:
    """The sizes of a shape written in axis tokens (``BxHkx1xLk``) for ``case``."""
    sizes = {"1": 1, "B": case.batch, "Hk": case.heads_kv, "Hq": case.heads_q,
             "Lq": case.seqlen_q, "Lk": case.seqlen_k}
    return tuple(sizes[t] for t in tokens.split("x"))


def per_key_bias(case: Case) -> bool:
    """Whether the case's bias is none or has no query axis (one value per key at most)."""
    shape = case.bias_shape
    return shape is None or shape.split("x")[2] == "1"


def format_problem(case: Case) -> str | None:
    """Why ``case.mask_format`` cannot express the case's mask, or None."""
    fmt = case.mask_format
    if case.mask not in FORMAT_MASKS[fmt]:
        return (f"mask_format {fmt} expresses masks {', '.join(FORMAT_MASKS[fmt])}, "
                f"got mask {case.mask}")
    if fmt == "intervals" and case.mask == "topk" and case.bias_shape not in (None, "BxHkx1xLk"):
        return ("mask_format intervals takes topk from a per-key score: bias kv_row (or none, "
                f"a score of its own), got bias {case.bias}")
    if fmt == "varlen" and not per_key_bias(case):
        return f"mask_format varlen takes a bias per key (no query axis) or none, got bias {case.bias}"
    return None


def heads_problem(heads_q: int, heads_kv: int) -> str | None:
    """Why query/kv head counts (both positive) cannot run, or None: the one statement of the
    GQA rule for the harness (sweep files, skipped grid points, ``compile-cost --heads``)."""
    if heads_q % heads_kv:
        return f"heads q ({heads_q}) must be a multiple of kv ({heads_kv})"
    return None


def case_problem(case: Case) -> str | None:
    """Why this combination cannot run at all, or None. Backend limits live in the backends."""
    heads = heads_problem(case.heads_q, case.heads_kv)
    if heads:
        return heads
    if case.mask in WINDOW_MASKS and case.window is None and case.documents is None:
        needs = "a window (the longest document) or documents" if case.mask == "document" else "a window"
        return f"mask {case.mask} needs {needs}"
    if case.mask == "document":
        if case.seqlen_q != case.seqlen_k:
            return (f"mask document packs documents along one sequence: seqlen q and k must be "
                    f"equal, got {case.seqlen_q} and {case.seqlen_k}")
        if case.documents is not None and sum(case.documents) != case.seqlen_k:
            return (f"documents {list(case.documents)} sum to {sum(case.documents)}; each batch "
                    f"row holds seqlen {case.seqlen_k}")
    if case.mask not in ("none", "random") and case.mask_shape != FULL_MASK_SHAPE:
        return f"mask {case.mask} is generated per (batch, KV head, row); mask_shape must be {FULL_MASK_SHAPE}"
    if case.mask == "none" and case.mask_shape != FULL_MASK_SHAPE:
        return "mask_shape needs a mask"
    return None
