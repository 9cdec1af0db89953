"""Starting and stopping: uvicorn over the app, and a graceful stop on SIGTERM or Ctrl-C.

On a signal uvicorn stops accepting connections and waits for the requests it has (each waits
for its batch), then the app's shutdown lets the workers finish anything still queued. A server
stopped that way has done its job: it exits 0. One whose GPU's CUDA context is lost stops the same
way, then exits 3 with the reason (``gpu_health``).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from pathlib import Path

from deploykit.errors import EnvironmentProblem

EXTRA_HINT = "pip install 'deploykit[serve]'"


def require_serving_packages(grpc: bool = False) -> None:
    """FastAPI, uvicorn, prometheus-client and joblib (and for ``grpc`` grpcio and tritonclient's generated
    KServe messages), or one line saying how to get them (exit 3)."""
    missing = []
    for module, package in (("fastapi", "fastapi"), ("uvicorn", "uvicorn"), ("prometheus_client", "prometheus-client"),
                            ("joblib", "joblib"),
                            *((("grpc", "grpcio"), ("tritonclient.grpc", "tritonclient[grpc]")) if grpc else ())):
        try:
            __import__(module)
        except (ImportError, RuntimeError):  # tritonclient.grpc without grpcio raises RuntimeError
            missing.append(package)
    if missing:
        raise EnvironmentProblem(f"deploykit serve needs {', '.join(missing)}: {EXTRA_HINT}")


def configure_logging(access_log: bool) -> None:
    """Access lines (JSON) and server messages on stderr, one per line."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name, level in (("deploykit.serve.access", logging.INFO if access_log else logging.WARNING),
                        ("deploykit.serve", logging.INFO), ("uvicorn.error", logging.INFO)):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False


def serve(models, limits, host: str = "127.0.0.1", port: int = 8000, *, access_log: bool = True,
          on_started=None, on_ready=None, sockets=None, batcher_for=None, grpc_address: str | None = None) -> None:
    """Serve ``models`` until SIGTERM or SIGINT; every accepted request is answered before it returns.
    ``on_started(url)`` once it listens, ``on_ready()`` once every runner is warm; ``sockets``: listen on
    these instead of host:port, ``batcher_for``: send requests to the model process (a worker of
    ``serve --workers``), ``grpc_address``: answer gRPC there too (``grpc_service.reserve_port`` holds it).
    EnvironmentProblem after the stop when a GPU's CUDA context was lost or gRPC could not start."""
    import uvicorn

    from deploykit.serving.app import create_app
    from deploykit.serving.batching import Batcher

    configure_logging(access_log)
    problems: list[str] = []

    def stop_failed(message: str) -> None:  # stop as on SIGTERM, then say why
        problems.append(message)
        server.should_exit = True

    def stop_lost(message: str) -> None:  # a GPU's CUDA context is lost
        logging.getLogger("deploykit.serve").critical(message)
        stop_failed(message)

    if batcher_for is None:
        def batcher_for(model, metrics):
            return Batcher(model, limits.max_delay_ms / 1e3, limits.max_queue, metrics, on_lost=stop_lost)
    app = create_app(models, limits, on_ready, batcher_for, grpc_address, on_failed=stop_failed)
    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=max(limits.timeout_s, 1.0) + 5, server_header=False)
    server = uvicorn.Server(config)
    if on_started is not None:
        _call_when_started(server, on_started)
    with _signals_end_quietly():
        server.run(sockets)
    if problems:
        raise EnvironmentProblem(problems[0])


def _call_when_started(server, on_started) -> None:
    """``on_started(url)`` once the socket listens (with port 0, the port the system chose)."""
    startup = server.startup

    async def started(sockets=None):
        await startup(sockets)
        if server.started and not server.should_exit:  # not when startup failed (gRPC's port)
            host, port = server.servers[0].sockets[0].getsockname()[:2]
            on_started(f"http://{host}:{port}")

    server.startup = started


@contextlib.contextmanager
def _signals_end_quietly():
    """uvicorn re-raises the signal that stopped it once it has shut down; here that ends nothing more."""
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def model_summary(model) -> str:
    runner = model.runner
    where = [f"cuda:{gpu}" for gpu in sorted(set(model.gpus))] if model.gpus is not None else [runner.device]
    batching = (f"batches up to {model.max_batch}" + (f", buckets {model.buckets}" if model.buckets else "")
                if model.batching else "no batching (static batch)")
    halves = f" and {len(model.halves)} on half the cores each" if model.halves else ""
    return (f"{model.name}: {Path(model.path)} on {runner.backend} ({', '.join(where)}), "
            f"{len(model.runners)} instance(s){halves}, {batching}")
