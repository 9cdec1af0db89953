"""``deploykit serve --workers N``: N server processes answering on one listening socket.

One Python process parses HTTP, decodes tensors and encodes answers on one core: for a large
model input (a 224x224 image is 600 KB) that bounds it at about a thousand requests a second,
far below what a GPU computes. Each worker is a whole server (its own event loop, batchers and
runners, every bundle loaded once per worker), and the kernel hands each new connection to a
worker that is accepting. The parent binds the socket, starts the workers (spawned: a CUDA
context does not survive fork), says the server is up once every worker is warm, forwards
SIGTERM and SIGINT, and exits 0 once every worker has shut down gracefully.

Metrics are shared through prometheus-client's multiprocess mode: each worker writes its
values to files in one folder, and ``/metrics`` answered by any worker sums them all.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time

from deploykit.errors import EXIT_INTERNAL, DeployKitError, EnvironmentProblem
from deploykit.serving.metrics import MULTIPROCESS_DIR


def serve_in_workers(paths, options, limits, host: str, port: int, workers: int, *, access_log: bool = True,
                     on_loaded=None, on_started=None) -> int:
    """Serve the bundles at ``paths`` from ``workers`` processes until SIGTERM or SIGINT; the exit code:
    0 after a graceful stop, else the code of the first worker that failed (its error on stderr).
    ``on_loaded(models)`` with the first worker's models described (name, notes, summary),
    ``on_started(url)`` once every worker is warm."""
    listening = _listen(host, port)
    metrics_dir = tempfile.mkdtemp(prefix="deploykit-serve-metrics-")
    os.environ[MULTIPROCESS_DIR] = metrics_dir  # before the workers import prometheus-client
    context = multiprocessing.get_context("spawn")
    events = context.Queue()
    processes = [context.Process(target=_worker, name=f"deploykit-serve-{index}", daemon=False,
                                 args=(index, paths, options, limits, listening, access_log, events))
                 for index in range(workers)]
    stopping = {"signal": None}
    previous = {sig: signal.signal(sig, lambda number, _frame: stopping.update(signal=number))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for process in processes:
            process.start()
        code = _until_ready(processes, events, stopping, on_loaded)
        if code is None and on_started is not None:
            address, bound = listening.getsockname()[:2]
            on_started(f"http://{address}:{bound}")
        while code is None and stopping["signal"] is None and all(p.is_alive() for p in processes):
            time.sleep(0.2)
        return _stop(processes, code, limits.timeout_s + 10)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        listening.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as error:
        raise EnvironmentProblem(f"cannot listen on {host}:{port} ({error.strerror or error}): choose another "
                                 "--port or --host") from None


def _until_ready(processes, events, stopping, on_loaded) -> int | None:
    """Wait for every worker's 'ready'; the exit code of one that failed first (None: all ready)."""
    waiting = set(range(len(processes)))
    while waiting and stopping["signal"] is None:
        try:
            index, code, described = events.get(timeout=0.2)
        except queue.Empty:
            dead = [p for p in processes if p.exitcode is not None]
            if dead:
                return dead[0].exitcode or EXIT_INTERNAL  # died without a word (a crash): a bug
            continue
        if code is not None:
            return code
        if index == 0 and on_loaded is not None:
            on_loaded(described)
        waiting.discard(index)
    return None


def _stop(processes, code: int | None, timeout_s: float) -> int:
    """SIGTERM to every live worker (each answers what it accepted first), then the exit code."""
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():  # stuck past the graceful timeout
            process.kill()
            process.join()
    if code is not None:
        return code
    return next((p.exitcode for p in processes if p.exitcode), 0)


def _worker(index: int, paths, options, limits, listening: socket.socket, access_log: bool, events) -> None:
    """One worker: load every bundle, serve on the inherited socket, report ready (or its error's exit code)."""
    from deploykit.serving.models import load_models
    from deploykit.serving.server import model_summary, serve

    try:
        models = load_models(paths, options)
    except DeployKitError as error:
        print(f"error: worker {index}: {error}", file=sys.stderr, flush=True)
        events.put((index, error.exit_code, None))
        sys.exit(error.exit_code)
    described = [(model.name, model.notes, model_summary(model)) for model in models]
    serve(models, limits, access_log=access_log, sockets=[listening],
          on_ready=lambda: events.put((index, None, described)))
