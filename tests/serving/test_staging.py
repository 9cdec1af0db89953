"""Assembling a batch from its requests' rows: exactly ``np.concatenate``'s result, without letting
another thread take the GIL between rows (which under load makes the batch wait on every row)."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

from deploykit.serving.staging import copy_rows


def images(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, 3, 64, 64)).astype(np.float32)


def test_rows_land_in_order_whatever_their_layout():
    strided = images(4, 3)[::2]  # not contiguous: numpy copies it
    parts = [images(1, 0), images(3, 1), np.float64(1.5) * images(2, 2).astype(np.float64), strided,
             np.ones((1, 3, 64, 64), np.float32)[:, :, :, :]]
    out = np.full((sum(p.shape[0] for p in parts), 3, 64, 64), np.nan, np.float32)
    copy_rows(parts, out)
    np.testing.assert_array_equal(out, np.concatenate(parts).astype(np.float32))


def test_small_rows_and_integers():
    parts = [np.arange(128 * k, dtype=np.int64).reshape(k, 128) for k in (1, 2, 1)]
    out = np.empty((4, 128), np.int64)
    copy_rows(parts, out)
    np.testing.assert_array_equal(out, np.concatenate(parts))


@pytest.mark.parametrize("parts, shape", [
    ([np.zeros((1, 1), np.float32)], (1, 4)),  # would broadcast
    ([np.zeros((2, 4), np.float32)], (3, 4)),  # too few rows
])
def test_rows_that_do_not_fit_are_refused(parts, shape):
    with pytest.raises(ValueError, match="do not make a batch"):
        copy_rows(parts, np.empty(shape, np.float32))


def counted_while(copy) -> int:
    """How often a thread that lets go of the GIL at every step ran while ``copy()`` ran; with a long
    switch interval it runs only when the copying thread lets go of the GIL itself."""
    steps, stop = [0], threading.Event()

    def step():
        while not stop.is_set():
            steps[0] += 1
            time.sleep(0)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    thread = threading.Thread(target=step)
    thread.start()
    try:
        time.sleep(0.01)
        before = steps[0]
        copy()
        during = steps[0] - before
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    return during


def test_copying_keeps_the_gil_where_numpy_lets_it_go():
    parts = [np.random.default_rng(i).standard_normal((1, 3, 224, 224)).astype(np.float32) for i in range(32)]
    out = np.empty((32, 3, 224, 224), np.float32)
    assert counted_while(lambda: copy_rows(parts, out)) == 0  # np.concatenate lets it go 32 times
    np.testing.assert_array_equal(out, np.concatenate(parts))
