"""``deploykit serve`` as clients see it: tritonclient's HTTP client (written by NVIDIA for Triton)
and raw HTTP against a real server on 127.0.0.1 serving model_zoo's tabular bundle (batch 1..4).

Every output is compared with ``deploykit.load``'s run of the same rows; bad requests each get
their status and one line, and the server stays up.
"""

from __future__ import annotations

import concurrent.futures
import json

import numpy as np
import pytest

pytest.importorskip("fastapi")
tritonhttp = pytest.importorskip("tritonclient.http")

import converted_bundles  # noqa: E402
from serving import all_started, get, infer_features, metric_samples, post, running_server  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

import deploykit  # noqa: E402

MODEL = "tabular"




@pytest.fixture(scope="module")
def server(bundle):
    """tabular and transformer_mlp, two instances each, runs padded to 4 rows (so a batcher waits for more)."""
    second = converted_bundles.converted("transformer_mlp")
    with running_server(bundle, second, "--device", "cpu", "--instances", "2", "--max-delay-ms", "20",
                        "--buckets", "4") as running:
        yield running


@pytest.fixture
def client(server):
    with tritonhttp.InferenceServerClient(server.url, concurrency=16) as triton:
        yield triton


def rows(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, 13)).astype(np.float32)


def infer(client, features: np.ndarray, binary: bool = True, start=False):
    """tritonclient's infer (``start``: its async_infer, whose ``get_result()`` waits for the answer)."""
    tensor = tritonhttp.InferInput("features", list(features.shape), "FP32")
    tensor.set_data_from_numpy(features, binary_data=binary)
    outputs = [tritonhttp.InferRequestedOutput(name, binary_data=binary) for name in ("output_0", "output_1")]
    call = client.async_infer if start else client.infer
    return call(MODEL, [tensor], outputs=outputs, request_id="r1")


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    assert client.get_server_metadata()["extensions"] == ["binary_tensor_data"]
    metadata = client.get_model_metadata(MODEL)
    assert metadata["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 13]}]
    assert [o["shape"] for o in metadata["outputs"]] == [[-1, 4], [-1, 16]]
    assert not client.is_model_ready("nope")


def test_config_parses_as_triton_model_config(client):
    from google.protobuf import json_format
    from tritonclient.grpc import model_config_pb2

    config = json_format.ParseDict(client.get_model_config(MODEL), model_config_pb2.ModelConfig())
    assert config.max_batch_size == 4 and list(config.input[0].dims) == [13]
    group = config.instance_group[0]
    assert group.count == 2 and group.kind == model_config_pb2.ModelInstanceGroup.KIND_CPU


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("count", [1, 3])
def test_infer_equals_deploykit_load(client, reference, binary, count):
    features = rows(count, seed=count)
    result = infer(client, features, binary)
    expected = reference(features=features)
    assert result.get_response()["id"] == "r1"
    for name in ("output_0", "output_1"):
        np.testing.assert_array_equal(result.as_numpy(name), expected[name])


def test_second_model(client):
    tokens = np.random.default_rng(5).standard_normal((2, 9, 40)).astype(np.float32)
    tensor = tritonhttp.InferInput("tokens", [2, 9, 40], "FP32")
    tensor.set_data_from_numpy(tokens)
    result = client.infer("transformer_mlp", [tensor])
    expected = deploykit.load(converted_bundles.converted("transformer_mlp"), device="cpu").run(tokens=tokens)
    np.testing.assert_array_equal(result.as_numpy("output"), expected["output"])


def test_all_outputs_in_binary_by_default(client, reference):
    features = rows(2, seed=7)
    tensor = tritonhttp.InferInput("features", [2, 13], "FP32")
    tensor.set_data_from_numpy(features)
    result = client.infer(MODEL, [tensor])  # no outputs named: tritonclient asks for all of them in binary
    np.testing.assert_array_equal(result.as_numpy("output_1"), reference(features=features)["output_1"])


def _json_request(data=None, name="features", shape=(1, 13), datatype="FP32", **extra) -> bytes:
    data = list(range(int(np.prod(shape)))) if data is None else data
    return json.dumps({"inputs": [{"name": name, "shape": list(shape), "datatype": datatype, "data": data}],
                       **extra}).encode()


BAD_REQUESTS = {
    "malformed JSON": (b'{"inputs": [', "not valid JSON"),
    "no inputs": (b'{"outputs": []}', 'no "inputs" list'),
    "unknown input": (_json_request(name="x"), "no input named x"),
    "wrong datatype": (_json_request(datatype="FP64"), "input features is FP64, the model takes FP32"),
    "wrong rank": (_json_request(shape=(13,)), "has shape 13, the model takes batchx13"),
    "wrong size": (_json_request(shape=(1, 12)), "has shape 1x12, the model takes batchx13"),
    "too few values": (_json_request(data=[1, 2], shape=(1, 13)), "has 2 values, its shape [1, 13] takes 13"),
    "batch beyond the bundle": (_json_request(shape=(5, 13)), "batch 5, outside 1..4"),
    "NaN in JSON": (_json_request(data=[float("nan")] + [0] * 12), "holds 1 NaN or infinite values"),
    "unknown output": (_json_request(outputs=[{"name": "logits"}]), "no output named logits"),
    "text data": (_json_request(data=["a"] * 13), "must be a flat or nested list of numbers"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_request_is_one_line_and_400(server, case):
    body, message = BAD_REQUESTS[case]
    status, _, answer = post(server, f"/v2/models/{MODEL}/infer", body)
    assert status == 400
    error = json.loads(answer)["error"]
    assert message in error and "\n" not in error
    assert get(server, "/v2/health/live")[0] == 200


def test_nan_input_is_refused(client):
    features = rows(1, seed=3)
    features[0, 4] = np.nan
    with pytest.raises(InferenceServerException, match="features holds 1 NaN or infinite values"):
        infer(client, features)


def test_binary_sizes_must_add_up(server):
    header = json.dumps({"inputs": [{"name": "features", "shape": [1, 13], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 52}}]}).encode()
    status, _, answer = post(server, f"/v2/models/{MODEL}/infer", header + b"\0" * 40,
                             {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400 and "ends 12 bytes before its binary data" in json.loads(answer)["error"]


def test_compressed_request(client, reference):
    features = rows(2, seed=13)
    tensor = tritonhttp.InferInput("features", [2, 13], "FP32")
    tensor.set_data_from_numpy(features)
    result = client.infer(MODEL, [tensor], request_compression_algorithm="gzip")
    np.testing.assert_array_equal(result.as_numpy("output_0"), reference(features=features)["output_0"])


def test_unknown_model_and_route(server):
    status, _, answer = post(server, "/v2/models/nope/infer", _json_request())
    assert status == 404
    assert json.loads(answer)["error"] == "no model named nope; this server serves tabular, transformer_mlp"
    status, _, answer = get(server, "/v2/models/tabular/versions/2")
    assert status == 404 and "serves version 1" in json.loads(answer)["error"]
    status, _, answer = get(server, "/nothing")
    assert status == 404 and "error" in json.loads(answer)


def test_concurrent_requests_are_batched_and_exact(server, client, reference):
    """16 clients at once: every answer equals deploykit.load's, and runs held several requests."""
    before = metric_samples(server, "deploykit_batch_size", model=MODEL)
    inputs = [rows(1 + seed % 2, seed) for seed in range(64)]
    started = [infer(client, x, start=True) for x in inputs]  # 16 at a time: the client's concurrency
    results = [request.get_result() for request in started]
    for features, result in zip(inputs, results):
        np.testing.assert_array_equal(result.as_numpy("output_0"), reference(features=features)["output_0"])
    after = metric_samples(server, "deploykit_batch_size", model=MODEL)
    runs = after["deploykit_batch_size_count"] - before.get("deploykit_batch_size_count", 0)
    single = after["deploykit_batch_size_bucket[1.0]"] - before.get("deploykit_batch_size_bucket[1.0]", 0)
    rows_run = after["deploykit_batch_size_sum"] - before.get("deploykit_batch_size_sum", 0)
    assert rows_run == sum(len(x) for x in inputs)
    assert runs < len(inputs) and single < runs  # requests shared runs, and most runs held more than one row


def test_metrics_count_requests_and_errors(server, client):
    infer(client, rows(1, seed=11))
    post(server, f"/v2/models/{MODEL}/infer", b"{")
    post(server, "/v2/models/other/infer", b"{")
    requests = metric_samples(server, "deploykit_requests", model=MODEL)
    errors = metric_samples(server, "deploykit_request_errors")
    assert requests['deploykit_requests_total'] >= 1
    assert metric_samples(server, "deploykit_request_errors", model=MODEL, reason="bad_request")
    assert metric_samples(server, "deploykit_request_errors", model="-", reason="unknown_model")
    assert not any("other" in key for key in errors)  # unserved names never become labels
    assert "deploykit_queue_depth" in get(server, "/metrics")[2].decode()


def test_on_a_cpu_one_process_serves_by_default(server):
    """--workers auto on a CPU: no HTTP worker processes (the model's runs need every core)."""
    logged = " ".join(all_started(server).split())  # the console may wrap its line anywhere between words
    assert "(v2 API, metrics at" in logged and " workers)" not in logged, logged


def test_access_log_is_one_json_line_per_request(server):
    get(server, "/v2/models/tabular", {"X-Request-ID": "trace-42"})
    lines = [json.loads(line) for line in server.output().splitlines() if line.startswith("{")]
    entry = next(line for line in lines if line["request_id"] == "trace-42")
    assert entry["path"] == "/v2/models/tabular" and entry["status"] == 200 and entry["method"] == "GET"


def test_split_cores_answers_concurrent_requests_on_every_lane(bundle, reference):
    """--split-cores: lone and queued requests alike answered as deploykit.load answers them, whichever
    runner (every core, or one of the two halves) ran their batch."""
    with running_server(bundle, "--device", "cpu", "--split-cores", "--max-batch", "2", "--warmup-runs", "1") as server:
        features = [rows(1 + seed % 2, seed) for seed in range(48)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda x: infer_features(server.url, MODEL, x), features))
        assert "and 2 on half the cores each" in server.output(), server.output()
    for x, answer in zip(features, answers):
        expected = reference(features=x)
        for name in ("output_0", "output_1"):
            np.testing.assert_allclose(answer[name], expected[name], rtol=1e-5, atol=1e-6)
