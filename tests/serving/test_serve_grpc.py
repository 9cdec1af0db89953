"""``deploykit serve --grpc-port``: the KServe v2 gRPC endpoint as tritonclient's gRPC client (and a
raw stub of the generated service) sees it, against a real server on 127.0.0.1 serving model_zoo's
tabular bundle (batch 1..4).

Every output equals ``deploykit.load``'s run of the same rows; every refusal is its gRPC status
with the one line HTTP gives, and the server answers the next request.
"""

from __future__ import annotations

import concurrent.futures
import socket
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("fastapi")
grpcclient = pytest.importorskip("tritonclient.grpc")
grpc = pytest.importorskip("grpc")

from deploykit_cli import cli_env  # noqa: E402
from serving import grpc_url, metric_samples, running_server  # noqa: E402
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402


MODEL = "tabular"


@pytest.fixture(scope="module")
def server(bundle):
    """Two instances, runs padded to 4 rows (a batcher waits up to 20 ms for more), gRPC on a free port."""
    with running_server(bundle, "--device", "cpu", "--instances", "2", "--max-delay-ms", "20", "--buckets", "4",
                        "--grpc-port", "0") as running:
        yield running


@pytest.fixture(scope="module")
def url(server):
    return grpc_url(server)


@pytest.fixture
def client(url):
    with grpcclient.InferenceServerClient(url) as triton:
        yield triton


def rows(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, 13)).astype(np.float32)


def infer(client, features: np.ndarray, datatype: str = "FP32", outputs=None, **options):
    tensor = grpcclient.InferInput("features", list(features.shape), datatype)
    tensor.set_data_from_numpy(features)
    requested = [grpcclient.InferRequestedOutput(name) for name in outputs] if outputs else None
    return client.infer(MODEL, [tensor], outputs=requested, **options)


def refused(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as error:
        call()
    return error.value


def test_health_metadata_and_config(client):
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    assert client.get_server_metadata().name == "deploykit"
    metadata = client.get_model_metadata(MODEL, as_json=True)
    assert metadata["versions"] == ["1"] and metadata["platform"] == "deploykit_onnxruntime"
    assert metadata["inputs"] == [{"name": "features", "datatype": "FP32", "shape": ["-1", "13"]}]
    assert [output["name"] for output in metadata["outputs"]] == ["output_0", "output_1"]
    config = client.get_model_config(MODEL).config  # tritonclient's ModelConfig message
    assert config.max_batch_size == 4 and list(config.input[0].dims) == [13]
    assert config.dynamic_batching.max_queue_delay_microseconds == 20000
    assert refused(lambda: client.is_model_ready("nope")).status() == "StatusCode.NOT_FOUND"


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_answers_equal_deploykit_load(client, reference, count):
    features = rows(count, seed=count)
    result = infer(client, features, request_id=f"req-{count}")
    assert result.get_response().id == f"req-{count}" and result.get_response().model_version == "1"
    for name, wanted in reference(features=features).items():
        np.testing.assert_array_equal(result.as_numpy(name), wanted)


def test_only_the_requested_outputs_come_back(client, reference):
    features = rows(2, seed=7)
    result = infer(client, features, outputs=["output_1"])
    assert [output.name for output in result.get_response().outputs] == ["output_1"]
    np.testing.assert_array_equal(result.as_numpy("output_1"), reference(features=features)["output_1"])


def test_typed_contents_are_read_like_raw_bytes(url, reference):
    """A client that sends ``contents.fp32_contents`` instead of raw bytes (tritonclient never does)."""
    features = rows(3, seed=11)
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    tensor = request.inputs.add(name="features", datatype="FP32", shape=[3, 13])
    tensor.contents.fp32_contents.extend(features.ravel().tolist())
    with grpc.insecure_channel(url) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
        short = service_pb2.ModelInferRequest(model_name=MODEL)
        short.CopyFrom(request)
        del short.inputs[0].contents.fp32_contents[-1]
        with pytest.raises(grpc.RpcError) as error:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(short)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "has 38 values in contents.fp32_contents, its shape [3, 13] takes 39" in error.value.details()
    assert [output.name for output in response.outputs] == ["output_0", "output_1"]
    expected = reference(features=features)
    for output, raw in zip(response.outputs, response.raw_output_contents):
        np.testing.assert_array_equal(np.frombuffer(raw, "<f4").reshape(output.shape), expected[output.name])


def test_concurrent_requests_are_batched_and_each_gets_its_rows(server, url, reference):
    requests = [rows(1 + i % 2, seed=100 + i) for i in range(24)]
    before = metric_samples(server, "deploykit_batch_size", model=MODEL).get("deploykit_batch_size_count", 0)

    def one(features):
        with grpcclient.InferenceServerClient(url) as own:
            return infer(own, features).as_numpy("output_0")

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, requests))
    for answer, features in zip(answers, requests):
        np.testing.assert_array_equal(answer, reference(features=features)["output_0"])
    runs = metric_samples(server, "deploykit_batch_size", model=MODEL)["deploykit_batch_size_count"] - before
    assert runs < len(requests)  # several requests shared a run


