"""A lost CUDA context stops the server: a failed run on a GPU is followed by a probe of its device
(``gpu_health.lost_context``, replaced here: there is no GPU), and where the probe fails the batcher
says so once, and ``serve`` stops and raises the reason (exit 3). A run that fails on a GPU that still
works, or on the CPU, only answers its requests with 500.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import multiprocessing
import queue
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("uvicorn")

from deploykit.errors import EnvironmentProblem  # noqa: E402
from deploykit.serving import batching, model_host, models, server  # noqa: E402
from deploykit.serving.app import Limits  # noqa: E402
from deploykit.serving.batching import Batcher  # noqa: E402
from deploykit.serving.metrics import Metrics  # noqa: E402
from deploykit.serving.model_host import HostLink, run_model_process  # noqa: E402
from deploykit.serving.models import ServedModel, ServeOptions  # noqa: E402
from deploykit.serving.protocol import RequestError  # noqa: E402

LOST = "AcceleratorError: CUDA error: device-side assert triggered"


class FailingRunner:
    """A runner whose every run fails, as every run does once a CUDA context is lost."""

    backend, notes = "aoti", []
    inputs = [{"name": "x", "dtype": "float32", "shape": ["batch", 3], "dynamic": {"0": {"min": 1, "opt": 2, "max": 8}}}]
    outputs = [{"name": "y", "dtype": "float32", "shape": ["batch", 3]}]

    def __init__(self, device: str):
        self.device = device

    def run(self, feeds):
        raise RuntimeError(LOST)

    def close(self):
        pass


def model_on(device: str) -> ServedModel:
    place = "cuda:0" if device == "cuda" else "cpu"
    return ServedModel("embed", Path("embed"), [FailingRunner(device)], [place], max_batch=8, buckets=[], allow_nan=False)


def failed_answers(batcher: Batcher, count: int) -> list[int]:
    statuses = []
    for _ in range(count):
        with pytest.raises(RequestError) as failed:
            batcher.submit({"x": np.ones((1, 3), np.float32)}, 1).result(timeout=10)
        statuses.append(failed.value.status)
    return statuses


@pytest.mark.parametrize("probe", [LOST, None], ids=["context lost", "context fine"])
def test_a_failed_gpu_run_probes_the_device_and_a_lost_context_is_said_once(monkeypatch, probe):
    probed, said = [], []
    monkeypatch.setattr(batching, "lost_context", lambda device: probed.append(device) or probe)
    batcher = Batcher(model_on("cuda"), max_delay_s=0, max_queue=4, metrics=Metrics(), on_lost=said.append)
    assert failed_answers(batcher, 2) == [500, 500]
    batcher.close()
    assert probed[0] == "cuda:0"
    if probe is None:
        assert said == []
    else:
        assert len(said) == 1 and "embed on cuda:0" in said[0] and LOST in said[0] and "start it again" in said[0]


def test_a_failed_cpu_run_probes_nothing(monkeypatch):
    monkeypatch.setattr(batching, "lost_context", lambda device: pytest.fail("probed a CPU runner"))
    said = []
    batcher = Batcher(model_on("cpu"), max_delay_s=0, max_queue=4, metrics=Metrics(), on_lost=said.append)
    assert failed_answers(batcher, 1) == [500]
    batcher.close()
    assert said == []


def test_serve_stops_and_raises_the_reason_once_a_gpu_context_is_lost(monkeypatch):
    monkeypatch.setattr(batching, "lost_context", lambda device: LOST)
    answers, clients = [], []

    def ask(url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        body = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1.0, 2.0, 3.0]}]}
        connection.request("POST", "/v2/models/embed/infer", json.dumps(body), {"Content-Type": "application/json"})
        answers.append(connection.getresponse().status)

    def on_started(url: str) -> None:
        clients.append(threading.Thread(target=ask, args=(url,), daemon=True))
        clients[0].start()

    with pytest.raises(EnvironmentProblem) as stopped:
        server.serve([model_on("cuda")], Limits(timeout_s=5), port=0, access_log=False, on_started=on_started)
    clients[0].join(10)
    assert answers == [500] and "CUDA context is lost" in str(stopped.value) and stopped.value.exit_code == 3


def test_the_model_process_finishes_and_exits_3_once_a_gpu_context_is_lost(monkeypatch, tmp_path):
    monkeypatch.setattr(batching, "lost_context", lambda device: LOST)
    monkeypatch.setattr(models, "load_models", lambda paths, options: [model_on("cuda")])
    monkeypatch.setattr(model_host.signal, "signal", lambda *args: None)  # pytest keeps its own handlers
    ours, theirs = multiprocessing.Pipe()
    statuses = []

    async def ask() -> None:  # as a worker asks: from its event loop, which reads the answers
        link = HostLink(theirs, tmp_path, "w0")
        link.batcher(SimpleNamespace(name="embed"), None)
        await asyncio.wrap_future(link.submit("embed", {"x": np.ones((1, 3), np.float32)}, 1))

    def worker() -> None:
        theirs.recv()  # the models, once warm
        try:
            asyncio.run(asyncio.wait_for(ask(), 10))
        except RequestError as error:
            statuses.append(error.status)
        theirs.close()

    asking = threading.Thread(target=worker, daemon=True)
    asking.start()
    with pytest.raises(SystemExit) as exited:
        run_model_process([], ServeOptions(), Limits(), [ours], queue.Queue())
    asking.join(10)
    assert exited.value.code == 3 and statuses == [500]
