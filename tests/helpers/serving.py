"""A real ``deploykit serve`` in a subprocess on 127.0.0.1, for tests that talk HTTP to it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from deploykit_cli import HELPERS


@dataclasses.dataclass
class Server:
    process: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        """host:port, as tritonclient takes it."""
        return f"127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text()

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then the exit code (graceful shutdown answers what it accepted first)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_server(*args, startup_s: float = 60):
    """``deploykit serve ARGS`` until the block ends; ready when /v2/health/ready answers 200."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HELPERS), os.environ.get("PYTHONPATH")]))}
    with tempfile.NamedTemporaryFile("w+", prefix="deploykit-serve-", suffix=".log", delete=False) as log:
        process = subprocess.Popen([sys.executable, "-m", "deploykit", "serve", *map(str, args), "--port", str(port)],
                                   stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(process, port, Path(log.name))
    try:
        _wait_ready(server, startup_s)
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        server.log.unlink(missing_ok=True)


def _wait_ready(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"deploykit serve exited {server.process.returncode}:\n{server.output()}")
        try:
            with urllib.request.urlopen(f"http://{server.url}/v2/health/ready", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.1)
    raise RuntimeError(f"deploykit serve was not ready within {timeout} s:\n{server.output()}")


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
