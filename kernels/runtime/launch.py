"""Launching Triton kernels: whether they run under the interpreter, and the one launch path,
``PlannedLaunch.__call__``, which hands the compile to ``compile_only``'s executor
(``kernels.warmup``), goes through Triton's JIT dispatch (the interpreter, launch hooks), or
calls the compiled kernel's launcher directly (what each launch is compiled for: ``forms``).
``launch`` is a one-off launch made through a plan of its own."""

from __future__ import annotations

import functools
from collections import OrderedDict
from concurrent.futures import Executor, wait
from contextlib import contextmanager

import torch

from .forms import UNKNOWN_INT, compile_form, note_form, specialization, unspecialized
from .tma import EncodedDescriptors, as_descriptor


def is_interpreted(kernel) -> bool:
    # triton.jit returns an InterpretedFunction instead of a JITFunction when TRITON_INTERPRET=1
    # was set before the decorator ran (true for triton 3.2 through 3.9).
    return type(kernel).__name__ == "InterpretedFunction"


def ensure_runnable(kernel, device: torch.device) -> None:
    """CPU tensors only work under Triton's interpreter; say how to turn it on, or what to
    install where the installed interpreter cannot run the kernels."""
    if device.type != "cpu":
        return
    if not is_interpreted(kernel):
        raise RuntimeError(
            "dmattn on CPU tensors needs Triton's interpreter: set the environment variable "
            "TRITON_INTERPRET=1 before importing kernels (or triton), e.g. "
            "`TRITON_INTERPRET=1 python your_script.py`, or move the tensors to a CUDA device"
        )
    problem = interpreter_problem()
    if problem:
        raise RuntimeError(problem)


