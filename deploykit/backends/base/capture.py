"""One CUDA graph capture at a time in a process, and no other GPU work beside it.

ONNX Runtime and torch capture CUDA graphs in CUDA's global capture mode: while one thread captures,
an allocation or a synchronise from any other thread breaks that capture (CUDA errors 900 and 901).
Two runners in one process — ``deploykit serve --instances 2`` on one GPU, say — must therefore not
run while either of them captures. Runs share the lock; a capture holds it alone, and a waiting
capture lets no new run start, so it is not starved by a steady stream of requests.
"""

from __future__ import annotations

import contextlib
import threading


class CaptureLock:
    """A readers-writer lock: ``shared()`` around every GPU run, ``alone()`` around a capture."""

    def __init__(self):
        self._state = threading.Condition()
        self._running = 0
        self._capturing = False
        self._waiting_captures = 0

    @contextlib.contextmanager
    def shared(self):
        with self._state:
            self._state.wait_for(lambda: not self._capturing and not self._waiting_captures)
            self._running += 1
        try:
            yield
        finally:
            with self._state:
                self._running -= 1
                self._state.notify_all()

    @contextlib.contextmanager
    def alone(self):
        with self._state:
            self._waiting_captures += 1
            self._state.wait_for(lambda: not self._capturing and not self._running)
            self._waiting_captures -= 1
            self._capturing = True
        try:
            yield
        finally:
            with self._state:
                self._capturing = False
                self._state.notify_all()

    def around(self, capturing: bool):
        """``alone()`` for a call that may capture, else ``shared()``."""
        return self.alone() if capturing else self.shared()


#: The process's one lock: every runner that puts work on a GPU takes it.
GPU_WORK = CaptureLock()
