"""Fetching the peer kernel, flash-dmattn 1.2.2, into the git-ignored ``.peer/`` folder.

``pip download`` of an sdist runs its ``setup.py`` to read metadata. flash-dmattn's setup.py
tries to configure its CUDA extension unless ``FLASH_DMATTN_SKIP_CUDA_BUILD=TRUE``, so that is set
for the download; nothing is built or installed. Only the Python package and the license are
unpacked (the CUDA sources are 56 MB the Triton kernel never reads), the tarball is removed,
and ``.peer/flash_dmattn-1.2.2`` (well under 1 MB) is what goes on PYTHONPATH.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

from .errors import ConfigError

PACKAGE = "flash-dmattn"
VERSION = "1.2.2"


def fetch_peer(dest: Path) -> Path:
    """Download and unpack the sdist; return the folder to put on PYTHONPATH."""
    dest.mkdir(parents=True, exist_ok=True)
    unpacked = dest / f"flash_dmattn-{VERSION}"
    if (unpacked / "flash_dmattn" / "flash_dmattn_triton.py").is_file():
        return unpacked
    env = dict(os.environ, FLASH_DMATTN_SKIP_CUDA_BUILD="TRUE")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--no-build-isolation", f"{PACKAGE}=={VERSION}", "-d", str(dest)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ConfigError(f"pip download {PACKAGE}=={VERSION} failed: {tail[0]}")
    archive = dest / f"flash_dmattn-{VERSION}.tar.gz"
    if not archive.is_file():
        raise ConfigError(f"{archive}: pip reported success but the sdist is not there")
    with tarfile.open(archive) as tar:
        top = f"flash_dmattn-{VERSION}"
        wanted = (f"{top}/flash_dmattn/", f"{top}/LICENSE", f"{top}/PKG-INFO")
        members = [m for m in tar.getmembers()
                   if m.name.startswith(wanted) and ".." not in Path(m.name).parts
                   and (m.isfile() or m.isdir())]
        try:
            tar.extractall(dest, members=members, filter="data")
        except TypeError:  # Python before 3.11.4 has no extraction filters; members are vetted above
            tar.extractall(dest, members=members)
    archive.unlink()
    if not (unpacked / "flash_dmattn" / "flash_dmattn_triton.py").is_file():
        raise ConfigError(f"{unpacked}: unpacked sdist has no flash_dmattn/flash_dmattn_triton.py")
    return unpacked
