"""Running a sweep: every (case, backend, mode) point becomes one row, written as it finishes.

Inputs are generated once per case on the device; each backend then adapts them outside the
timed region. An OOM or an exception at one point becomes that row's status and the sweep goes
on. With ``timing.rounds`` > 1 a case's points are timed round-robin and each row pools its
rounds: rows under ~0.5 ms time the host (Python, launches, autograd's engine) as much as the
GPU, and the benchmark VM's host slows down by up to 2x for seconds at a time, so timing each
point in one stretch let such a spell decide which backend looked faster (results/notes.md). Modes: ``fwd``, ``bwd`` (backward alone, given a forward graph), ``fwd+bwd``, and ``equiv``
(accuracy only, no timing).

With ``timing.cuda_graph`` a point's call is built and timed on a side stream
(``timing.point_stream``) and timed as CUDA graph replays; a call that cannot be captured
becomes an ``error`` row whose detail starts ``cuda graph capture:``, and the sweep goes on.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from . import flops
from .accuracy import FORWARD_TENSORS, CheckResult, check_backend, ground_truth
from .backends import DIFF_KEYS, Backend
from .case import Case
from .device import DeviceFault, context_alive
from .problem import Problem, make_problem
from .results import TIMED_MODES, Row, new_row, set_accuracy
from .sweep import Sweep, Timing
from .timing import (BuildStep, CaptureError, Measurement, build_total, measure, point_stream,
                     pooled)
from .watchdog import PointWatchdog

GRAD_MODES = ("bwd", "fwd+bwd", "equiv")


@dataclass(frozen=True)
class Unit:
    case: Case
    backend: str
    mode: str
    skip: str | None = None  # a reason recorded instead of running

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.case.case_id, self.backend, self.mode)


def plan_units(sweep: Sweep, cases: Iterable[Case], modes: tuple[str, ...],
               backends: dict[str, Backend], device: torch.device) -> list[Unit]:
    """Every point of ``cases`` in run order, with the skip reason where one is known upfront."""
    skipped = {s.case: s.reason for s in sweep.skipped}
    units = []
    for case in cases:
        for name in sweep.backends:
            backend = backends[name]
            reason = (skipped.get(case) or backend.unavailable_reason(device)
                      or backend.skip_reason(case))
            for mode in modes:
                why = reason or backend.memory_reason(case, mode, device)
                if why is None and mode in GRAD_MODES[:2] and not backend.has_grad:
                    why = f"{name} has no backward"
                if why is None and mode == "equiv" and not backend.exact and (case.mask != "none" or case.bias != "none"):
                    why = f"{name} ignores mask and bias, so it cannot be checked on this case"
                units.append(Unit(case, name, mode, why))
    return units


FAILED = ("error", "oom")
DEVICE_FAULT = "device fault, CUDA context lost"
HUNG = "point timeout"


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda" and context_alive(device):  # a dead context raises here too
        torch.cuda.empty_cache()


def _failure(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, CaptureError):
        return ("oom" if exc.oom else "error"), str(exc)
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "oom", "out of memory"
    text = str(exc).strip().splitlines()
    return "error", f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


@dataclass(frozen=True)
class CallSetup:
    """What a timed call is made of, for its row: the mask's build steps (the case's and the
    backend's own, ``backends.base``) and the kernel the backend reports running ("" if none)."""
    steps: list[BuildStep]
    kernel: str = ""

    def detail(self) -> tuple[float | None, str]:
        """(build_ms, the row's detail): the build steps, then the kernel."""
        build_ms, built = build_total(self.steps)
        return build_ms, "; ".join(part for part in (built, self.kernel) if part)


def _timed_call(backend: Backend, problem: Problem, mode: str):
    """(zero-arg function to time, its ``CallSetup``). Everything else happens here, untimed:
    for a backend that names its kernels (``Backend.route_record``), the forward a gradient
    mode needs and one run of the function are logged."""
    grad = mode != "fwd"
    with torch.no_grad():
        adapted = backend.adapt(problem)
    leaves = []
    for name in DIFF_KEYS:
        if getattr(problem, name) is not None and adapted.get(name) is not None:
            adapted[name] = adapted[name].detach().requires_grad_(grad)
            leaves.append(adapted[name])
    bound = backend.bind(adapted, problem.case, want_lse=False)
    steps = [s for s in (problem.mask_build if backend.takes_mask else None,
                         adapted.get("build"), bound.build) if s is not None]
    record = backend.route_record()
    if record is not None:
        _settle(bound, leaves if grad else [])
    with record if record is not None else contextlib.nullcontext():
        if mode == "fwd":
            fn = bound.call
        else:
            out = bound.call()[0]
            dout = torch.randn_like(out)
            if mode == "bwd":
                def fn():
                    return torch.autograd.grad(out, leaves, dout, retain_graph=True)
            else:
                def fn():
                    return torch.autograd.grad(bound.call()[0], leaves, dout)
        if record is not None:
            fn()
    routes = record.describe() if record is not None else ""
    kernel = "; ".join(part for part in (bound.kernel, routes and f"routes: {routes}") if part)
    return fn, CallSetup(steps, kernel)


