"""Small tmpfs mounts for the cases a plain folder cannot show to root: a read-only filesystem
and a full disk. Mounting needs root (CAP_SYS_ADMIN); elsewhere the test using one is skipped.

Where no tmpfs can be mounted, a full disk is shown to one deploykit module only, in this process:
its ``os`` replaced by :func:`os_with`, e.g. ``fdopen=filling_fdopen(room)``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import types
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


def os_with(**replaced) -> types.SimpleNamespace:
    """The ``os`` module with ``replaced`` functions, to set as one module's ``os`` (monkeypatch)."""
    return types.SimpleNamespace(**{**vars(os), **replaced})


def filling_fdopen(room: int, error: BaseException | None = None):
    """``os.fdopen`` on a disk with ``room`` bytes left: a write past them writes what fits, then
    raises ``error`` (default: OSError ENOSPC), leaving a half-written file as a real disk would."""
    left = [room]

    class Filling:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            return self

        def __exit__(self, *_exception):
            self.stream.close()

        def write(self, data: bytes) -> int:
            fits = data[:left[0]]
            self.stream.write(fits)
            left[0] -= len(fits)
            if len(fits) < len(data):
                raise error or OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return len(data)

    return lambda fd, *args, **kwargs: Filling(os.fdopen(fd, *args, **kwargs))
