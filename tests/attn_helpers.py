"""Building blocks shared by the kernel tests: problem sizes, random operands and the checks.

Every accuracy verdict goes through ``kernels.tolerance.check_tensor``, the project's one accuracy
rule, against the float64 reference. What this module adds is what that rule cannot see:

* rows that see no key must give output exactly 0 and LSE exactly -inf;
* every other output element must be finite;
* outputs must be fully written: fresh allocations made during a call are filled with NaN
  (``AllocationWatch``), so an element the kernel forgot to store shows up as NaN;
* the mask and bias are never copied, and tests can bound the largest allocation
  (``AllocationWatch``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kernels import (KeyIntervals, PreparedMask, attention_reference, dmattn_func,
                     schedule_for)
from kernels.planning.inputs import AttnShape
from kernels.tolerance import check_tensor

# The dtypes the kernels accept. Each one's tolerance travels with it inside
# kernels.tolerance (ATOL_FLOOR[dtype] plus twice the eager run's own error in that dtype).
DTYPES = (
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float32, id="fp32"),
)


@dataclass(frozen=True)
class Dims(AttnShape):
    """The kernels' problem sizes, plus the shapes of masks and biases broadcast over them."""

    def operand_shape(self, batch: str, heads: str, rows: str, cols: str) -> tuple[int, ...]:
        """Shape of a mask or bias from symbolic axis sizes, e.g. ("1", "Hk", "Lq", "Lk")."""
        sizes = {"1": 1, "B": self.batch, "Hk": self.heads_kv, "Hq": self.heads_q,
                 "Lq": self.seqlen_q, "Lk": self.seqlen_k}
        return sizes[batch], sizes[heads], sizes[rows], sizes[cols]

    def full_operand_shape(self, heads: str = "Hq") -> tuple[int, ...]:
        return self.operand_shape("B", heads, "Lq", "Lk")


# -- grids shared by the kernel test modules
CAUSAL = (pytest.param(False, id="full"), pytest.param(True, id="causal"))
# With a mask the kernels walk active-tile lists; without one, full and causal-diagonal tiles.
MASKED = (pytest.param(False, id="no_mask"), pytest.param(True, id="mask"))
LONG_SEQLEN_K = 4095
HEAD_DIMS = (16, 40, 80, 128, 256)
HEADS = (  # (heads_q, heads_kv)
    pytest.param((4, 4), id="mha"),
    pytest.param((6, 2), id="gqa"),
    pytest.param((4, 1), id="mqa"),
)
# Each axis of a mask or bias is one of these sizes (the broadcast rule), named symbolically.
BROADCAST_BATCH = ("1", "B")
BROADCAST_HEADS = ("1", "Hk", "Hq")
BROADCAST_ROWS = ("1", "Lq")
BROADCAST_COLS = ("1", "Lk")
# A real tensor of the broadcast shape, or a stride-0 expand() of it to full size.
OPERAND_FORMS = ("tensor", "expanded")
QKV_LAYOUTS = ("bhld", "sliced", "strided")
BROADCAST_DIMS = Dims(batch=2, seqlen_q=17, seqlen_k=33, heads_q=4, heads_kv=2, head_dim=16)


def _blhd(shape, dtype, device, layout: str) -> torch.Tensor:
    """A random (B, L, H, D) tensor whose memory layout is ``layout``:

    * ``contiguous``: plain (B, L, H, D);
    * ``bhld``: allocated as (B, H, L, D) and transposed, the usual non-contiguous input;
    * ``sliced``: the first D columns of a wider head dim (odd head stride, unit last stride);
    * ``strided``: every other element of the last axis (last stride 2).
    """
    b, l, h, d = shape
    if layout == "contiguous":
        return torch.randn(b, l, h, d, dtype=dtype, device=device)
    if layout == "bhld":
        return torch.randn(b, h, l, d, dtype=dtype, device=device).transpose(1, 2)
    if layout == "sliced":
        return torch.randn(b, l, h, d + 3, dtype=dtype, device=device)[..., :d]
    if layout == "strided":
        return torch.randn(b, l, h, 2 * d, dtype=dtype, device=device)[..., ::2]
    raise ValueError(f"unknown layout {layout!r}")


def random_qkv(dims: Dims, dtype, device, layout: str = "contiguous"):
    q = _blhd((dims.batch, dims.seqlen_q, dims.heads_q, dims.head_dim), dtype, device, layout)
    k = _blhd((dims.batch, dims.seqlen_k, dims.heads_kv, dims.head_dim), dtype, device, layout)
    v = _blhd((dims.batch, dims.seqlen_k, dims.heads_kv, dims.head_dim), dtype, device, layout)
    return q, k, v


