"""What protects ``deploykit serve``: the bearer token, the request-size and queue limits, the
per-request timeout, and a graceful shutdown that answers every request it accepted.

Each server here has a long --max-delay-ms and pads every run to 4 rows (--buckets 4: a batcher
waits for rows that would be padded), so queued requests stay queued long enough to be counted,
timed out or caught by SIGTERM.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import json
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")

from serving import get, post, running_server  # noqa: E402

import deploykit  # noqa: E402

MODEL = "tabular"
INFER = f"/v2/models/{MODEL}/infer"


def body(seed: int = 0, rows: int = 1) -> tuple[bytes, np.ndarray]:
    features = np.random.default_rng(seed).standard_normal((rows, 13)).astype(np.float32)
    request = {"inputs": [{"name": "features", "shape": [rows, 13], "datatype": "FP32",
                           "data": features.ravel().tolist()}]}
    return json.dumps(request).encode(), features



@pytest.fixture(scope="module")
def guarded(bundle, tmp_path_factory):
    """Token, 4 KiB requests, 2 queued requests, 800 ms batching delay."""
    token = tmp_path_factory.mktemp("token") / "token"
    token.write_text("s3cret\n")
    with running_server(bundle, "--device", "cpu", "--token-file", token, "--max-request-mb", 4 / 1024,
                        "--max-queue", "2", "--max-delay-ms", "800", "--buckets", "4") as server:
        yield server


AUTH = {"Authorization": "Bearer s3cret"}


def test_token_required_except_health(guarded):
    request, _ = body()
    status, headers, answer = post(guarded, INFER, request)
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert "bearer token" in json.loads(answer)["error"]
    assert post(guarded, INFER, request, {"Authorization": "Bearer wrong"})[0] == 401
    assert get(guarded, "/metrics")[0] == 401
    assert get(guarded, "/v2/health/ready")[0] == 200
    assert get(guarded, f"/v2/models/{MODEL}", AUTH)[0] == 200


def test_large_request_is_413(guarded):
    request, _ = body(rows=4)  # about 1 KiB of JSON per row
    big = request + b" " * 5000
    status, _, answer = post(guarded, INFER, big, AUTH)
    assert status == 413 and "larger than 4096 bytes" in json.loads(answer)["error"]
    bomb = gzip.compress(request + b" " * 100_000)  # small on the wire, large once inflated
    assert len(bomb) < 4096
    assert post(guarded, INFER, bomb, {**AUTH, "Content-Encoding": "gzip"})[0] == 413


def test_full_queue_is_503_with_retry_after(guarded):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        queued = [pool.submit(post, guarded, INFER, body(seed)[0], AUTH) for seed in range(2)]
        time.sleep(0.3)  # both wait for their batch (800 ms)
        status, headers, answer = post(guarded, INFER, body(9)[0], AUTH)
        assert status == 503 and headers["Retry-After"] == "1"
        assert "queue is full (2 requests waiting)" in json.loads(answer)["error"]
        assert [future.result()[0] for future in queued] == [200, 200]


def test_slow_answer_is_504(bundle):
    with running_server(bundle, "--device", "cpu", "--timeout", "0.2", "--max-delay-ms", "1000", "--buckets", "4") as server:
        status, _, answer = post(server, INFER, body()[0])
        assert status == 504 and "no answer within 0.2 s" in json.loads(answer)["error"]
        assert get(server, "/v2/health/live")[0] == 200


def test_sigterm_answers_queued_requests_then_exits_0(bundle):
    reference = deploykit.load(bundle, device="cpu")
    with running_server(bundle, "--device", "cpu", "--max-delay-ms", "600", "--max-batch", "4", "--buckets", "4") as server:
        requests = [body(seed) for seed in range(3)]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = [pool.submit(post, server, INFER, request) for request, _ in requests]
            time.sleep(0.3)  # queued, waiting for the batch to fill
            code = server.stop()
            results = [future.result() for future in answers]
        assert code == 0, server.output()
        assert "Application shutdown complete" in server.output()
    for (status, _, answer), (_, features) in zip(results, requests):
        assert status == 200
        output = json.loads(answer)["outputs"][0]
        np.testing.assert_array_equal(np.float32(output["data"]), reference(features=features)["output_0"].ravel())
