"""How many requests a second the model process behind ``deploykit serve --workers`` can take, without HTTP.

``serve --workers N`` puts N HTTP workers in front of one model process (``serving.model_host``), which
receives every request through a pipe and shared memory, batches them, runs them and sends the answers back.
Its Python threads share one GIL. On a GPU host, where the workers and the cores are not spent, that process
is what limits the requests a second. This script measures it alone. The real model process serves BUNDLE.
C client processes each stand in for an HTTP worker: each runs the worker's real ``HostLink`` on an event
loop and keeps F requests of one row each in flight, with no parsing. Give a near-free model
(``ab_serve.sh``'s pool bundle) to see the model process's own cost per request:

    python benchmarks/model_process_ceiling.py BUNDLE [--clients 1] [--in-flight 64] [--seconds 10] [--rounds 3]

Prints one row per round: requests/s, and the CPU each process used in that time (100 % = one core).
Where the model process is near 100 % and the clients are not, the model process is the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path

from deploykit.serving.app import Limits
from deploykit.serving.models import ServeOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--clients", type=int, default=1, help="processes standing in for HTTP workers")
    parser.add_argument("--in-flight", type=int, default=64, help="requests each client keeps outstanding")
    parser.add_argument("--seconds", type=float, default=10.0, help="per round, after a 2 s warm-up")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from deploykit.serving.model_host import run_model_process

    buffers = Path(tempfile.mkdtemp(prefix="dk-ceiling-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    context = multiprocessing.get_context("spawn")
    events, results = context.Queue(), context.Queue()
    pipes = [context.Pipe() for _ in range(args.clients)]
    options = ServeOptions(devices=(args.device,), instances=args.instances, max_batch=args.max_batch)
    host = context.Process(target=run_model_process, args=([args.bundle], options, Limits(max_queue=1 << 16),
                                                           [ours for ours, _ in pipes], events))
    clients = [context.Process(target=_client, args=(index, theirs, buffers, args, results))
               for index, (_, theirs) in enumerate(pipes)]
    try:
        host.start()
        for client in clients:
            client.start()
        for pipe in pipes:
            for end in pipe:
                end.close()
        _, code, _ = events.get(timeout=300)
        if code is not None:
            raise SystemExit(f"the model process failed to load {args.bundle} (exit {code})")
        pids = {"model process": host.pid, **{f"client {i}": c.pid for i, c in enumerate(clients)}}
        print("| round | requests/s | " + " | ".join(f"{name} CPU %" for name in pids) + " |")
        print("| ---: | ---: | " + " | ".join("---:" for _ in pids) + " |")
        for round_ in range(1, args.rounds + 1):
            cpu_before, began = {name: _cpu_seconds(pid) for name, pid in pids.items()}, time.perf_counter()
            answered = sum(results.get(timeout=args.seconds + 60) for _ in clients)
            elapsed = time.perf_counter() - began
            cpu = [100 * (_cpu_seconds(pid) - cpu_before[name]) / elapsed for name, pid in pids.items()]
            print(f"| {round_} | {answered / elapsed:,.0f} | " + " | ".join(f"{c:.0f}" for c in cpu) + " |", flush=True)
    finally:
        for client in clients:
            client.join(timeout=30)
        host.join(timeout=30)
        for process in [*clients, host]:
            if process.is_alive():
                process.kill()
        shutil.rmtree(buffers, ignore_errors=True)


def _client(index: int, connection, buffers: Path, args, results) -> None:
    """One stand-in HTTP worker: the models from the model process, then rounds of requests in flight."""
    from deploykit.backends.base.feeds import random_inputs
    from deploykit.serving.model_host import HostLink

    model = connection.recv()[0]
    link = HostLink(connection, buffers, f"c{index}")
    inputs = random_inputs(model.inputs, 1, seed=index)

    async def rounds() -> None:
        batcher = link.batcher(model, None)

        async def caller(until: float, counts: list[int]) -> None:
            while time.perf_counter() < until:
                await asyncio.wrap_future(batcher.submit(inputs, 1))
                counts[0] += 1

        await asyncio.gather(*(caller(time.perf_counter() + 2.0, [0]) for _ in range(args.in_flight)))  # warm-up
        for _ in range(args.rounds):
            counts = [0]
            until = time.perf_counter() + args.seconds
            await asyncio.gather(*(caller(until, counts) for _ in range(args.in_flight)))
            results.put(counts[0])

    try:
        asyncio.run(rounds())
    finally:
        link.close()
        connection.close()


def _cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of every thread of ``pid`` so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
