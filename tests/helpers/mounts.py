"""Small tmpfs mounts for the cases a plain folder cannot show to root: a read-only filesystem
and a full disk. Mounting needs root (CAP_SYS_ADMIN); elsewhere the test using one is skipped."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(where: Path, options: str):
    """``where`` as a fresh tmpfs mounted with ``options`` (e.g. ``ro`` or ``size=1m``)."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)
