"""``dmbench compile-cost``: what the first call at a new sequence length costs.

For each call form (mask kind, bias kind), one forward and backward at each of the given
lengths, in order, in one process: the first call's latency (host time until the call returns,
and wall time to the end of its GPU work), the second call's wall time at the same length, and
how many kernels the first call compiled: ``compiled`` counts the kernel forms the launches
needed that no earlier call had (``kernels.compiled_forms``, also under the interpreter), and
``triton_compiled`` the entries Triton's caches gained (GPU only). With ``--warmup``,
``kernels.warmup`` runs first at the shortest and longest length and is a row of its own
(``warmup_workers``: the threads it compiled with on a GPU). With ``window``, the interval
form is a top-W model's (Doge's): its masks are ``topk_intervals`` of a random per-key bias
(B, Hk, 1, L) with that window, key-ordered from the ordering threshold on, the warm-up gets
the same window (``kernels.warmup(window=...)``), and its rows' ``mask`` reads ``topk<W>``.
With ``query_rows`` the calls are decode steps: that many query rows against caches of the
given lengths, forward only (the warm-up makes the same calls: ``kernels.warmup(query_rows=
...)``); a row's ``seqlen`` is then the cache's length and ``query_rows`` says so.
"""

from __future__ import annotations

import csv
import importlib
import pkgutil
import time
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from .envinfo import collect, gpu_slug
from .errors import ConfigError, ExitCode
from .problem import TORCH_DTYPES
from .results import csv_cell

MASKS = ("none", "bool", "intervals", "documents")
MAX_QUERY_ROWS = 16  # decode's gather route takes up to this many (kernels' GATHER_MAX_ROWS)
BIASES = ("none", "kv_row")
# 20 lengths from 1000 to 8000: a mix of multiples of 16 and not, as dynamic padding makes.
DEFAULT_LENGTHS = (1000, 1001, 1024, 1500, 2049, 3000, 1100, 1337, 2048, 2500, 3333, 4000,
                   4096, 4500, 5000, 5555, 6000, 7000, 7777, 8000)


@dataclass(frozen=True)
class CostOptions:
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    masks: tuple[str, ...] = ("bool", "intervals")
    bias: str = "kv_row"
    batch: int = 1
    heads_q: int = 16
    heads_kv: int = 4
    head_dim: int = 128
    dtype: str = "bf16"
    causal: bool = True
    warmup: bool = False
    warmup_workers: int | None = None  # kernels.warmup's default
    window: int | None = None  # the interval form as topk_intervals with this window
    query_rows: int | None = None  # decode steps of this many query rows, forward only
    require_zero: bool = False
    device: str = "auto"
    out: Path | None = None
    force: bool = False


@dataclass
class CostRow:
    mask: str
    bias: str
    step: str  # "warmup", or "call" (the first call at this length)
    seqlen: int
    query_rows: int | None  # decode calls' query rows (seqlen: the cache); None: seqlen rows
    first_host_ms: float | None
    first_ms: float
    second_ms: float | None
    compiled: int
    triton_compiled: int | None
    warmup_workers: int | None  # warm-up rows: the threads that compiled
    batch: int
    heads: str
    head_dim: int
    dtype: str
    causal: bool
    gpu: str
    torch: str
    triton: str
    git_sha: str
    git_dirty: bool
    timestamp: str


COLUMNS = tuple(f.name for f in fields(CostRow))


def parse_lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"--lengths: expected comma-separated positive integers, got {text!r}")
    if not lengths or min(lengths) < 1:
        raise ConfigError(f"--lengths: expected comma-separated positive integers, got {text!r}")
    return lengths


def triton_cache_entries() -> int | None:
    """Compiled kernels in Triton's caches of this package's kernels (None without a GPU)."""
    import kernels

    if not torch.cuda.is_available():
        return None
    total, seen = 0, set()
    for info in pkgutil.walk_packages(kernels.__path__, prefix="kernels."):
        if info.name.startswith("kernels.integrations"):  # no kernels; needs transformers
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            caches = getattr(value, "device_caches", None)
            if caches is None or id(value) in seen:
                continue
            seen.add(id(value))
            total += sum(len(entry[0]) for entry in caches.values())
    return total


def form_window(opts: CostOptions, mask: str) -> int | None:
    """The top-W window of ``mask``'s calls: ``opts.window`` for the interval form."""
    return opts.window if mask == "intervals" else None


def form_name(opts: CostOptions, mask: str) -> str:
    """The ``mask`` cell of a form's rows: ``topk<W>`` for intervals with a window."""
    window = form_window(opts, mask)
    return mask if window is None else f"topk{window}"


