"""A real ``deploykit serve`` in a subprocess on 127.0.0.1 (deploykit.serving.launch), for tests that
talk HTTP to it."""

from __future__ import annotations

import contextlib
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from deploykit_cli import cli_env

from deploykit.serving import launch
from deploykit.serving.launch import LaunchedServer as Server


@contextlib.contextmanager
def running_server(*args, startup_s: float = 60):
    """``deploykit serve ARGS`` until the block ends (tests/helpers on its PYTHONPATH), its log removed after."""
    with tempfile.NamedTemporaryFile(prefix="deploykit-serve-", suffix=".log", delete=False) as log:
        path = Path(log.name)
    try:
        with launch.running_server(args, path, env=cli_env(), startup_s=startup_s) as server:
            yield server
    finally:
        path.unlink(missing_ok=True)


def all_started(server, timeout_s: float = 60) -> str:
    """The server's log once it says every worker is up (the first ready worker answers health probes)."""
    deadline = time.monotonic() + timeout_s
    while "serving at" not in (log := server.output()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return log


def infer_features(url: str, model: str, features) -> dict:
    """One tritonclient HTTP request of ``features`` (the tabular models' input) on a client of its own, so
    that threads can call it at once (a client's gevent pool is tied to the thread that made it, and its
    ``async_infer`` on one thread does not keep several requests in flight reliably); the outputs by name."""
    import tritonclient.http as tritonhttp

    with tritonhttp.InferenceServerClient(url) as client:
        tensor = tritonhttp.InferInput("features", list(features.shape), "FP32")
        tensor.set_data_from_numpy(features)
        result = client.infer(model, [tensor])
        return {output["name"]: result.as_numpy(output["name"]) for output in result.get_response()["outputs"]}


def post(server: Server, path: str, body: bytes, headers: dict | None = None) -> tuple[int, object, bytes]:
    """(status, headers (case-insensitive), body) of a raw POST: what a client that is not tritonclient sees."""
    request = urllib.request.Request(f"http://{server.url}{path}", data=body, headers=headers or {}, method="POST")
    return _send(request)


def get(server: Server, path: str, headers: dict | None = None) -> tuple[int, object, bytes]:
    return _send(urllib.request.Request(f"http://{server.url}{path}", headers=headers or {}))


def _send(request) -> tuple[int, object, bytes]:
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def metric_samples(server: Server, name: str, **labels) -> dict[str, float]:
    """Samples of one metric family from /metrics, by sample name and ``le``, filtered by ``labels``
    (samples that differ in other labels are added up)."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, body = get(server, "/metrics")
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        if family.name != name:
            continue
        for sample in family.samples:
            if all(sample.labels.get(k) == v for k, v in labels.items()):
                key = sample.name + (f"[{sample.labels['le']}]" if "le" in sample.labels else "")
                samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def grpc_url(server: Server, timeout_s: float = 30) -> str:
    """host:port of a server's gRPC endpoint (started with ``--grpc-port``), as its start line names it."""
    import re
    import time

    deadline = time.monotonic() + timeout_s
    while (found := re.search(r"gRPC at (\S+?)[,)]", server.output())) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert found, server.output()
    return found[1]