def _release(version: str) -> tuple[int, int]:
    major, minor = (version.split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@functools.cache
def interpreter_problem() -> str | None:
    """Why the installed Triton interpreter cannot run the kernels, or None.

    Triton 3.6 and older interpret an integer argument as a one-element array and give a
    loop bound to ``range`` through ``int(array)``, which NumPy 2.4 made an error (TypeError:
    only 0-dimensional arrays can be converted to Python scalars); Triton 3.7 squeezes it."""
    import numpy
    import triton

    if _release(triton.__version__) < (3, 7) and _release(numpy.__version__) >= (2, 4):
        return (f"Triton {triton.__version__}'s interpreter cannot run with NumPy "
                f"{numpy.__version__} (its loops fail on NumPy 2.4 and later): for CPU tensors "
                "install triton>=3.7 or numpy<2.4")
    return None


def dot_options(dtype: torch.dtype, interpreted: bool) -> dict:
    """Compile-time dot settings shared by every kernel (see ``score.mma``)."""
    return dict(
        # fp32 inputs are for tight gradient checks: keep the dots in true fp32, not tf32.
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        WIDEN_DOTS=interpreted and dtype == torch.bfloat16,
    )


def _kernel_arg(a):
    # A bool tensor is passed to Triton as uint8 (same bytes, no copy, and a plain integer
    # load in every Triton version). Only the JIT and interpreter paths need this: the direct
    # path passes addresses, so a repeat call makes no view (a torch op of host time).
    return a.view(torch.uint8) if isinstance(a, torch.Tensor) and a.dtype == torch.bool else a


# -- launching with less host time
# ``kernel[grid](...)`` runs Triton's JIT dispatch on every call: it binds and specializes
# each argument, builds a cache key and looks the compiled kernel up. On the H100 benchmark
# host that is ~37 us per launch back to back and ~75 us inside a real call, against ~9 us for
# the compiled kernel's own launcher (triton 3.6), and the backward makes
# three launches. A ``PlannedLaunch`` compiles once per form (``compile_form``) and then calls
# the compiled kernel's launcher directly.
MAX_SIGNATURES = 256  # per kernel, of ``launch``; a model or a sweep uses a handful of forms
_compiled: dict = {}  # kernel -> signature of a ``launch`` -> what its plans have compiled


try:  # the Triton internals the direct path needs (triton 3.x)
    from triton import knobs as _knobs
    from triton.runtime import driver as _driver
except ImportError:  # pragma: no cover - older Triton: every launch takes the JIT path
    _knobs = _driver = None


def _hook_installed(hook) -> bool:
    # Triton >= 3.5 keeps hooks in an always-present HookChain; older versions use None.
    return hook is not None and bool(getattr(hook, "calls", True))


def _direct_launch_available() -> bool:
    """The direct path needs Triton's driver and no launch hooks installed (profilers such as
    proton rely on them, and only the JIT path calls them; that path compiles for the real
    values, as Triton does)."""
    if _knobs is None:
        return False
    runtime = _knobs.runtime
    return not (_hook_installed(runtime.launch_enter_hook)
                or _hook_installed(runtime.launch_exit_hook))


def _compile(kernel, grid: tuple, args: tuple, options: dict) -> tuple:
    """Compile ``kernel`` for the canonical ``args`` without running it (Triton's own cache
    answers a form it has compiled before); return what ``_run_compiled`` needs: the compiled
    kernel and the parameters after ``args`` (the launcher takes them all and skips the
    constexprs itself)."""
    compiled = kernel.warmup(*map(_kernel_arg, args), grid=grid, **options)
    compiled = compiled.result() if hasattr(compiled, "result") else compiled
    tail = tuple(options[name] for name in kernel.arg_names[len(args):])
    return compiled, tail


# While ``compile_only(executor)`` is active, launches hand the compile of their form to the
# executor and return without running. A process-wide setting, not a context variable: autograd
# runs a backward's launches on its own thread. The kernels' outputs are left unwritten; no
# host code reads them (the host never waits for the device within a call), so the calls make
# the same launches as when they run.
_compile_executor: Executor | None = None
_pending: list = []


@contextmanager
def compile_only(executor: Executor):
    """Launches made inside (by any thread) only start compiling their kernels, on
    ``executor``'s threads; leaving waits for every compile and raises the first error. Calls
    made elsewhere meanwhile would not run either: use it while nothing else calls the
    kernels."""
    global _compile_executor
    if _compile_executor is not None:
        raise RuntimeError("compile_only: already active")
    _compile_executor = executor
    try:
        yield
    finally:
        _compile_executor = None
        started, _pending[:] = list(_pending), []
        wait(started)
    for future in started:
        future.result()


def launches_run() -> bool:
    """False while ``compile_only`` is active: launches then compile and write nothing."""
    return _compile_executor is None


def _start_compile(kernel, grid: tuple, form: tuple, options: dict) -> None:
    if not note_form(kernel, form, options):  # compiled, or being compiled
        return
    if not is_interpreted(kernel):
        _pending.append(_compile_executor.submit(
            kernel.warmup, *map(_kernel_arg, form), grid=grid, **options))


def _current_device() -> int:
    # torch's own query: Triton's, through its driver proxy, took 0.57 us per call on the H100
    # host against 0.32. Both return the same index.
    return torch.cuda.current_device()


def _run_compiled(hit: tuple, grid: tuple, args: tuple, device: int) -> None:
    compiled, tail = hit
    compiled.run(grid[0], grid[1], grid[2], _driver.active.get_current_stream(device),
                 compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)


def _grid3(grid: tuple) -> tuple:
    return tuple(grid) + (1,) * (3 - len(grid))


def _plain(value):
    """``value`` with every NamedTuple in it turned into a plain tuple. The compiled kernel's
    launcher reads tuple arguments by position, and a plain tuple is its fast path: 8 tuples
    of 5 ints cost 8.4-9.1 us per launch on the H100 host, as 40 flat ints did (8.8-9.0),
    against 13.0-13.4 us as NamedTuples (triton 3.6)."""
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return value


_data_ptr = torch.Tensor.data_ptr
_alignment = (15).__and__  # an address's offset from 16-byte alignment


class PlannedLaunch:
    """A launch planned once per call signature: the grid, every scalar argument, the
    constexprs and the options are fixed, and each call passes only the kernel's tensors, which
    its first parameter takes as one ``pointers`` NamedTuple (``planning.operands``), or, with
    ``pointers`` None, its leading parameters take one by one (the small list launches).

    The plan's owner guarantees the pointers' dtypes (they follow from the call signature) and
    the scalars are compiled for their ``compile_form``, so the only thing left that a call
    changes is each pointer's 16-byte alignment: one compiled kernel is kept per alignment
    pattern and device.

    A call is the one place that decides how a launch runs (``launch``'s too): under
    ``compile_only`` it hands the compile of its form to the executor; under the interpreter
    or with launch hooks installed it goes through Triton's JIT dispatch, noting its form; else
    it compiles once per form and calls the compiled kernel's launcher (the hot path).
    """

    def __init__(self, kernel, grid: tuple, pointers: type, scalars: tuple,
                 num_warps: int = 4, num_stages: int = 3, **constexprs):
        self.kernel = kernel
        self.interpreted = is_interpreted(kernel)
        self.grid = _grid3(grid)
        self.pointers = pointers
        self.scalars = tuple(scalars)
        self._plain_scalars = tuple(map(_plain, self.scalars))
        self._form_scalars = tuple(map(compile_form, self.scalars))
        self.options = dict(num_warps=num_warps, num_stages=num_stages, **constexprs)
        self._compiled: dict = {}

    def _leading(self, tensors: tuple) -> tuple:
        """The kernel's leading arguments: the pointers tuple, or the tensors themselves."""
        tensors = tuple(map(_kernel_arg, tensors))
        return tensors if self.pointers is None else (self.pointers(*tensors),)

    def _form(self, leading: tuple) -> tuple:
        """What a call with these leading arguments is compiled for."""
        return unspecialized(self.kernel, (*leading, *self._form_scalars))

    def __call__(self, *tensors: torch.Tensor) -> None:
        if _compile_executor is not None:  # compile-only: the executor compiles the form
            _start_compile(self.kernel, self.grid, self._form(self._leading(tensors)),
                           self.options)
            return
        if self.interpreted or not _direct_launch_available():  # Triton's JIT dispatch
            leading = self._leading(tensors)
            note_form(self.kernel, self._form(leading), self.options)
            self.kernel[self.grid](*leading, *map(_kernel_arg, self.scalars), **self.options)
            return
        device = _current_device()  # direct: the compiled kernel's own launcher
        # The launcher takes addresses as plain ints too, which skips its per-tensor
        # ``data_ptr()`` call and pointer-attribute query (we read the addresses anyway).
        # ``map`` over C callables: no Python frame per pointer.
        addresses = tuple(map(_data_ptr, tensors))
        key = (device, *map(_alignment, addresses))
        hit = self._compiled.get(key)
        if hit is None:
            form = self._form(self._leading(tensors))
            note_form(self.kernel, form, self.options)
            hit = self._compiled[key] = _compile(self.kernel, self.grid, form, self.options)
        if self.pointers is None:
            _run_compiled(hit, self.grid, (*addresses, *self._plain_scalars), device)
        else:
            _run_compiled(hit, self.grid, (addresses, *self._plain_scalars), device)


def launch(kernel, grid: tuple, *args, num_warps: int = 4, num_stages: int = 3,
           **constexprs) -> None:
    """``kernel[grid](*args, num_warps=..., num_stages=..., **constexprs)``, compiled for the
    arguments' ``compile_form`` and with Triton's per-call dispatch skipped on repeat forms.
    ``args`` are the runtime arguments in the kernel's order and ``constexprs`` name every
    remaining parameter.

    A plan made for this one call, its arguments all scalars of the plan (the launcher then
    reads each tensor's address itself). The plans of one signature (options, and what the
    arguments are compiled for: the tensors' dtypes and alignments among it) share what they
    compile, by device, as one plan's calls do."""
    plan = PlannedLaunch(kernel, grid, None, args, num_warps, num_stages, **constexprs)
    signature = (num_warps, num_stages, tuple(constexprs.values()),
                 tuple(map(specialization, unspecialized(kernel, plan._form_scalars))))
    signatures = _compiled.setdefault(kernel, OrderedDict())
    compiled = signatures.get(signature)
    if compiled is None:
        compiled = signatures[signature] = {}
        if len(signatures) > MAX_SIGNATURES:
            signatures.popitem(last=False)
    plan._compiled = compiled
    plan()


def _unknown_if_int(value):
    return UNKNOWN_INT if value.__class__ is int else value


class DescriptorLaunch:
    """A launch planned once whose operands reach the kernel as TMA tensor descriptors, made by
    the caller per call (Gluon's Hopper kernels). The grid, the trailing scalars and the
    constexprs are fixed. The kernel must not specialize on its int arguments (``gluon.jit``'s
    ``do_not_specialize``): it is compiled for ``UNKNOWN_INT`` in their place, and a
    descriptor for its dtype, box and layout only (``specialization``); ints among a call's
    operands (strides of a mask's lists or a bias, which follow the lengths) likewise, so one
    compile serves every call of every plan of one form on a device. Descriptor operands come
    as ``tma.TmaOperand``s (a tensor and its plan's ``TmaSpec``), or as descriptors. Each call
    takes ``PlannedLaunch``'s paths: compile-only, Triton's JIT dispatch with launch hooks
    installed, else the compiled kernel's launcher: underneath its Python descriptor encoding,
    with each operand's encoding kept per address (``tma.EncodedDescriptors``), where the
    launcher has that form; else through it (which encodes every descriptor, 128 bytes, per
    call)."""

    def __init__(self, kernel, grid: tuple, scalars: tuple, num_warps: int = 4, **constexprs):
        self.kernel = kernel
        self.grid = _grid3(grid)
        self.scalars = tuple(scalars)
        self._form_scalars = tuple(UNKNOWN_INT if s.__class__ is int else s for s in scalars)
        self._plain_scalars = tuple(map(_plain, self.scalars))
        self.options = dict(num_warps=num_warps, **constexprs)
        self._compiled: dict = {}
        self._encoded: dict = {}  # device -> EncodedDescriptors, or None: the usual path

    def _form(self, descriptors: tuple) -> tuple:
        """What a call with these operands (``TmaOperand``s as descriptors) is compiled for."""
        return (*map(_unknown_if_int, descriptors), *self._form_scalars)

    def __call__(self, *operands) -> None:
        if _compile_executor is not None:
            _start_compile(self.kernel, self.grid, self._form(tuple(map(as_descriptor, operands))),
                           self.options)
            return
        if not _direct_launch_available():
            descriptors = tuple(map(as_descriptor, operands))
            note_form(self.kernel, self._form(descriptors), self.options)
            self.kernel[self.grid](*descriptors, *self.scalars, **self.options)
            return
        device = _current_device()
        hit = self._compiled.get(device)
        if hit is None:
            form = self._form(tuple(map(as_descriptor, operands)))
            note_form(self.kernel, form, self.options)
            hit = self._compiled[device] = _compile(self.kernel, self.grid, form, self.options)
            self._encoded[device] = EncodedDescriptors.of(hit[0])
        encoded = self._encoded[device]
        if encoded is None:
            _run_compiled(hit, self.grid, (*map(as_descriptor, operands), *self.scalars), device)
            return
        encoded.launch(self.grid, _driver.active.get_current_stream(device),
                       (*operands, *self._plain_scalars), hit[1])
