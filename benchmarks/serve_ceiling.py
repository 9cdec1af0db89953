"""The most a serving model process can deliver from a bundle, without HTTP: rows/s of batches run
the way ``deploykit serve``'s batcher runs them (``batching.run_rows``: B one-row requests
concatenated, on a GPU in page-locked staging, run, split back per request), by T threads each
with a runner of its own (``serve --instances T``), for S seconds each. Set beside perf_analyzer's
numbers, it says how much of a server's shortfall is around the model process and how much in it.

With ``--shared-memory`` the requests lie as ``serve --workers``'s model process finds them: each
in a shared-memory buffer of its own, page-locked (``staging.HostRegistry``), batched by
``staging.DeviceStaging``, and each answer handed to the ``model_host.Outbox`` that sends it to its
worker (here to nobody), which writes large answers into the request's buffer.

    python benchmarks/serve_ceiling.py BUNDLE [--device cuda:0] [--batch 5,32] [--threads 1,2] [--seconds 5]
        [--shared-memory]

Prints one markdown row per batch size and thread count: rows/s, batches/s and the median time of one
batch (run_rows alone; the Outbox works beside it, on its own thread, as in the model process).
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from deploykit.backends.base.feeds import random_inputs
from deploykit.serving.batching import run_rows
from deploykit.serving.models import ServeOptions, load_models
from deploykit.serving.staging import ALIGN, PinnedStaging


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--batch", default="32", help="comma list: rows per batch, each its own one-row request")
    parser.add_argument("--threads", default="1,2", help="comma list: runners run side by side, one thread each")
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement, after one warm-up batch")
    parser.add_argument("--shared-memory", action="store_true",
                        help="requests in page-locked shared memory, answers through the Outbox (serve --workers)")
    args = parser.parse_args()
    print("| batch | threads | rows/s | batches/s | ms per batch (p50) |\n| ---: | ---: | ---: | ---: | ---: |")
    for threads in (int(t) for t in args.threads.split(",")):
        options = ServeOptions(devices=(args.device,), instances=threads)
        model = load_models([args.bundle], options)[0]
        for batch in (int(b) for b in args.batch.split(",")):
            with _requests(model, batch, threads, args.shared_memory) as per_thread:
                batches, elapsed, median = _measure(model, per_thread, args.seconds)
            print(f"| {batch} | {threads} | {batches * batch / elapsed:,.0f} | {batches / elapsed:,.1f} | "
                  f"{median * 1e3:.2f} |", flush=True)
        for runner in model.runners:
            runner.close()


@contextlib.contextmanager
def _requests(model, batch: int, threads: int, shared: bool):
    """Per thread: its runner, ``batch`` one-row requests, their buffers (shared memory) or None, the
    staging and the Outbox its answers go to (None without shared memory)."""
    gpus = model.gpus or [None] * len(model.runners)
    if not shared:
        yield [(runner, [random_inputs(model.inputs, 1, seed=row) for row in range(batch)], None,
                PinnedStaging.for_runner(runner, gpu), None) for runner, gpu in zip(model.runners, gpus)]
        return
    import torch

    from deploykit.serving.model_host import Outbox
    from deploykit.serving.staging import DeviceStaging, HostRegistry

    folder = tempfile.mkdtemp(prefix="dk-ceiling-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    registry, outbox, every = HostRegistry(torch, model.gpus[0]), Outbox(), []
    try:
        per_thread = []
        for index, runner in enumerate(model.runners):
            memories = [_shared_buffer(folder, f"{index}-{row}") for row in range(batch)]
            every += memories
            for memory in memories:
                registry.add(memory)
            requests = [_placed(random_inputs(model.inputs, 1, seed=row), memory) for row, memory in enumerate(memories)]
            staging = DeviceStaging.for_runner(runner, gpus[index], registry=registry)
            per_thread.append((runner, requests, memories, staging, outbox))
        yield per_thread
    finally:
        outbox.close()
        for memory in every:
            registry.remove(memory)
        for path in Path(folder).iterdir():
            path.unlink()
        os.rmdir(folder)


def _shared_buffer(folder: str, name: str, size: int = 1 << 20) -> mmap.mmap:
    """A request buffer as a worker makes them: a file on the RAM disk, mapped."""
    path = os.path.join(folder, name)
    with open(path, "wb") as file:
        file.truncate(size)
    with open(path, "r+b") as file:
        return mmap.mmap(file.fileno(), 0)


def _placed(inputs: dict[str, np.ndarray], memory: mmap.mmap) -> dict[str, np.ndarray]:
    """``inputs`` copied into ``memory``, ``ALIGN``-byte aligned, at its end: answers are written from its start
    (a worker's next request would bring new inputs; here the same ones are run again, so they must stay)."""
    placed, offset = {}, len(memory)
    for name, array in inputs.items():
        offset -= -(-array.nbytes // ALIGN) * ALIGN
        placed[name] = np.ndarray(array.shape, array.dtype, buffer=memory, offset=offset)
        placed[name][...] = array
    return placed


class _Nobody:
    """The Outbox's connection to a worker that is not there."""

    def send(self, _message) -> None:
        pass


def _measure(model, per_thread: list, seconds: float) -> tuple[int, float, float]:
    """Batches run by every thread in ``seconds`` after a warm-up batch each, the time, the median batch."""
    times: list[list[float]] = [[] for _ in per_thread]
    start = threading.Barrier(len(per_thread) + 1)
    threads = [threading.Thread(target=_loop, args=(model, *setup, seconds, start, spent))
               for setup, spent in zip(per_thread, times)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    return sum(map(len, times)), elapsed, statistics.median(t for spent in times for t in spent)


def _loop(model, runner, requests, memories, staging, outbox, seconds: float, start: threading.Barrier,
          spent: list[float]) -> None:
    rows, nobody = [1] * len(requests), _Nobody()
    _run(model, runner, requests, rows, staging, memories, outbox, nobody)  # warm-up: allocations, graphs
    start.wait()
    deadline = time.perf_counter() + seconds
    while (began := time.perf_counter()) < deadline:
        _run(model, runner, requests, rows, staging, memories, outbox, nobody)
        spent.append(time.perf_counter() - began)


def _run(model, runner, requests, rows, staging, memories, outbox, nobody) -> None:
    answers = run_rows(model, runner, requests, rows, staging)
    if outbox is not None:
        for request, (answer, memory) in enumerate(zip(answers, memories)):
            outbox.put(nobody, request, answer, memory)


if __name__ == "__main__":
    main()
