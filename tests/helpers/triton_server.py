"""A real ``tritonserver`` (Triton 2.51 from the nvidia-pytriton wheel, fetched once into deploykit's
cache by deploykit.tools.triton_tools) in a subprocess on 127.0.0.1, for the tests that load our
exports in it.

The python backend's stub ignores PYTHONPATH but puts its working directory first on sys.path:
started in this checkout, it imports the deploykit under test, not the one installed in the venv.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import urllib.request
from pathlib import Path

import pytest

from deploykit.errors import EnvironmentProblem
from deploykit.serving import launch
from deploykit.tools import triton_tools

CHECKOUT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class Triton:
    server: launch.LaunchedServer  # its port is the HTTP one
    grpc_port: int

    @property
    def http_url(self) -> str:
        return self.server.url

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def index(self) -> dict[str, dict]:
        """``POST /v2/repository/index``: each model's state and the reason it is not ready, by name."""
        request = urllib.request.Request(f"http://{self.http_url}/v2/repository/index", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            return {entry["name"]: entry for entry in json.loads(response.read())}


def fetched_or_skip() -> None:
    """The one reason these tests may skip: the wheels cannot be fetched (no PyPI, an empty cache)."""
    try:
        triton_tools.fetch()
    except EnvironmentProblem as error:
        pytest.skip(f"Triton's wheels cannot be fetched here: {error}")


@contextlib.contextmanager
def running_triton(repo: Path, log: Path, *args: str, ready_model: str, startup_s: float = 120):
    """tritonserver on ``repo`` until the block ends, ready once ``ready_model`` is (other models
    may fail to load: pass ``--exit-on-error=false`` to keep the server up then)."""
    program = triton_tools.tritonserver()
    http, grpc, metrics = launch.free_port(), launch.free_port(), launch.free_port()
    command = [*program.command, f"--model-repository={repo}", "--http-address=127.0.0.1", f"--http-port={http}",
               "--grpc-address=127.0.0.1", f"--grpc-port={grpc}", "--metrics-address=127.0.0.1",
               f"--metrics-port={metrics}", *args]
    with launch.running(command, http, log, "tritonserver", env=program.env, cwd=CHECKOUT, startup_s=startup_s,
                        ready=f"/v2/models/{ready_model}/ready") as server:
        yield Triton(server, grpc)