class _Call:
    """One forward and backward (a decode step: the forward alone) of a form at a length, on
    fresh random inputs: those of ``kernels.warmup``'s scattered call (a bool mask keeping half
    the pairs, or intervals of half the length, or with a window the top-W intervals of a
    random per-key bias; packed documents: two calls with the same new offsets, as a model's
    first two layers make)."""

    def __init__(self, opts: CostOptions, mask: str, device: torch.device):
        self.opts, self.mask, self.device = opts, mask, device

    def inputs(self, seqlen: int):
        from kernels.warmup_forms import form_inputs

        o = self.opts
        return form_inputs(o.batch, seqlen, o.heads_q, o.heads_kv, o.head_dim,
                           TORCH_DTYPES[o.dtype], self.device, self.mask, o.bias,
                           backward=o.query_rows is None, scattered=True,
                           window=form_window(o, self.mask), is_causal=o.causal,
                           query_rows=o.query_rows)

    def timed(self, seqlen: int) -> tuple[float, float]:
        """(host ms until the backward returns, wall ms to the end of the GPU work)."""
        from kernels.warmup_forms import form_call, form_calls

        q, k, v, attn_mask, bias = self.inputs(seqlen)
        self._sync()
        start = time.perf_counter()
        decode = self.opts.query_rows is not None
        for _ in range(form_calls(self.mask)):
            with torch.set_grad_enabled(not decode):
                out = form_call(q, k, v, attn_mask, bias, self.opts.causal)
            if not decode:
                out.backward(torch.ones_like(out))
        host = time.perf_counter() - start
        self._sync()
        return host * 1e3, (time.perf_counter() - start) * 1e3

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def run_compile_cost(opts: CostOptions, echo: Callable[[str], None]) -> ExitCode:
    from .device import select_device

    device = select_device(opts.device)  # before kernels is imported: it sets the interpreter
    import kernels

    env = collect(device)
    out = opts.out or Path("results") / gpu_slug(env.gpu) / "compile-cost.csv"
    if out.exists() and not opts.force:
        raise ConfigError(f"--out: {out} exists; pass --force to overwrite it")
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    common = dict(bias=opts.bias, batch=opts.batch, heads=f"{opts.heads_q}/{opts.heads_kv}",
                  head_dim=opts.head_dim, dtype=opts.dtype, causal=opts.causal, gpu=env.gpu,
                  torch=env.torch, triton=env.triton, git_sha=env.git_sha,
                  git_dirty=env.git_dirty, timestamp=stamp)
    rows: list[CostRow] = []
    compiled_after_warmup = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()

        def emit(row: CostRow):
            rows.append(row)
            writer.writerow({k: csv_cell(v) for k, v in asdict(row).items()})
            handle.flush()
            echo(f"{row.mask:>9} {row.step:>6} L{row.seqlen:<6} first {row.first_ms:9.1f} ms"
                 + ("" if row.second_ms is None else f", second {row.second_ms:7.2f} ms")
                 + f", compiled {row.compiled}"
                 + ("" if row.triton_compiled is None else f" (triton {row.triton_compiled})"))

        for mask in opts.masks:
            call, name = _Call(opts, mask, device), form_name(opts, mask)
            if opts.warmup:
                before = _counts()
                report = kernels.warmup(
                    seqlens=[min(opts.lengths), max(opts.lengths)], heads_q=opts.heads_q,
                    heads_kv=opts.heads_kv, head_dim=opts.head_dim, batch=opts.batch,
                    dtype=TORCH_DTYPES[opts.dtype], device=device, mask=mask, bias=opts.bias,
                    is_causal=opts.causal, workers=opts.warmup_workers,
                    window=form_window(opts, mask), query_rows=opts.query_rows)
                compiled, triton_compiled = _since(before)
                emit(CostRow(mask=name, step="warmup", seqlen=max(report.seqlens),
                             query_rows=opts.query_rows,
                             first_host_ms=None, first_ms=report.seconds * 1e3, second_ms=None,
                             compiled=compiled, triton_compiled=triton_compiled,
                             warmup_workers=report.workers, **common))
            for index, seqlen in enumerate(opts.lengths):
                before = _counts()
                host_ms, first_ms = call.timed(seqlen)
                compiled, triton_compiled = _since(before)
                _, second_ms = call.timed(seqlen)
                if opts.warmup or index > 0:
                    compiled_after_warmup += compiled + (triton_compiled or 0)
                emit(CostRow(mask=name, step="call", seqlen=seqlen, query_rows=opts.query_rows,
                             first_host_ms=host_ms,
                             first_ms=first_ms, second_ms=second_ms, compiled=compiled,
                             triton_compiled=triton_compiled, warmup_workers=None, **common))
    echo(f"wrote {len(rows)} rows to {out}")
    if opts.require_zero and compiled_after_warmup:
        echo(f"--require-zero: calls at new lengths compiled {compiled_after_warmup} kernels "
             f"after the {'warm-up' if opts.warmup else 'first call'}")
        return ExitCode.PERF_REGRESSION
    return ExitCode.OK


def _counts() -> tuple[int, int | None]:
    """(kernel forms compiled so far, Triton cache entries or None without a GPU)."""
    import kernels

    return kernels.compiled_forms(), triton_cache_entries()


def _since(before: tuple[int, int | None]) -> tuple[int, int | None]:
    """What ``_counts`` gained since ``before``."""
    forms, entries = _counts()
    return forms - before[0], None if entries is None else entries - before[1]
