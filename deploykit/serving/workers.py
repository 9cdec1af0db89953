"""``deploykit serve --workers N``: N HTTP worker processes on one listening socket, in front of
one model process (``model_host``: why, and how requests travel between them).

The parent binds the socket, starts the model process and the workers (spawned: a CUDA context
does not survive fork), says the server is up once the models are warm and every worker listens,
forwards SIGTERM and SIGINT to the workers, and exits 0 once they and then the model process have
shut down gracefully (the workers answer what they accepted; the model process finishes once every
worker has closed its pipe). The kernel hands each new connection to a worker that is accepting.

Metrics are shared through prometheus-client's multiprocess mode: each process writes its values
to files in one folder (the workers their requests, the model process its batches and queues), and
``/metrics`` answered by any worker sums them all.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from deploykit.errors import EXIT_INTERNAL, DeployKitError, EnvironmentProblem
from deploykit.serving.metrics import MULTIPROCESS_DIR


def serve_in_workers(paths, options, limits, host: str, port: int, workers: int, *, access_log: bool = True,
                     on_loaded=None, on_started=None, grpc_address: str | None = None) -> int:
    """Serve the bundles at ``paths`` from ``workers`` HTTP processes and one model process until SIGTERM
    or SIGINT; the exit code: 0 after a graceful stop, else the code of the first process that failed
    (its error on stderr). ``on_loaded(models)`` with the models described (name, notes, summary),
    ``on_started(url)`` once the models are warm and every worker listens; ``grpc_address``: every
    worker answers gRPC there too (a port ``grpc_service.reserve_port`` holds)."""
    from deploykit.serving.model_host import run_model_process

    listening = _listen(host, port)
    metrics_dir = tempfile.mkdtemp(prefix="deploykit-serve-metrics-")
    os.environ[MULTIPROCESS_DIR] = metrics_dir  # before the processes import prometheus-client
    buffers = _buffers_folder()
    context = multiprocessing.get_context("spawn")
    events = context.Queue()
    pipes = [context.Pipe() for _ in range(workers)]
    model_process = context.Process(target=run_model_process, name="deploykit-serve-models", daemon=False,
                                     args=(paths, options, limits, [ours for ours, _ in pipes], events))
    processes = [context.Process(target=_worker, name=f"deploykit-serve-{index}", daemon=False,
                                 args=(index, limits, theirs, buffers, listening, access_log, events, grpc_address))
                 for index, (_, theirs) in enumerate(pipes)]
    stopping = {"signal": None}
    previous = {sig: signal.signal(sig, lambda number, _frame: stopping.update(signal=number))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for process in [model_process, *processes]:
            process.start()
        for pipe in pipes:  # the children hold them now; the model process sees a worker's end close with it
            for end in pipe:
                end.close()
        code = _until_ready(model_process, processes, events, stopping, on_loaded)
        if code is None and on_started is not None:
            address, bound = listening.getsockname()[:2]
            on_started(f"http://{address}:{bound}")
        while (code is None and stopping["signal"] is None
               and all(p.is_alive() for p in [model_process, *processes])):
            time.sleep(0.2)
        return _stop(model_process, processes, code, limits.timeout_s + 10)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        listening.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        if buffers is not None:
            shutil.rmtree(buffers, ignore_errors=True)


def _buffers_folder() -> Path | None:
    """A folder for the request buffers on the RAM disk (else the temporary folder's disk, slower)."""
    for parent in ("/dev/shm", None):
        with contextlib.suppress(OSError):
            return Path(tempfile.mkdtemp(prefix="deploykit-serve-", dir=parent))
    return None


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as error:
        raise EnvironmentProblem(f"cannot listen on {host}:{port} ({error.strerror or error}): choose another "
                                 "--port or --host") from None


def _until_ready(model_process, processes, events, stopping, on_loaded) -> int | None:
    """Wait for the model process's and every worker's 'ready'; the exit code of one that failed
    first (None: all ready)."""
    waiting = {"models", *range(len(processes))}
    while waiting and stopping["signal"] is None:
        try:
            who, code, described = events.get(timeout=0.2)
        except queue.Empty:
            dead = [p for p in [model_process, *processes] if p.exitcode is not None]
            if dead:
                return dead[0].exitcode or EXIT_INTERNAL  # died without a word (a crash): a bug
            continue
        if code is not None:
            return code
        if who == "models" and on_loaded is not None:
            on_loaded(described)
        waiting.discard(who)
    return None


def _stop(model_process, processes, code: int | None, timeout_s: float) -> int:
    """SIGTERM to every live worker (each answers what it accepted first), then the model process
    finishes its queue and exits once their pipes close; the exit code."""
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in [*processes, model_process]:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():  # stuck past the graceful timeout
            process.kill()
            process.join()
    if code is not None:
        return code
    return next((p.exitcode for p in [model_process, *processes] if p.exitcode), 0)


def _worker(index: int, limits, connection, buffers: Path | None, listening: socket.socket, access_log: bool,
            events, grpc_address: str | None) -> None:
    """One HTTP worker: the models' descriptions from the model process (once they are warm), then serve
    on the inherited socket and report ready. The model process's failure ends it quietly (it said why)."""
    from deploykit.serving.model_host import HostLink
    from deploykit.serving.server import serve

    try:
        models = connection.recv()
    except (EOFError, OSError):
        sys.exit(0)
    link = HostLink(connection, buffers, f"w{index}")
    try:
        serve(models, limits, access_log=access_log, sockets=[listening], batcher_for=link.batcher,
              on_ready=lambda: events.put((index, None, None)), grpc_address=grpc_address)
    except DeployKitError as error:  # its gRPC server could not start: the server stops with its code
        print(f"error: {error}", file=sys.stderr, flush=True)
        events.put((index, error.exit_code, None))
        sys.exit(error.exit_code)
    finally:
        link.close()