def _settle(bound, leaves: list) -> None:
    """One call (and, where ``leaves`` are given, its backward to them) before the call whose
    routes the row names: a first call may take another route than the repeats the timing
    sees (packed documents walk their own tiles from the second call with the same offsets)."""
    out = bound.call()[0]
    if leaves:
        torch.autograd.grad(out, leaves, torch.ones_like(out))


def _apply_check(row: Row, result: CheckResult, mode: str) -> None:
    wanted = {"fwd": FORWARD_TENSORS, "bwd": ("dq", "dk", "dv", "dbias")}.get(mode)
    checks = {n: c for n, c in result.checks.items() if wanted is None or n in wanted}
    set_accuracy(row, checks)
    failed = [c.describe() for c in checks.values() if not c.passed]
    if failed and row.status == "ok":
        row.status = "accuracy"
        row.detail = "; ".join(failed)[:500]
    if result.error and mode != "fwd" and row.status == "ok":
        row.status, row.detail = "error", result.error[:300]


class SweepRunner:
    """Runs planned units case by case and hands each finished row to ``emit``."""

    def __init__(self, sweep: Sweep, backends: dict[str, Backend], device: torch.device, env,
                 check: bool, report: Callable[[Row, Unit], None], sweep_hash: str = "",
                 point_timeout_s: float | None = None,
                 on_hang: Callable[[str, float], None] | None = None):
        """``report(row, unit)`` receives each finished row and the point it came from;
        ``sweep_hash`` (``sweep.sweep_digest``) is recorded in every row. A point (one round
        of it) that runs past ``point_timeout_s`` is reported as an error row from the
        watchdog's thread, then ``on_hang(point, seconds)`` runs there (``dmbench.watchdog``;
        it restarts the process)."""
        self.sweep, self.backends, self.device, self.env = sweep, backends, device, env
        self.check, self.report, self.sweep_hash = check, report, sweep_hash
        self.point_timeout_s, self.on_hang = point_timeout_s, on_hang

    def run(self, units: list[Unit]) -> None:
        by_case: dict[Case, list[Unit]] = {}
        for unit in units:
            by_case.setdefault(unit.case, []).append(unit)
        for case, case_units in by_case.items():
            self._run_case(case, case_units)

    def _row(self, unit: Unit, status: str, detail: str = "") -> Row:
        """A row of ``unit``; a timed mode's row names the timing (equiv rows time nothing)."""
        timing = self.sweep.timing.kind if unit.mode in TIMED_MODES else "eager"
        return new_row(self.sweep.name, unit.case, unit.backend, unit.mode, status, self.env, detail,
                       self.sweep_hash, timing)

    def _finish(self, unit: Unit, row: Row) -> None:
        self.report(row, unit)

    def _run_case(self, case: Case, units: list[Unit]) -> None:
        runnable = [u for u in units if u.skip is None]
        for unit in units:
            if unit.skip is not None:
                self._finish(unit, self._row(unit, "skipped", unit.skip))
        if not runnable:
            return
        try:
            needs_grad = any(u.mode in GRAD_MODES for u in runnable)
            problem = make_problem(case, self.device, time_build=True)
            wants_truth = self.check or any(u.mode == "equiv" for u in runnable)
            truth = ground_truth(problem, needs_grad) if wants_truth else None
            self._needs_grad = needs_grad
        except Exception as exc:
            status, detail = _failure(exc)
            lost = not context_alive(self.device)
            for unit in runnable:
                note = f"{DEVICE_FAULT}: " if lost else ""
                self._finish(unit, self._row(unit, status, f"{note}inputs/reference: {detail}"))
            if lost:
                raise DeviceFault(f"{case.case_id} inputs/reference: {detail}") from exc
            _release(self.device)
            return
        checks: dict[str, CheckResult | str] = {}
        self._run_rounds(runnable, problem, truth, checks)
        del problem, truth
        _release(self.device)

    def _run_rounds(self, runnable: list[Unit], problem: Problem, truth, checks: dict) -> None:
        """Time the case's points round-robin, ``rounds`` times each (once by default); a
        point's row is made and reported in the last round, from all its rounds' samples. A
        point that fails is reported at once and not timed again."""
        timing = self.sweep.timing
        per_round = timing.per_round()
        rounds: dict[Unit, list[Measurement]] = {}
        builds: dict[Unit, CallSetup] = {}
        reported: set[Unit] = set()
        for index in range(timing.rounds):
            last = index == timing.rounds - 1
            for unit in runnable:
                if unit in reported or (unit.mode == "equiv" and not last):
                    continue
                with PointWatchdog(self.point_timeout_s, lambda u=unit: self._hung(u)) as dog:
                    if unit.mode == "equiv":
                        row = self._equiv_row(unit, problem, truth, checks)
                    else:
                        timed = self._measure(unit, problem, per_round)
                        if isinstance(timed, Row):
                            row = timed
                        else:
                            builds.setdefault(unit, timed[0])
                            rounds.setdefault(unit, []).append(timed[1])
                            if not last:
                                continue
                            row = self._timed_row(unit, problem, truth, checks,
                                                  pooled(rounds[unit]), builds[unit])
                reported.add(unit)
                if dog.fired:  # reported by the watchdog (a test's on_hang returned)
                    continue
                if row.status in FAILED and not context_alive(self.device):
                    # Record the point, then stop: nothing after it could run in this process.
                    row.detail = f"{DEVICE_FAULT}: {row.detail}"[:300]
                    self._finish(unit, row)
                    raise DeviceFault(f"{unit.case.case_id} {unit.backend} {unit.mode}: {row.detail}")
                self._finish(unit, row)

    def _hung(self, unit: Unit) -> None:
        """The watchdog's thread: record the point that gave no result, then ``on_hang``."""
        seconds = self.point_timeout_s
        point = f"{unit.case.case_id} {unit.backend} {unit.mode}"
        self._finish(unit, self._row(unit, "error", f"{HUNG}: no result after {seconds:g} s "
                                                    "(--point-timeout)"))
        if self.on_hang is not None:
            self.on_hang(point, seconds)

    def _check(self, backend: Backend, problem: Problem, truth, cache: dict) -> CheckResult | str:
        """One accuracy check per backend and case, shared by its fwd, bwd and fwd+bwd rows."""
        if backend.name not in cache:
            try:
                cache[backend.name] = check_backend(backend, problem, truth, self._needs_grad)
            except Exception as exc:
                cache[backend.name] = "accuracy check: " + ":".join(_failure(exc))
            _release(self.device)
        return cache[backend.name]

    def _equiv_row(self, unit: Unit, problem: Problem, truth, cache: dict) -> Row:
        result = self._check(self.backends[unit.backend], problem, truth, cache)
        if isinstance(result, str):
            return self._row(unit, "error", result)
        row = self._row(unit, "ok")
        _apply_check(row, result, "equiv")
        return row

    def _measure(self, unit: Unit, problem: Problem,
                 timing: Timing) -> tuple[CallSetup, Measurement] | Row:
        """(the call's setup, one round's measurement), or the failed point's row."""
        try:
            with point_stream(self.device, timing):
                fn, setup = _timed_call(self.backends[unit.backend], problem, unit.mode)
                measured = measure(fn, timing, self.device)
                del fn
        except Exception as exc:
            status, detail = _failure(exc)
            _release(self.device)
            return self._row(unit, status, detail)
        if self.sweep.timing.rounds > 1 and self.device.type == "cuda":
            # Each point starts from an empty cache, as in a single pass. Without this, sdpa's
            # bwd at seqlen L32768 (a 32 GiB float mask and its gradient), which fits in one
            # pass, ran out of memory in a later round; a large cached block split to serve
            # other points' buffers is the likely cause (not isolated).
            torch.cuda.empty_cache()
        return setup, measured

    def _timed_row(self, unit: Unit, problem: Problem, truth, cache: dict,
                   measured: Measurement, setup: CallSetup) -> Row:
        backend = self.backends[unit.backend]
        row = self._row(unit, "ok")
        row.ms_p20, row.ms_p50, row.ms_p80 = measured.p20, measured.p50, measured.p80
        row.repeats = len(measured.samples_ms)
        row.build_ms, row.detail = setup.detail()
        row.peak_mib = measured.peak_mib
        row.active_fraction = problem.active_fraction
        if backend.exact:
            # sdpa-dense does the dense work whatever the mask, so only dense TFLOP/s apply.
            row.tflops_active = flops.tflops(flops.active_flops(unit.case, problem.kept_pairs, unit.mode), measured.p50)
        row.tflops_dense = flops.tflops(flops.dense_flops(unit.case, unit.mode), measured.p50)
        if self.check and (backend.exact or (unit.case.mask == "none" and unit.case.bias == "none")):
            result = self._check(backend, problem, truth, cache)
            if isinstance(result, str):
                row.status, row.detail = "error", result
            else:
                _apply_check(row, result, unit.mode)
        return row
