"""One CUDA graph capture at a time in a process, and no other GPU work beside it.

ONNX Runtime and torch capture CUDA graphs in CUDA's global capture mode: while one thread captures,
an allocation or a synchronise from any other thread breaks that capture (CUDA errors 900 and 901).
Two runners in one process — ``deploykit serve --instances 2`` on one GPU, say — must therefore not
run while either of them captures. Runs share the lock; a capture holds it alone, and a waiting
capture lets no new run start, so it is not starved by a steady stream of requests.

Every GPU call of every runner takes the lock, so a run that meets no capture only counts itself
in and out under a plain mutex: it waits, or wakes a waiter, only when a capture is involved.
"""

from __future__ import annotations

import contextlib
import threading


class CaptureLock:
    """A readers-writer lock: ``shared()`` around every GPU run, ``alone()`` around a capture."""

    def __init__(self):
        self._counts = threading.Lock()  # guards the three counts below
        self._changed = threading.Condition(self._counts)
        self._running = 0
        self._capturing = False
        self._waiting_captures = 0
        self._run = _Run(self)  # holds no state of its own: one for all runs

    def shared(self) -> _Run:
        return self._run

    @contextlib.contextmanager
    def alone(self):
        with self._counts:
            self._waiting_captures += 1
            self._changed.wait_for(self._capture_may_start)
            self._waiting_captures -= 1
            self._capturing = True
        try:
            yield
        finally:
            with self._counts:
                self._capturing = False
                self._changed.notify_all()  # the runs and captures that waited for it

    def around(self, capturing: bool):
        """``alone()`` for a call that may capture, else ``shared()``."""
        return self.alone() if capturing else self._run

    def _run_may_start(self) -> bool:
        return not self._capturing and not self._waiting_captures

    def _capture_may_start(self) -> bool:
        return not self._capturing and not self._running


class _Run:
    """``CaptureLock.shared()``: a plain class, not a generator, as it is on every call's path.
    Only a capture waits on the count of runs, and only for it to reach 0, so a run that ends
    wakes the waiters only then, and only when a capture waits."""

    def __init__(self, lock: CaptureLock):
        self._lock = lock

    def __enter__(self) -> None:
        lock = self._lock
        with lock._counts:
            if not lock._run_may_start():
                lock._changed.wait_for(lock._run_may_start)
            lock._running += 1

    def __exit__(self, *exc) -> None:
        lock = self._lock
        with lock._counts:
            lock._running -= 1
            if not lock._running and lock._waiting_captures:
                lock._changed.notify_all()


#: The process's one lock: every runner that puts work on a GPU takes it.
GPU_WORK = CaptureLock()