def random_mask(shape, device, keep: float = 0.7) -> torch.Tensor:
    """Random bool mask (True = keep) whose first element is kept, so that a fully broadcast
    (1, 1, 1, 1) mask is not trivially empty."""
    mask = torch.rand(shape, device=device) < keep
    mask.view(-1)[0] = True
    return mask


def random_bias(shape, dtype, device) -> torch.Tensor:
    return (2.0 * torch.randn(shape, device=device)).to(dtype)


# Keys 128..255 of ``masked_band_problem`` are masked for every query row, so any tile up to
# 128 keys wide sees only False there (such a tile does no K/V loads).
MASKED_BAND = slice(128, 256)


def masked_band_problem(dtype, device):
    """q, k, v and a (1, 1, Lq, Lk) random mask whose keys in MASKED_BAND are all masked."""
    dims = Dims(1, 40, 384, heads_q=2, heads_kv=1, head_dim=16)
    q, k, v = random_qkv(dims, dtype, device)
    mask = random_mask(dims.operand_shape("1", "1", "Lq", "Lk"), device)
    mask[..., MASKED_BAND] = False
    return q, k, v, mask


def nan_in_band(t: torch.Tensor, keys=MASKED_BAND) -> torch.Tensor:
    """A copy of a (B, L, H, D) key or value with NaN at ``keys`` (an index along L, by default
    MASKED_BAND): a kernel that loads them, or multiplies them by a zero probability, produces
    NaN."""
    poisoned = t.clone()
    poisoned[:, keys] = math.nan
    return poisoned


def assert_forward_skips_masked_band(device, as_mask=lambda mask, q, k: mask) -> None:
    """With NaN keys and values in MASKED_BAND, out and LSE stay finite and equal a clean run's.
    ``as_mask(mask, q, k)`` is what the poisoned call passes as attn_mask (a prepared mask)."""
    q, k, v, mask = masked_band_problem(torch.float16, device)
    out, lse = dmattn_func(q, nan_in_band(k), nan_in_band(v), as_mask(mask, q, k),
                           return_lse=True)
    ref_out, ref_lse = dmattn_func(q, k, v, mask, return_lse=True)
    assert torch.isfinite(out).all()
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def random_problem(dims: Dims, dtype, device, mask: str, bias: str, keep: float = 0.7):
    """q, k, v, a mask and a bias, the last two shaped by axis tokens joined by ``x`` as in
    sweep files: batch ``1``/``B``, heads ``1``/``Hk``/``Hq``, query ``1``/``Lq``, key
    ``1``/``Lk`` (e.g. ``"BxHkx1xLk"``). Drawn in that order, so seeded runs repeat."""
    q, k, v = random_qkv(dims, dtype, device)
    mask_t = random_mask(dims.operand_shape(*mask.split("x")), device, keep=keep)
    bias_t = random_bias(dims.operand_shape(*bias.split("x")), dtype, device)
    return q, k, v, mask_t, bias_t


def expand_operand(t: torch.Tensor, dims: Dims) -> torch.Tensor:
    """A stride-0 view of a mask or bias with every size-1 axis expanded to full size.
    A head axis of size 1 expands to heads_q; a head axis of size heads_kv stays as it is."""
    heads = dims.heads_q if t.shape[1] == 1 else t.shape[1]
    return t.expand(dims.batch, heads, dims.seqlen_q, dims.seqlen_k)


def in_form(t: torch.Tensor, dims: Dims, form: str) -> torch.Tensor:
    """``tensor``: the broadcast-shaped tensor itself; ``expanded``: its stride-0 full view."""
    if form == "tensor":
        return t
    if form == "expanded":
        return expand_operand(t, dims)
    raise ValueError(f"unknown operand form {form!r}")


