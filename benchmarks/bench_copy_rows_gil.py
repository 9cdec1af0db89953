"""How long assembling one batch takes while another thread runs Python: ``np.concatenate`` (which
lets go of the GIL once per row) against ``staging.copy_rows`` (which keeps it), with and without a
thread spinning in Python beside them (the event loop or pipe reader of a busy server, at worst).

    python benchmarks/bench_copy_rows_gil.py [--rows 32] [--shape 3,224,224] [--repeats 30]

Prints one markdown row per copy and condition: the median and worst milliseconds of one batch.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np

from deploykit.serving.staging import copy_rows


def timed(copy, repeats: int, beside_python: bool) -> list[float]:
    """Milliseconds of each of ``repeats`` copies, with a thread running Python meanwhile when asked."""
    stop = threading.Event()

    def spin():
        count = 0
        while not stop.is_set():
            count += 1

    spinner = threading.Thread(target=spin)
    if beside_python:
        spinner.start()
    times = []
    try:
        for _ in range(repeats):
            started = time.perf_counter()
            copy()
            times.append((time.perf_counter() - started) * 1e3)
    finally:
        stop.set()
        if beside_python:
            spinner.join()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32, help="one-row requests in the batch")
    parser.add_argument("--shape", default="3,224,224", help="one row's shape (float32)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    shape = tuple(int(size) for size in args.shape.split(","))
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((1, *shape)).astype(np.float32) for _ in range(args.rows)]
    out = np.empty((args.rows, *shape), np.float32)
    copies = {"np.concatenate": lambda: np.concatenate(parts, out=out), "copy_rows": lambda: copy_rows(parts, out)}
    print(f"{args.rows} rows of {shape} float32\n\n| copy | beside a Python thread | median ms | worst ms |\n"
          "| --- | --- | ---: | ---: |")
    for name, copy in copies.items():
        for beside_python in (False, True):
            times = timed(copy, args.repeats, beside_python)
            print(f"| {name} | {'yes' if beside_python else 'no'} | {statistics.median(times):.3f} | {max(times):.3f} |")


if __name__ == "__main__":
    main()
