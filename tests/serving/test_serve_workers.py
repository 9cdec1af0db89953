"""``deploykit serve --workers N``: N HTTP processes on one port in front of one model process.

A client sees one server: every answer equals ``deploykit.load``'s, ``/metrics`` counts the
requests of every worker and the model process's batches, SIGTERM stops them all gracefully
(exit 0), and a bundle that cannot be loaded stops the server with its one-line error and exit code.
"""

from __future__ import annotations

import concurrent.futures
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("tritonclient.http")

from deploykit_cli import cli_env  # noqa: E402
from serving import all_started, infer_features, metric_samples, running_server  # noqa: E402

import deploykit  # noqa: E402

MODEL = "tabular"



def infer(url: str, features: np.ndarray) -> np.ndarray:
    return infer_features(url, MODEL, features)["output_1"]


def test_two_workers_answer_as_one_server_and_stop_together(bundle):
    rng = np.random.default_rng(0)
    requests = [rng.standard_normal((1 + i % 3, 13)).astype(np.float32) for i in range(48)]
    expected = [deploykit.load(bundle, device="cpu").run(features=x)["output_1"] for x in requests]
    with running_server(bundle, "--device", "cpu", "--workers", "2") as server:
        started = all_started(server)
        assert len(re.findall(r"Started server process \[(\d+)\]", started)) == 2
        assert "2 workers" in started
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda x: infer(server.url, x), requests))
        for answer, wanted in zip(answers, expected):
            np.testing.assert_array_equal(answer, wanted)
        counted = metric_samples(server, "deploykit_requests", model=MODEL, status="200")
        assert counted["deploykit_requests_total"] == len(requests)  # both workers' counts, summed
        rows = metric_samples(server, "deploykit_batch_size", model=MODEL)  # the model process's runs
        assert rows["deploykit_batch_size_sum"] == sum(len(x) for x in requests)
        assert server.stop() == 0
        log = server.output()
    assert log.count("Finished server process") == 2 and "Traceback" not in log


def test_a_bundle_that_cannot_be_loaded_stops_the_server_with_its_error(bundle):
    result = subprocess.run([sys.executable, "-m", "deploykit", "serve", bundle, "--device", "cpu", "--workers", "2",
                             "--max-batch", "99", "--port", "0"], env=cli_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and all("--max-batch 99 is outside tabular's batch range 1..4" in line for line in errors)
    assert "Traceback" not in result.stderr


def test_sigint_stops_every_worker_gracefully(bundle):
    with running_server(bundle, "--device", "cpu", "--workers", "2") as server:
        all_started(server)
        np.testing.assert_array_equal(infer(server.url, np.ones((2, 13), np.float32)),
                                      deploykit.load(bundle, device="cpu").run(features=np.ones((2, 13), np.float32))[
                                          "output_1"])
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(60) == 0
        assert server.output().count("Finished server process") == 2
