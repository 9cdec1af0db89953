"""The process's GPU lock: a CUDA graph capture runs alone, runs share (backends.base.capture)."""

from __future__ import annotations

import threading
import time

from deploykit.backends.base.capture import CaptureLock


def _in_thread(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_runs_share_the_lock():
    lock, both_inside = CaptureLock(), threading.Barrier(2, timeout=5)

    def run():
        with lock.shared():
            both_inside.wait()  # breaks (BrokenBarrierError) unless the two runs overlap

    threads = [_in_thread(run) for _ in range(2)]
    for thread in threads:
        thread.join(5)
    assert not both_inside.broken and all(not t.is_alive() for t in threads)


def test_a_capture_waits_for_running_calls_and_holds_back_new_ones():
    lock, events = CaptureLock(), []
    run_started, release_run = threading.Event(), threading.Event()

    def long_run():
        with lock.shared():
            run_started.set()
            release_run.wait(5)
            events.append("first run ends")

    def capture():
        with lock.alone():
            events.append("capture")
            time.sleep(0.05)
            events.append("capture ends")

    def later_run():
        with lock.shared():
            events.append("later run")

    first = _in_thread(long_run)
    run_started.wait(5)
    capturing = _in_thread(capture)
    time.sleep(0.05)  # the capture is waiting now: a run that comes after it must wait too
    later = _in_thread(later_run)
    time.sleep(0.05)
    assert events == []
    release_run.set()
    for thread in (first, capturing, later):
        thread.join(5)
    assert events == ["first run ends", "capture", "capture ends", "later run"]


def test_around_picks_alone_only_for_a_call_that_may_capture():
    lock, inside = CaptureLock(), threading.Event()

    def capture():
        with lock.around(True):
            inside.set()
            time.sleep(0.1)

    thread = _in_thread(capture)
    inside.wait(5)
    started = time.perf_counter()
    with lock.around(False):
        waited = time.perf_counter() - started
    thread.join(5)
    assert waited > 0.03
