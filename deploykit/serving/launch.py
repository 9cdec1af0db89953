"""``deploykit serve`` (or another Open Inference Protocol server, tritonserver) in a subprocess on
127.0.0.1, as the load benchmark and the tests start it.

Its output goes to a log file, never to a pipe: a pipe nobody reads fills up and stalls the
server mid-run. Ready once ``/v2/health/ready`` answers 200; stopped with SIGTERM, as an
orchestrator stops it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


@dataclasses.dataclass
class LaunchedServer:
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


def running_server(args, log: Path, *, env: dict[str, str] | None = None, startup_s: float = 60):
    """``deploykit serve ARGS --port P`` until the block ends (killed if still running then), its
    stdout and stderr in ``log``; RuntimeError with the log when it exits or is not ready in time."""
    port = free_port()
    command = [sys.executable, "-m", "deploykit", "serve", *map(str, args), "--port", str(port)]
    return running(command, port, log, "deploykit serve", env=env, startup_s=startup_s)


@contextlib.contextmanager
def running(command: list[str], port: int, log: Path, what: str, *, env: dict[str, str] | None = None,
            cwd: Path | None = None, startup_s: float = 60, ready: str = "/v2/health/ready"):
    """Any Open Inference Protocol server (``deploykit serve``, ``tritonserver``) started by
    ``command``, until the block ends, once ``ready`` answers 200 on ``port``; ``what`` names it in errors."""
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    server = LaunchedServer(process, port, Path(log))
    try:
        _wait_ready(server, what, ready, startup_s)
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _wait_ready(server: LaunchedServer, what: str, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{what} exited {server.process.returncode}:\n{server.output()}")
        try:
            with urllib.request.urlopen(f"http://{server.url}{path}", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.1)
    raise RuntimeError(f"{what} was not ready within {timeout} s:\n{server.output()}")