class AllocationWatch(TorchDispatchMode):
    """Sees every torch op run while it is active (kernel launchers, autograd, interpreter).

    * Poisons fresh ``empty*`` allocations with NaN (floats) or all-ones bits (integers and
      bools), so any output element the kernels leave unwritten is caught by the checks.
    * Records the shape and size in bytes of every fresh storage an op returns (views,
      in-place ops and storage aliases of an input are not fresh), so that a test can look for
      (Lq, Lk)-shaped temporaries and bound the largest allocation. It sees torch allocations
      only; the interpreter's per-tile numpy scratch is invisible, and bounded by the tiles.
    * Records every op that reads one of the ``watched`` tensors (the mask and the bias) and
      returns fresh storage: a copy, pad, cast, expansion or gather of them. A gather of no
      more elements than the tensor holds (a bias read in a mask's key order,
      ``kernels.masks.key_order``) is a reordering, recorded apart in ``reorders``.
    """

    _EMPTY_OPS = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")

    def __init__(self, watched=()):
        super().__init__()
        self.fresh: list[tuple[str, tuple[int, ...], int]] = []
        self.copies: list[str] = []
        self.reorders: list[str] = []
        self._watched = {t.untyped_storage().data_ptr() for t in watched
                         if isinstance(t, torch.Tensor)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr()
                  for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(result):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in inputs:
                continue
            self.fresh.append((str(func), tuple(t.shape), storage.nbytes()))
            if inputs & self._watched:
                source = args[0] if args and isinstance(args[0], torch.Tensor) else None
                reorder = (func.overloadpacket.__name__ == "gather" and source is not None
                           and t.numel() <= source.numel())
                (self.reorders if reorder else self.copies).append(f"{func} -> {tuple(t.shape)}")
            if func.overloadpacket.__name__ in self._EMPTY_OPS:
                _poison(t)
        return result

    def largest_fresh_bytes(self) -> int:
        return max((n for _, _, n in self.fresh), default=0)

    def spanning(self, seqlen_q: int, seqlen_k: int) -> list[str]:
        """Fresh tensors with both a seqlen_q and a seqlen_k axis: score-shaped temporaries."""
        return [f"{op} {shape}" for op, shape, _ in self.fresh
                if seqlen_q in shape and seqlen_k in shape]

    def describe(self) -> str:
        largest = sorted(self.fresh, key=lambda x: -x[2])[:8]
        return ", ".join(f"{op} {shape}: {n} B" for op, shape, n in largest)


def assert_no_lq_lk_allocation(watch: AllocationWatch, dims: Dims) -> None:
    """No (Lq, Lk)-shaped temporary (a score or probability matrix, an expanded mask or bias, a
    full bias-gradient buffer), and no allocation of two bytes per score of the whole problem
    (a flattened fp16 score matrix). Legitimate buffers stay well below that when Lk is several
    times D: outputs, LSE, tile lists, fp32 accumulators of a gradient's size, and split-K
    partials (at most Lk / (4 BLOCK_N) splits of BLOCK_D fp32 values per row)."""
    spanning = watch.spanning(dims.seqlen_q, dims.seqlen_k)
    assert not spanning, f"(Lq, Lk)-shaped temporaries: {spanning}"
    limit = 2 * dims.batch * dims.heads_q * dims.seqlen_q * dims.seqlen_k
    assert watch.largest_fresh_bytes() < limit, f"largest allocations: {watch.describe()}"


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(math.nan)
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(-1)


@dataclass
class ForwardRun:
    out: torch.Tensor
    lse: torch.Tensor
    ref_out: torch.Tensor
    ref_lse: torch.Tensor
    watch: AllocationWatch


def assert_empty_rows_and_finite(out, lse, ref_lse) -> None:
    """Rows the reference leaves empty (LSE -inf) give exact zeros and -inf; all else finite."""
    empty = torch.isneginf(ref_lse)  # (B, Hq, Lq)
    out_rows = out.transpose(1, 2)  # (B, Hq, Lq, D)
    assert not torch.isnan(out).any(), "output has NaN"
    assert torch.isfinite(out).all(), "output has Inf"
    assert not torch.isnan(lse).any(), "LSE has NaN"
    assert torch.isfinite(lse[~empty]).all(), "LSE not finite on a row that sees keys"
    assert torch.isneginf(lse[empty]).all(), "LSE of a row that sees no key is not -inf"
    assert (out_rows[empty] == 0).all(), "output of a row that sees no key is not exactly 0"


def assert_close_to_reference(name, actual, reference, baseline, dtype) -> None:
    check = check_tensor(name, actual, reference, baseline, dtype)
    assert check.passed, check.describe()


def run_forward(q, k, v, mask=None, bias=None, causal=False, scale=None, func=dmattn_func):
    """Run ``func`` under an AllocationWatch and check out and LSE against the fp64 reference.
    ``mask``: a bool mask, ``KeyIntervals`` or a ``PreparedMask`` (the reference reads the
    mask it holds); the mask and bias tensors are watched for copies."""
    with AllocationWatch(watched=(mask, bias)) as watch:
        out, lse = func(q, k, v, mask, bias, causal, scale, return_lse=True)
    assert not watch.copies, f"mask or bias copied: {watch.copies}"
    b, lq, hq, _ = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (b, hq, lq) and lse.dtype == torch.float32
    if isinstance(mask, PreparedMask):
        mask = mask.mask
    ref_out, ref_lse = attention_reference(q, k, v, mask, bias, causal, scale, return_lse=True)
    lp_out, lp_lse = attention_reference(q, k, v, mask, bias, causal, scale, return_lse=True,
                                         upcast=False)
    assert_empty_rows_and_finite(out, lse, ref_lse)
    assert_close_to_reference("out", out, ref_out, lp_out, q.dtype)
    assert_close_to_reference("lse", lse, ref_lse, lp_lse, q.dtype)
    return ForwardRun(out, lse, ref_out, ref_lse, watch)


# -- backward
@dataclass
class Grads:
    """Gradients of query, key, value and (when it requires grad) the bias leaf."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dbias: torch.Tensor | None

    def named(self):
        yield from (("dq", self.dq), ("dk", self.dk), ("dv", self.dv))
        if self.dbias is not None:
            yield "dbias", self.dbias


def _identity(t):
    return t


def grads_of(func, q, k, v, mask, bias, causal, scale, grad_out, bias_view=_identity,
             **kwargs) -> Grads:
    """Gradients of ``(func(...) * grad_out).sum()``. ``bias`` is the leaf that receives the
    gradient (None for no bias); ``bias_view`` turns it into what is passed, e.g. an expand()."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    leaves = [q, k, v]
    view = None
    if bias is not None:
        bias = bias.detach().requires_grad_()
        leaves.append(bias)
        view = bias_view(bias)
    out = func(q, k, v, mask, view, causal, scale, **kwargs)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return Grads(*grads[:3], grads[3] if bias is not None else None)


def assert_grads_close_to_reference(q, k, v, mask, bias, causal, grad_out, dtype) -> None:
    """dmattn_func's dq, dk, dv (and dbias) against the fp64 reference's, each finite, in its
    input's shape and within the tolerance of an eager run in ``dtype``."""
    got = grads_of(dmattn_func, q, k, v, mask, bias, causal, None, grad_out)
    upcast = [None if t is None else t.float() for t in (q, k, v, bias)]
    truth = grads_of(attention_reference, *upcast[:3], mask, upcast[3], causal, None,
                     grad_out.double())
    low = grads_of(attention_reference, q, k, v, mask, bias, causal, None, grad_out,
                   upcast=False)
    for (name, a), (_, t), (_, lo) in zip(got.named(), truth.named(), low.named()):
        assert a.shape == t.shape, name
        assert torch.isfinite(a).all(), f"{name} has NaN or Inf"
        assert_close_to_reference(name, a, t, lo, dtype)


def assert_same_bits(first: Grads, second: Grads) -> None:
    """Two runs of a deterministic backward gave identical gradients, bit for bit."""
    for (name, a), (_, b) in zip(first.named(), second.named()):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"


def assert_deterministic_grads(q, k, v, mask, bias, causal, func=dmattn_func) -> None:
    """Two deterministic backward runs of one problem and one grad_out agree bit for bit."""
    grad_out = torch.randn(q.shape, device=q.device).to(q.dtype)
    first, second = (grads_of(func, q, k, v, mask, bias, causal, None, grad_out,
                              deterministic=True) for _ in range(2))
    assert_same_bits(first, second)


def backward_schedule(q, k, v, mask=None, bias=None, causal=False, *, deterministic=False,
                      bias_grad=True, kernel_options=None):
    """The backward part of the ``kernels.planning.schedule.Schedule`` that a ``dmattn_func`` call with
    these arguments runs (a bias gets a gradient unless ``bias_grad`` is False)."""
    return schedule_for(q, k, v, mask, bias, causal, deterministic=deterministic,
                        bias_requires_grad=bias is not None and bias_grad,
                        kernel_options=kernel_options).backward


def forcing(**kernel_options):
    """``dmattn_func`` with these schedule decisions forced (``kernel_options``)."""
    def forced(*args, **kwargs):
        return dmattn_func(*args, kernel_options=kernel_options, **kwargs)
    return forced


@dataclass
class BackwardRun:
    grads: Grads
    ref: Grads
    watch: AllocationWatch


def run_backward(q, k, v, mask=None, bias=None, causal=False, scale=None, *,
                 bias_view=_identity, deterministic=False, grad_out=None,
                 func=dmattn_func) -> BackwardRun:
    """Kernel gradients (under an AllocationWatch) against float64 autograd of the reference.
    ``mask`` as in ``run_forward`` (a ``PreparedMask``'s reference reads the mask it holds).

    The truth is the reference computed in float64 from float32 copies of the inputs (exact for
    every supported dtype); its gradients land in float32, far below every tolerance floor. The
    eager low-precision run of the accuracy rule is the reference's own backward in the
    inputs' dtype.
    """
    if grad_out is None:
        grad_out = torch.randn(q.shape, device=q.device).to(q.dtype)
    with AllocationWatch(watched=(mask, bias)) as watch:
        grads = grads_of(func, q, k, v, mask, bias, causal, scale, grad_out, bias_view,
                         deterministic=deterministic)
    assert not watch.copies, f"mask or bias copied: {watch.copies}"
    if isinstance(mask, PreparedMask):
        mask = mask.mask
    upcast = [None if t is None else t.detach().float() for t in (q, k, v, bias)]
    ref = grads_of(attention_reference, *upcast[:3], mask, upcast[3], causal, scale,
                   grad_out.double(), bias_view)
    eager = grads_of(attention_reference, q, k, v, mask, bias, causal, scale, grad_out,
                     bias_view, upcast=False)

    for (name, got), (_, truth), (_, low) in zip(grads.named(), ref.named(), eager.named()):
        leaf = {"dq": q, "dk": k, "dv": v, "dbias": bias}[name]
        assert got.shape == leaf.shape, f"{name} shape {tuple(got.shape)}"
        assert got.dtype == leaf.dtype, f"{name} dtype {got.dtype}"
        assert torch.isfinite(got).all(), f"{name} has NaN or Inf"
        assert_close_to_reference(name, got, truth, low, q.dtype)
    assert (grads.dbias is None) == (bias is None)
    return BackwardRun(grads, ref, watch)


def backward_schedules(monkeypatch) -> list:
    """Whether each backward plan made from now on was scheduled as captured
    (``Problem.captured``), one entry per plan (``planning.backward`` schedules one only where
    its forward plan keeps none of that signature)."""
    from kernels.planning import backward

    scheduled = []
    original = backward.schedule

    def recorded(problem, options=None):
        scheduled.append(problem.captured)
        return original(problem, options)
    monkeypatch.setattr(backward, "schedule", recorded)
    return scheduled


def forward_plans_made(monkeypatch) -> list:
    """The ``ForwardPlan`` objects made from now on, in order (recorded as they are made)."""
    from kernels.planning.forward import ForwardPlan

    made = []
    original_init = ForwardPlan.__init__

    def counted_init(self, *args, **kwargs):
        made.append(self)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(ForwardPlan, "__init__", counted_init)
    return made


def random_intervals(dims: Dims, heads: str, batch: str, device, seed: int = 0) -> KeyIntervals:
    """Random runs of rows per key: some empty, some covering every row, some one row long."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    b = dims.batch if batch == "B" else 1
    h = {"1": 1, "Hk": dims.heads_kv, "Hq": dims.heads_q}[heads]
    lq, lk = dims.seqlen_q, dims.seqlen_k
    start = torch.randint(-2, lq + 1, (b, h, lk), generator=gen)
    length = torch.randint(0, lq + 2, (b, h, lk), generator=gen)
    kind = torch.randint(0, 6, (b, h, lk), generator=gen)
    end = start + length
    start = torch.where(kind == 0, torch.zeros_like(start), start)  # every row
    end = torch.where(kind == 0, torch.full_like(end, lq), end)
    end = torch.where(kind == 1, start, end)  # empty
    end = torch.where(kind == 2, start + 1, end)  # one row
    return KeyIntervals(start.to(device), end.to(device=device, dtype=torch.int32))


class SyncWatch(TorchDispatchMode):
    """Records every op run while active that makes the host wait for the device: a value read
    back (``.item()``), an output sized by data, or a copy to the host (on a GPU; a CPU
    tensor's ``.tolist()`` reaches no op at all)."""

    READS_BACK = ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal",
                  "unique", "_unique2")

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        on_device = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                     and t.device.type != "cpu"]
        to_host = on_device and any(isinstance(t, torch.Tensor) and t.device.type == "cpu"
                                    for t in tree_leaves(result))
        if func.overloadpacket.__name__ in self.READS_BACK or to_host:
            self.syncs.append(str(func))
        return result
