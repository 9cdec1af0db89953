"""The process's GPU lock: a CUDA graph capture runs alone, runs share (backends.base.capture)."""

from __future__ import annotations

import threading
import time

from deploykit.backends.base.capture import CaptureLock


def _in_thread(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def _held_run(lock: CaptureLock, events: list, ending: str | None = None):
    """A run inside the lock until the returned event is set (``ending`` recorded as it ends)."""
    started, release = threading.Event(), threading.Event()

    def run():
        with lock.shared():
            started.set()
            release.wait(5)
            if ending:
                events.append(ending)

    thread = _in_thread(run)
    started.wait(5)
    return thread, release


def _later_run(lock: CaptureLock, events: list):
    def run():
        with lock.shared():
            events.append("later run")

    return _in_thread(run)


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

    def capture():
        with lock.alone():
            events.append("capture")
            time.sleep(0.05)
            events.append("capture ends")

    first, release_run = _held_run(lock, events, "first run ends")
    capturing = _in_thread(capture)
    time.sleep(0.05)  # the capture is waiting now: a run that comes after it must wait too
    later = _later_run(lock, events)
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


def test_a_capture_starts_when_the_last_of_its_runs_ends():
    """A run that ends wakes a waiting capture only once no run is left (the one wake-up a run gives)."""
    lock, events, inside = CaptureLock(), [], threading.Barrier(3, timeout=5)
    release = [threading.Event(), threading.Event()]

    def run(index):
        with lock.shared():
            inside.wait()
            release[index].wait(5)
            events.append(f"run {index} ends")

    def capture():
        with lock.alone():
            events.append("capture")

    runs = [_in_thread(lambda index=index: run(index)) for index in range(2)]
    inside.wait()
    capturing = _in_thread(capture)
    release[0].set()
    runs[0].join(5)
    time.sleep(0.05)
    assert events == ["run 0 ends"]  # one run left: the capture still waits
    release[1].set()
    for thread in (runs[1], capturing):
        thread.join(5)
    assert events == ["run 0 ends", "run 1 ends", "capture"]


def test_captures_waiting_together_take_turns_before_any_later_run():
    lock, events = CaptureLock(), []

    def capture(index):
        with lock.alone():
            events.append(f"capture {index}")
            time.sleep(0.02)
            events.append(f"capture {index} ends")

    first, release_run = _held_run(lock, events)
    captures = [_in_thread(lambda index=index: capture(index)) for index in range(2)]
    time.sleep(0.05)
    later = _later_run(lock, events)
    time.sleep(0.05)
    release_run.set()
    for thread in (first, *captures, later):
        thread.join(5)
    first_capture, second_capture = events[0], events[2]
    assert events == [first_capture, f"{first_capture} ends", second_capture, f"{second_capture} ends", "later run"]
    assert {first_capture, second_capture} == {"capture 0", "capture 1"}