@pytest.mark.parametrize("send, status, message", [
    (lambda c: infer(c, rows(2, 0).astype(np.float64), "FP64"), "INVALID_ARGUMENT",
     "input features is FP64, the model takes FP32"),
    (lambda c: infer(c, rows(5, 0)), "INVALID_ARGUMENT", "the batches the bundle was validated for"),
    (lambda c: infer(c, np.full((1, 13), np.nan, np.float32)), "INVALID_ARGUMENT", "13 NaN or infinite values"),
    (lambda c: infer(c, rows(1, 0), outputs=["logits"]), "INVALID_ARGUMENT", "no output named logits"),
    (lambda c: c.infer("nope", [grpcclient.InferInput("features", [1, 13], "FP32").set_data_from_numpy(rows(1, 0))]),
     "NOT_FOUND", "no model named nope; this server serves tabular"),
    (lambda c: c.infer(MODEL, [grpcclient.InferInput("features", [1, 13], "FP32").set_data_from_numpy(rows(1, 0))],
                       model_version="2"), "NOT_FOUND", "model tabular has no version 2"),
])
def test_bad_requests_get_their_status_and_the_server_stays_up(client, reference, send, status, message):
    error = refused(lambda: send(client))
    assert error.status() == f"StatusCode.{status}" and message in error.message()
    features = rows(1, seed=3)
    np.testing.assert_array_equal(infer(client, features).as_numpy("output_0"),
                                  reference(features=features)["output_0"])


def test_raw_contents_must_match_the_inputs_and_name_each_once(url):
    request = service_pb2.ModelInferRequest(model_name=MODEL, raw_input_contents=[b"\0" * 51])
    request.inputs.add(name="features", datatype="FP32", shape=[1, 13])
    count = service_pb2.ModelInferRequest(model_name=MODEL, raw_input_contents=[b"\0" * 52] * 2)
    count.inputs.add(name="features", datatype="FP32", shape=[1, 13])
    twice = service_pb2.ModelInferRequest(model_name=MODEL, raw_input_contents=[b"\0" * 52] * 2)
    for _ in range(2):
        twice.inputs.add(name="features", datatype="FP32", shape=[1, 13])
    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for bad, message in ((request, "raw_input_contents[0] is 51 bytes, its shape and datatype take 52"),
                             (count, "raw_input_contents has 2 entries for 1 inputs"),
                             (twice, "input features is given twice")):
            with pytest.raises(grpc.RpcError) as error:
                stub.ModelInfer(bad)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.value.details()


def test_grpc_requests_are_counted_beside_http_ones(server, client):
    before = metric_samples(server, "deploykit_requests", model="-", status="404").get("deploykit_requests_total", 0)
    refused(lambda: client.infer("missing", [grpcclient.InferInput("features", [1, 13], "FP32")
                                             .set_data_from_numpy(rows(1, 0))]))
    after = metric_samples(server, "deploykit_requests", model="-", status="404")["deploykit_requests_total"]
    assert after == before + 1


def test_token_required_except_health(bundle, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with running_server(bundle, "--device", "cpu", "--token-file", token, "--grpc-port", "0") as guarded:
        with grpcclient.InferenceServerClient(grpc_url(guarded)) as client:
            assert client.is_server_live() and client.is_server_ready()
            error = refused(lambda: infer(client, rows(1, 0)))
            assert error.status() == "StatusCode.UNAUTHENTICATED" and "bearer token" in error.message()
            assert refused(lambda: client.get_model_metadata(MODEL,
                                                             headers={"authorization": "Bearer wrong"})).status() \
                == "StatusCode.UNAUTHENTICATED"
            result = infer(client, rows(1, 0), headers={"authorization": "Bearer s3cret"})
            assert result.as_numpy("output_0").shape == (1, 4)


def test_two_workers_answer_grpc_on_one_port(bundle, reference):
    requests = [rows(1 + i % 3, seed=200 + i) for i in range(16)]
    with running_server(bundle, "--device", "cpu", "--workers", "2", "--grpc-port", "0") as served:
        url = grpc_url(served)

        def one(features):
            with grpcclient.InferenceServerClient(url) as own:  # a connection each: the kernel picks a worker
                return infer(own, features).as_numpy("output_1")

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(one, requests))
        for answer, features in zip(answers, requests):
            np.testing.assert_array_equal(answer, reference(features=features)["output_1"])
        assert served.stop() == 0
        assert "Traceback" not in served.output()


def test_a_taken_grpc_port_is_one_line_and_exit_3(bundle):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "deploykit", "serve", bundle, "--device", "cpu", "--port", "0",
                                 "--grpc-port", str(port)], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr
    assert f"cannot listen for gRPC on 127.0.0.1:{port}" in result.stderr and "choose another --grpc-port" in result.stderr
    assert "Traceback" not in result.stderr
