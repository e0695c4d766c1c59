"""The environment recorded in every result row and shown by ``dmbench env``."""

from __future__ import annotations

import os

import re
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Environment:
    gpu: str
    driver: str
    torch: str
    triton: str
    git_sha: str
    git_dirty: bool
    host: str


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _driver() -> str:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else "unknown"


def _triton_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")
    except PackageNotFoundError:
        return "absent"


# What ``git_dirty`` looks at: the tree without ``results/``, whose tracked CSVs and plots a run
# may rewrite (so a run that resumes its own file after a fault sees the same commit state).
CODE_PATHSPEC = ("--", ".", ":(exclude)results")


def _commit() -> tuple[str, bool]:
    """(short sha, dirty). Only tracked changes outside ``results/`` count as dirty.

    A copy of the tree shipped to a GPU host may have no ``.git``, or a stale one from an older
    commit; ``DMBENCH_GIT_SHA`` names the commit it was made from and takes precedence. The copy
    is then compared with that commit when the local ``.git`` knows it, else taken as clean.
    Without either, the rows say "unknown" rather than guess.
    """
    named = os.environ.get("DMBENCH_GIT_SHA", "").strip()
    if named:
        known = _git("cat-file", "-e", f"{named}^{{commit}}") is not None
        return named[:12], bool(known and _git("diff", "--name-only", named, *CODE_PATHSPEC))
    sha = _git("rev-parse", "--short=12", "HEAD") or "unknown"
    return sha, bool(_git("status", "--porcelain", "--untracked-files=no", *CODE_PATHSPEC))


def collect(device: torch.device) -> Environment:
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        driver = _driver()
    else:
        gpu, driver = "cpu (triton interpreter)", "none"
    sha, dirty = _commit()
    return Environment(gpu, driver, torch.__version__, _triton_version(), sha,
                       dirty, socket.gethostname())


def gpu_slug(gpu: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'; the CPU gets 'cpu'."""
    if gpu.startswith("cpu"):
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "gpu"
