"""``deploykit serve | export triton``: bundles behind the Open Inference Protocol, or as a Triton repository."""

from __future__ import annotations

import contextlib
from pathlib import Path

import click

from deploykit.cli._common import (
    BUNDLE, EXISTING_FILE, allow_failed_option, console, handle_errors, trust_bundle_option, verbose_option,
)
from deploykit.cli._printing import print_notes


def _workers_count(_context, _param, value: str) -> int | None:
    """``--workers``: a count of at least 1, or None for auto (decided once the devices are known)."""
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise click.BadParameter(f"{value!r}: use auto or a count of 1 or more")
    return int(value)


@click.command("serve")
@click.argument("bundles", type=BUNDLE, nargs=-1, required=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port (0: any free one).")
@click.option("--grpc-port", type=click.IntRange(0, 65535),
              help="Also answer the KServe v2 gRPC protocol on this port (Triton's is 8001; 0: any free one).")
@click.option("--backend", type=click.Choice(["auto", "onnxruntime", "tensorrt", "openvino"]), default="auto",
              show_default=True,
              help="How deploykit.load runs each bundle.")
@click.option("--device", "devices", multiple=True, metavar="auto|cpu|cuda|cuda:N[,...]",
              help="Where instances run: cuda is every visible GPU, cuda:N one, a comma list (or the option "
                   "repeated) several; instance i runs on device i mod their count (default: auto, "
                   "deploykit.load's choice: GPU 0 or the CPU).")
@click.option("--instances", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runners per model, each with its own worker thread.")
@click.option("--workers", default="auto", show_default=True, metavar="auto|N", callback=_workers_count,
              help="HTTP processes on the one port, in front of one process that holds the models and batches "
                   "every worker's requests together, for a GPU, which one process cannot feed (auto: on a GPU "
                   "half the cores, at most 8; on a CPU 1, one process doing everything).")
@click.option("--threads", type=click.IntRange(min=1),
              help="ONNX Runtime's threads per instance (default: every core). On a CPU, --instances 2 --threads 1 "
                   "lets one batch compute while the next one forms.")
@click.option("--split-cores", is_flag=True,
              help="On a CPU with one ONNX Runtime instance: also load two runners on half the cores each, which "
                   "run two batches side by side while a full batch's rows wait or are on their way behind the one "
                   "starting (a lone batch still gets every core). More requests a second under heavy load; two "
                   "more copies of the model in memory.")
@click.option("--max-batch", type=click.IntRange(min=1), help="Rows per run (default: the bundle's maximum batch).")
@click.option("--max-delay-ms", type=click.FloatRange(min=0), default=2.0, show_default=True,
              help="How long the oldest queued request waits for others to join its batch.")
@click.option("--buckets", default="auto", show_default=True, metavar="auto|exact|validated|N,N,...",
              help="Batch sizes a run is padded to (auto: validated sizes on a GPU, exact rows on a CPU).")
@click.option("--max-queue", type=click.IntRange(min=1), default=256, show_default=True,
              help="Requests waiting per model before new ones get 503 with Retry-After.")
@click.option("--max-request-mb", type=click.FloatRange(min=0, min_open=True), default=64.0, show_default=True,
              help="Largest request body (413 above it).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="Seconds a request may wait for its answer (504 after).")
@click.option("--token-file", type=EXISTING_FILE, help="Require 'Authorization: Bearer <the file's token>' "
                                                      "(health endpoints stay open).")
@click.option("--allow-nan", is_flag=True, help="Pass NaN and infinite inputs to the model instead of refusing them.")
@click.option("--warmup-runs", type=click.IntRange(min=0), default=3, show_default=True,
              help="Runs of random inputs per instance at each bucket size before the server reports ready "
                   "(the first runs search algorithms and capture CUDA graphs); 0: none.")
@click.option("--no-access-log", is_flag=True, help="Do not log one JSON line per request.")
@allow_failed_option("Serve a bundle whose validation failed.")
@trust_bundle_option
@verbose_option()
def serve(bundles, host, port, grpc_port, backend, devices, instances, workers, threads, split_cores, max_batch,
          max_delay_ms, buckets, max_queue, max_request_mb, timeout_s, token_file, allow_nan, warmup_runs,
          no_access_log, allow_failed, trust_bundle, verbose):
    """Serve BUNDLES over HTTP (and gRPC) with the KServe v2 / Open Inference Protocol and dynamic batching.

    Each model is named after its bundle's folder. SIGTERM or Ctrl-C stops accepting requests,
    answers every accepted one, and exits 0; a GPU whose CUDA context is lost stops it with exit 3.
    """
    from deploykit.serving import server
    from deploykit.serving.models import ServeOptions, load_models

    with handle_errors(verbose), contextlib.ExitStack() as held:
        server.require_serving_packages(grpc=grpc_port is not None)
        from deploykit.serving.app import Limits

        token = _read_token(token_file) if token_file else None
        options = ServeOptions(backend=backend, devices=tuple(devices) or ("auto",), instances=instances,
                               max_batch=max_batch, buckets=buckets, allow_nan=allow_nan,
                               trust_native=trust_bundle, allow_failed=allow_failed, warmup_runs=warmup_runs,
                               threads=threads, split_cores=split_cores)
        limits = Limits(max_request_bytes=int(max_request_mb * (1 << 20)), max_queue=max_queue, timeout_s=timeout_s,
                        max_delay_ms=max_delay_ms, token=token)
        if workers is None:
            from deploykit.bundle.read import open_bundle
            from deploykit.serving.placement import auto_workers

            workers = auto_workers(options.devices, options.backend, (open_bundle(path) for path in bundles),
                                   trust_bundle)  # the manifests are read only for --device auto
        grpc_address = None
        if grpc_port is not None:
            from deploykit.serving import grpc_service

            grpc_address = grpc_service.address_of(held.enter_context(grpc_service.reserve_port(host, grpc_port)))
        how = (f", gRPC at {grpc_address}" if grpc_address else "") + (f", {workers} workers" if workers > 1 else "")
        if workers > 1:
            from deploykit.serving.workers import serve_in_workers

            code = serve_in_workers(list(bundles), options, limits, host, port, workers,
                                    access_log=not no_access_log, on_loaded=_print_models,
                                    on_started=lambda url: _print_started(url, how), grpc_address=grpc_address)
            raise SystemExit(code)
        models = load_models(list(bundles), options)
        _print_models([(model.name, model.notes, server.model_summary(model)) for model in models])
        server.serve(models, limits, host, port, access_log=not no_access_log,
                     on_started=lambda url: _print_started(url, how), grpc_address=grpc_address)


def _print_models(described: list[tuple[str, list[str], str]]) -> None:
    for name, notes, summary in described:
        print_notes(notes, f"{name}: ")
        console.print(summary, soft_wrap=True)


def _print_started(url: str, how: str) -> None:
    console.print(f"serving at {url} (v2 API, metrics at {url}/metrics{how})")


def _read_token(path: Path) -> str:
    from deploykit.errors import BadInputError

    token = path.read_text().strip()
    if not token or any(c.isspace() for c in token):
        raise BadInputError(f"--token-file {path}: it must hold one token, without spaces")
    return token


@click.group("export")
def export() -> None:
    """Write a bundle for another serving system."""


@export.command("triton")
@click.argument("bundle", type=BUNDLE)
@click.argument("repo", type=click.Path(path_type=Path, file_okay=False))
@click.option("--name", help="Model name (default: the bundle's folder name).")
@click.option("--platform", type=click.Choice(["onnxruntime", "tensorrt", "python"]), default="onnxruntime",
              show_default=True, help="onnxruntime_onnx (the graph and our op library), tensorrt_plan (the bundle's "
              "engine) or python (the bundle run by deploykit.load in Triton's python backend: every backend).")
@click.option("--device", default="cuda", show_default=True, metavar="cpu|cuda[:N]", help="Triton's instance kind.")
@click.option("--instances", type=click.IntRange(min=1), default=1, show_default=True, help="instance_group count.")
@click.option("--max-delay-ms", type=click.FloatRange(min=0), default=2.0, show_default=True,
              help="dynamic_batching's max_queue_delay.")
@click.option("--server-repo", default="/models", show_default=True,
              help="Where Triton sees REPO (the op library is named by that path).")
@click.option("--warmup-runs", type=click.IntRange(min=0), default=3, show_default=True,
              help="model_warmup: requests per batch size Triton runs before the model is ready; 0: none.")
@click.option("--allow-nan", is_flag=True,
              help="--platform python: pass NaN and infinite inputs to the model instead of refusing them.")
@click.option("--force", is_flag=True, help="Replace REPO/NAME when it exists.")
@allow_failed_option("Export a bundle whose validation failed.")
@trust_bundle_option
@verbose_option()
def triton(bundle, repo, name, platform, device, instances, max_delay_ms, server_repo, warmup_runs, allow_nan, force,
           allow_failed, trust_bundle, verbose):
    """Write BUNDLE as REPO/NAME (config.pbtxt, 1/model.onnx, 1/model.plan or 1/model.py and 1/bundle, README.md)
    for Triton."""
    from deploykit.export.triton import export_triton

    with handle_errors(verbose):
        repo.mkdir(parents=True, exist_ok=True)
        result = export_triton(bundle, repo, name, platform=platform, max_delay_ms=max_delay_ms, instances=instances,
                               device=device, server_repo=server_repo, warmup_runs=warmup_runs,
                               trust_native=trust_bundle, allow_failed=allow_failed, allow_nan=allow_nan, force=force)
    console.print(f"Wrote {result.model_dir} ({result.platform}): {', '.join(result.files)}", soft_wrap=True)
    console.print(f"Serve it with: {result.command}", soft_wrap=True)
