"""Capture what native libraries write to file descriptor 2, which Python's sys.stderr misses."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Callable


@contextlib.contextmanager
def captured_stderr(lines: list[str], show: Callable[[str], bool] = lambda line: True):
    """Append every line native code writes to fd 2 to ``lines``; pass on those ``show`` keeps.

    TensorRT plugins log there while the parser runs (no logger is offered them), and
    the PyTorch profiler's library prints its own chatter there.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in text if show(line)))
            lines.extend(line.rstrip("\n") for line in text)
