"""Test-session setup shared by every test module.

By default the kernel tests run on CPU tensors under Triton's interpreter. ``triton.jit`` picks
between a compiled and an interpreted kernel when the decorator runs (it reads TRITON_INTERPRET
at that moment), so the variable has to be in the environment before a test module imports
``kernels``. pytest imports this file and calls ``pytest_configure`` before it collects (imports)
any test module, and ``setdefault`` leaves an explicit choice by the caller alone.

On a GPU machine the same tests run compiled on CUDA tensors with ``pytest --device cuda``.
Tests marked ``interpreter`` run kernels on CPU tensors whatever ``--device`` says (the harness
and training CLIs on the CPU, the README's CPU recipes): ``--device cuda`` deselects them and
says so, because a process that compiles the kernels cannot also interpret them.
"""

import os

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption(
        "--device", default="cpu", choices=("cpu", "cuda"),
        help="where the kernel tests put their tensors: cpu (Triton interpreter, the default) "
             "or cuda (compiled kernels)",
    )


def pytest_configure(config):
    if config.getoption("--device") == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _on_hopper(config) -> bool:
    return (config.getoption("--device") == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability() == (9, 0))


def pytest_collection_modifyitems(config, items):
    on_cpu = config.getoption("--device") == "cpu"
    on_hopper = _on_hopper(config)
    kept, interpreted, hopper = [], [], []
    for item in items:
        if item.get_closest_marker("interpreter") and not on_cpu:
            interpreted.append(item)
        elif item.get_closest_marker("hopper") and not on_hopper:
            hopper.append(item)
        else:
            kept.append(item)
    if interpreted or hopper:
        config.hook.pytest_deselected(items=interpreted + hopper)
        items[:] = kept
    config._interpreted_deselected = len(interpreted)
    config._hopper_deselected = len(hopper)


def pytest_terminal_summary(terminalreporter, config):
    count = getattr(config, "_interpreted_deselected", 0)
    if count:
        terminalreporter.write_line(
            f"{count} tests marked 'interpreter' deselected: they run kernels on CPU tensors "
            "under Triton's interpreter, which the CPU suite (pytest without --device) covers")
    count = getattr(config, "_hopper_deselected", 0)
    if count:
        terminalreporter.write_line(
            f"{count} tests marked 'hopper' deselected: they run the Gluon kernels, which "
            "have no interpreter and need a Hopper GPU (pytest --device cuda on one)")


@pytest.fixture(scope="session")
def device(pytestconfig) -> torch.device:
    """The device every kernel test allocates its tensors on."""
    return torch.device(pytestconfig.getoption("--device"))


@pytest.fixture(autouse=True)
def _seeded():
    """Every test draws the same random data on every run, whatever ran before it."""
    torch.manual_seed(0)


@pytest.fixture()
def no_kept_plans():
    """Start with no kept forward plans (those of mask-free calls, of unprepared KeyIntervals
    and of unprepared bool masks) and no checked forms of ordered intervals: another test in
    the session may have made a plan of the very signature a test means to plan afresh (a kept
    plan also keeps its backward plans)."""
    from kernels import call_plan, interface  # after pytest_configure has set TRITON_INTERPRET

    call_plan._plans.clear()
    call_plan._interval_plans.clear()
    call_plan._mask_plans.clear()
    interface._ordered_forms.clear()
