"""The most a serving model process can deliver from a bundle, without HTTP: rows/s of batches run
the way ``deploykit serve``'s batcher runs them (``batching.run_rows``: B one-row requests
concatenated, on a GPU in page-locked staging, run, split back per request), by T threads each
with a runner of its own (``serve --instances T``), for S seconds each. Set beside perf_analyzer's
numbers, it says how much of a server's shortfall is around the model process and how much in it.

    python benchmarks/serve_ceiling.py BUNDLE [--device cuda:0] [--batch 32] [--threads 1,2] [--seconds 5]

Prints one markdown row per thread count: rows/s, batches/s and the median time of one batch.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from deploykit.backends.base.feeds import random_inputs
from deploykit.serving.batching import run_rows
from deploykit.serving.models import ServeOptions, load_models
from deploykit.serving.staging import PinnedStaging


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--batch", type=int, default=32, help="rows per batch, each its own one-row request")
    parser.add_argument("--threads", default="1,2", help="comma list: runners run side by side, one thread each")
    parser.add_argument("--seconds", type=float, default=5.0, help="per thread count, after one warm-up batch")
    args = parser.parse_args()
    print("| threads | rows/s | batches/s | ms per batch (p50) |\n| ---: | ---: | ---: | ---: |")
    for threads in (int(t) for t in args.threads.split(",")):
        options = ServeOptions(devices=(args.device,), instances=threads)
        model = load_models([args.bundle], options)[0]
        requests = [random_inputs(model.inputs, 1, seed=row) for row in range(args.batch)]
        times: list[list[float]] = [[] for _ in range(threads)]
        start = threading.Barrier(threads + 1)
        threads_run = [threading.Thread(target=_loop, args=(model, runner, requests, args.seconds, start, spent))
                       for runner, spent in zip(model.runners, times)]
        for thread in threads_run:
            thread.start()
        start.wait()
        began = time.perf_counter()
        for thread in threads_run:
            thread.join()
        elapsed = time.perf_counter() - began
        batches = sum(len(spent) for spent in times)
        median_ms = statistics.median(t for spent in times for t in spent) * 1e3
        print(f"| {threads} | {batches * args.batch / elapsed:,.0f} | {batches / elapsed:,.1f} | {median_ms:.2f} |",
              flush=True)
        for runner in model.runners:
            runner.close()


def _loop(model, runner, requests, seconds: float, start: threading.Barrier, spent: list[float]) -> None:
    staging = PinnedStaging.for_runner(runner)
    rows = [1] * len(requests)
    run_rows(model, runner, requests, rows, staging)  # warm-up: allocations, graphs
    start.wait()
    deadline = time.perf_counter() + seconds
    while (began := time.perf_counter()) < deadline:
        run_rows(model, runner, requests, rows, staging)
        spent.append(time.perf_counter() - began)


if __name__ == "__main__":
    main()
