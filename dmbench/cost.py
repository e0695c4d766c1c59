"""How long a run will take: the cost model behind the CPU guard and the progress ETA.

A point (case, backend, mode) makes ``calls`` calls of one backend:

    calls = rounds * (warmup + timed repeats) + 1 setup call (adapt/bind; for ``bwd`` also the
            forward that builds the graph) + the accuracy check's call when the run checks

and each call takes ``overhead[mode] + dense FLOPs / throughput`` (FLOPs from
``dmbench.flops``). Timed repeats stop at the sweep's ``budget_s`` as the timer does. Every
case also pays for its fp64 reference when the run checks accuracy.

Three kinds of backend, three sets of constants:

- ``interpreted``: a Triton kernel on the CPU, run by Triton's interpreter (``TRITON_INTERPRET``).
  Measured here: ``INTERPRETER_SAMPLES`` are the p50 ms per call of ``triton`` on every point of
  ``sweeps/smoke.yaml`` (fwd twice, bwd and fwd+bwd once) on a 2-core x86 VM shared with other
  jobs, torch 2.13 CPU, triton 3.9; the constants are their least-squares fit, one overhead per
  mode and one FLOP rate. The fit is within a factor 2.1 of every sample, enough to tell a one-minute
  sweep from a ten-hour one.
- ``native``: PyTorch's own CPU kernels (sdpa, the eager reference). Much faster than the
  interpreter; a conservative round rate, not a fit.
- ``gpu``: any backend on CUDA. A nominal guess used only until the first point finishes; the
  ETA is rescaled by measured progress from then on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .case import Case
from .flops import dense_flops
from .sweep import Timing
from .timing import MIN_REPEATS

# (mode, dense FLOPs of one call, measured p50 ms): triton under the interpreter, smoke.yaml.
INTERPRETER_SAMPLES = (
    ("fwd", 301056, 86),      # B1-H2/1-Lq48-Lk48-D32-W32-causal-bf16-topk-kv_row-s0
    ("fwd", 1191936, 263),    # B1-H2/1-Lq96-Lk96-D32-W32-causal-bf16-topk-kv_row-s0
    ("fwd", 2179840, 342),    # B1-H2/1-Lq130-Lk130-D32-W100-causal-bf16-block_topk-kv_row-s0
    ("fwd", 1064960, 186),    # B1-H4/2-Lq64-Lk64-D32-W16-causal-fp16-sliding-q_full-s0
    ("fwd", 66560, 77),       # B1-H4/1-Lq1-Lk130-D32-W--full-bf16-none-shared-s0
    ("fwd", 301056, 88),
    ("fwd", 1191936, 216),
    ("fwd", 2179840, 813),
    ("fwd", 1064960, 315),
    ("fwd", 66560, 120),
    ("bwd", 752640, 341),
    ("bwd", 2979840, 741),
    ("bwd", 5449600, 1087),
    ("bwd", 2662400, 1035),
    ("bwd", 166400, 158),
    ("fwd+bwd", 1053696, 427),
    ("fwd+bwd", 4171776, 934),
    ("fwd+bwd", 7629440, 1396),
    ("fwd+bwd", 3727360, 1697),
    ("fwd+bwd", 232960, 180),
)
FIT_MODES = ("fwd", "bwd", "fwd+bwd")


@dataclass(frozen=True)
class CallModel:
    """Seconds per call: ``overhead_s[mode] + flops / flops_per_s``."""

    overhead_s: dict[str, float]
    flops_per_s: float

    def seconds(self, case: Case, mode: str) -> float:
        overhead = self.overhead_s["fwd+bwd" if mode == "equiv" else mode]
        return overhead + dense_flops(case, mode) / self.flops_per_s


def fit_call_model(samples=INTERPRETER_SAMPLES) -> CallModel:
    """Least squares for one overhead per mode and one shared FLOP rate."""
    import numpy as np

    rows = [[1.0 if mode == m else 0.0 for m in FIT_MODES] + [flops] for mode, flops, _ in samples]
    seconds = [ms / 1e3 for _, _, ms in samples]
    solution = np.linalg.lstsq(np.array(rows), np.array(seconds), rcond=None)[0]
    overhead = {m: float(max(s, 0.0)) for m, s in zip(FIT_MODES, solution[:3])}
    return CallModel(overhead, float(1.0 / solution[3]))


INTERPRETER = fit_call_model()
NATIVE_CPU = CallModel({"fwd": 0.002, "bwd": 0.005, "fwd+bwd": 0.007}, 1e9)
GPU_NOMINAL = CallModel({"fwd": 0.001, "bwd": 0.002, "fwd+bwd": 0.003}, 1e14)
# Per point on a GPU: input generation, warmup compiles (flex), the L2 flush. Nominal too.
GPU_POINT_S = 0.5
# Per point on the CPU besides its calls (adapting inputs, binding, the row): the wall time of
# the sdpa and reference points of the same smoke.yaml runs was 0.07 to 0.2 s each.
CPU_POINT_S = 0.15

# The CPU guard refuses a sweep estimated above this (seconds), unless told otherwise.
CPU_LIMIT_S = 300.0


def call_model(device_type: str, interpreted: bool) -> CallModel:
    if device_type == "cuda":
        return GPU_NOMINAL
    return INTERPRETER if interpreted else NATIVE_CPU


def timed_calls(call_s: float, timing: Timing) -> int:
    """Calls the timer makes for one round: warmup, then repeats until the budget runs out."""
    per_round = timing.per_round()
    fit = math.floor(per_round.budget_s / call_s) + 1 if call_s > 0 else per_round.repeats
    repeats = min(per_round.repeats, max(MIN_REPEATS, fit))
    return timing.rounds * (per_round.warmup + repeats)


def point_seconds(case: Case, mode: str, model: CallModel, timing: Timing, check: bool,
                  device_type: str) -> float:
    """Estimated seconds for one (case, backend, mode) point run with ``model``."""
    if mode == "equiv":
        return 2 * model.seconds(case, "fwd+bwd")  # the check, plus adapting its graph
    call = model.seconds(case, mode)
    seconds = (timed_calls(call, timing) + 1) * call
    if mode == "bwd":
        seconds += model.seconds(case, "fwd")
    if check:
        seconds += model.seconds(case, "fwd" if mode == "fwd" else "fwd+bwd")
    return seconds + (GPU_POINT_S if device_type == "cuda" else CPU_POINT_S)


def case_seconds(case: Case, check: bool, device_type: str) -> float:
    """Per case: the fp64 reference and the eager low-precision run an accuracy check needs."""
    if not check:
        return 0.0
    model = GPU_NOMINAL if device_type == "cuda" else NATIVE_CPU
    return 2 * model.seconds(case, "fwd+bwd")


def format_seconds(seconds: float) -> str:
    """'<1s', '45s', '3m20s', '2h05m', '3d04h'."""
    if 0.0 < seconds < 0.5:
        return "<1s"
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def estimate_points(units, backends: dict, timing: Timing, check: bool,
                    device_type: str) -> dict[tuple[str, str, str], float]:
    """Estimated seconds per planned point (``runner.Unit``), keyed like result rows. A point
    recorded as skipped costs nothing; each case's shared cost goes to its first runnable point."""
    estimates = {}
    charged = set()
    for unit in units:
        if unit.skip is not None:
            estimates[unit.key] = 0.0
            continue
        model = call_model(device_type, getattr(backends[unit.backend], "interpreted", False))
        seconds = point_seconds(unit.case, unit.mode, model, timing, check or unit.mode == "equiv",
                                device_type)
        if unit.case not in charged:
            charged.add(unit.case)
            seconds += case_seconds(unit.case, check or unit.mode == "equiv", device_type)
        estimates[unit.key] = seconds
    return estimates
