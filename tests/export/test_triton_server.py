"""Our exports in a real Triton Inference Server 2.51 on the CPU (tests/helpers/triton_server.py),
talked to with tritonclient over HTTP and gRPC.

One server for the module, on one repository of the tabular bundle exported three times:
``tab`` (--platform python), which must answer as ``deploykit.load(bundle).run`` does, exactly;
``tab_changed`` (python, a bundle file changed after export), which must fail its load naming the
file; and ``tab_ort`` (--platform onnxruntime), which must fail only because the wheel's server has
no onnxruntime backend. Started with --exit-on-error=false, so those failures leave it up.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

tritonclient_http = pytest.importorskip("tritonclient.http")
tritonclient_grpc = pytest.importorskip("tritonclient.grpc")

from tritonclient.utils import InferenceServerException  # noqa: E402

import converted_bundles  # noqa: E402
import triton_server  # noqa: E402
from deploykit_cli import run_benchmark, run_deploykit  # noqa: E402

import deploykit  # noqa: E402
from deploykit.export.triton import export_triton  # noqa: E402

CLIENTS = {"http": tritonclient_http, "grpc": tritonclient_grpc}


@pytest.fixture(scope="module")
def bundle():
    return converted_bundles.converted("tabular")


@pytest.fixture(scope="module")
def runner(bundle):
    with deploykit.load(bundle, device="cpu") as loaded:
        yield loaded


@pytest.fixture(scope="module")
def triton(bundle, tmp_path_factory):
    triton_server.fetched_or_skip()
    work = tmp_path_factory.mktemp("triton")
    repo = work / "repo"
    exported = run_deploykit("export", "triton", bundle, repo, "--platform", "python", "--device", "cpu",
                             "--name", "tab", "--max-delay-ms", "20")
    assert exported.returncode == 0, exported.stderr
    changed = export_triton(bundle, repo, "tab_changed", platform="python", device="cpu", warmup_runs=0)
    with open(changed.model_dir / "1" / "bundle" / "report.json", "a") as report:
        report.write(" ")
    export_triton(bundle, repo, "tab_ort", device="cpu", server_repo=str(repo))
    with triton_server.running_triton(repo, work / "tritonserver.log", "--exit-on-error=false",
                                      ready_model="tab") as server:
        yield server


def client(protocol: str, triton, **options):
    return CLIENTS[protocol].InferenceServerClient(triton.http_url if protocol == "http" else triton.grpc_url,
                                                   **options)


def infer_input(protocol: str, array: np.ndarray, name: str = "features", datatype: str = "FP32"):
    tensor = CLIENTS[protocol].InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def features(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 13)).astype(np.float32)


def assert_answers(result, runner, array: np.ndarray) -> None:
    expected = runner.run({"features": array})
    for name, value in expected.items():
        got = result.as_numpy(name)
        assert got.shape == value.shape and np.array_equal(got, value), name


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_answers_equal_deploykit_load_runs(triton, runner, protocol):
    with client(protocol, triton) as talk:
        for rows in (1, 2, 3):
            array = features(rows, seed=rows)
            assert_answers(talk.infer("tab", [infer_input(protocol, array)]), runner, array)


def test_requests_batched_together_are_split_back_exactly(triton, runner):
    """Concurrent requests of 1, 2 and 3 rows: Triton hands several to one execute, which runs
    them at once; each gets its own rows back (checked against each request run alone, which the
    CPU computes alike: the tabular model's rows do not depend on the batch)."""
    arrays = [features(rows, seed=10 + i) for i, rows in enumerate([1, 2, 1, 3, 2, 1, 1, 2] * 3)]
    with client("http", triton, concurrency=len(arrays)) as talk:
        for _ in range(5):  # until Triton has batched some: a burst usually does at once
            before = talk.get_inference_statistics("tab")["model_stats"][0]
            pending = [talk.async_infer("tab", [infer_input("http", a)]) for a in arrays]
            for array, request in zip(arrays, pending):
                assert_answers(request.get_result(), runner, array)
            after = talk.get_inference_statistics("tab")["model_stats"][0]
            runs = int(after["execution_count"]) - int(before["execution_count"])
            if runs < len(arrays):
                break
    assert int(after["inference_count"]) - int(before["inference_count"]) == sum(len(a) for a in arrays)
    assert runs < len(arrays), "Triton ran every request alone: nothing was batched to split back"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_requests_are_refused_and_the_server_answers_the_next(triton, runner, protocol):
    invalid, unknown = (400, 404) if protocol == "http" else ("StatusCode.INVALID_ARGUMENT", "StatusCode.NOT_FOUND")
    nan = features(2, seed=1)
    nan[1, 3] = np.nan
    cases = {
        "wrong shape": ("tab", [infer_input(protocol, np.zeros((1, 12), np.float32))], invalid, "shape"),
        "wrong dtype": ("tab", [infer_input(protocol, np.zeros((1, 13)), datatype="FP64")], invalid, "FP64"),
        "NaN": ("tab", [infer_input(protocol, nan)], invalid, "input features holds 1 NaN or infinite values"),
        "missing input": ("tab", [], invalid, "features"),
        "unknown model": ("nope", [infer_input(protocol, features(1, 0))], unknown, "nope"),
    }
    with client(protocol, triton) as talk:
        for case, (model, inputs, status, says) in cases.items():
            with pytest.raises(InferenceServerException) as refused:
                talk.infer(model, inputs)
            assert str(refused.value.status()) == str(status) and says in refused.value.message(), case
        array = features(2, seed=2)
        assert_answers(talk.infer("tab", [infer_input(protocol, array)]), runner, array)


def test_a_truncated_json_body_is_a_500_from_triton_itself(triton):
    """Triton's HTTP frontend parses the body before any backend sees it (deploykit serve answers 400):
    docs/serving.md says so, and this test notices when a release changes it."""
    body = b'{"inputs": [{"name": "features", "shape": [1, 13], "datatype": "FP32", "data": [0'
    request = urllib.request.Request(f"http://{triton.http_url}/v2/models/tab/infer", data=body, method="POST")
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request, timeout=10)
    assert answer.value.code == 500 and "failed to parse the request JSON" in json.loads(answer.value.read())["error"]


def test_the_load_fails_on_a_bundle_changed_after_export_and_for_the_missing_backend_only(triton):
    index = triton.index()
    assert index["tab"]["state"] == "READY"
    changed = index["tab_changed"]
    assert changed["state"] == "UNAVAILABLE"
    assert "report.json (sha256 mismatch); the bundle changed after export: export it again" in changed["reason"]
    ort = index["tab_ort"]
    assert ort["state"] == "UNAVAILABLE"  # its whole reason: Triton read our config and found no backend to run it
    assert ort["reason"] == ("Invalid argument: unable to find backend library for backend 'onnxruntime', try "
                             "specifying runtime on the model configuration.")


def test_perf_analyzer_measures_both_protocols_and_counts_refused_requests(triton, tmp_path):
    """benchmarks/perf_analyzer.py against this server, short: its numbers are those perf_analyzer
    printed (the CSV read right); NaN inputs (a folder of raw inputs) refused by the model, counted."""
    short = ["--concurrency", "2", "--measurement-interval-ms", "500", "--stability-percentage", "100"]
    measured = run_benchmark("perf_analyzer.py", "tab", "--http", triton.http_url, "--grpc", triton.grpc_url,
                             *short, "--out", tmp_path / "good")
    assert measured.returncode == 0, measured.stderr
    results = json.loads((tmp_path / "good" / "perf_analyzer.json").read_text())["results"]
    assert [(r["protocol"], r["concurrency"], r["errors"], r["failure"]) for r in results] == [
        ("http", 2, 0, None), ("grpc", 2, 0, None)]
    for result in results:
        printed = (tmp_path / "good" / f"{result['protocol']}-c2.log").read_text()
        assert f"Throughput: {result['throughput']:g} infer/sec" in printed
        assert f"p99 latency: {round(result['p99_ms'] * 1000)} usec" in printed
        assert 0 < result["p50_ms"] <= result["p95_ms"] <= result["p99_ms"]
    raw = tmp_path / "nan-inputs"
    raw.mkdir()
    np.full(13, np.nan, np.float32).tofile(raw / "features")
    refused = run_benchmark("perf_analyzer.py", "tab", "--http", triton.http_url, *short, "--input-data", raw,
                            "--out", tmp_path / "nan")
    assert refused.returncode == 1, refused.stderr
    [result] = json.loads((tmp_path / "nan" / "perf_analyzer.json").read_text())["results"]
    assert result["errors"] == 2 and result["throughput"] is None  # each of the 2 threads stopped at its first
    assert "input features holds 13 NaN or infinite values" in result["failure"]
    assert "| http | 2 |  |  |  |  | 2 | p99 | input features holds 13 NaN" in (tmp_path / "nan" / "perf_analyzer.md").read_text()


def test_sigterm_stops_it_cleanly(triton):
    """Last in this module: SIGTERM, as an orchestrator stops it; Triton unloads its models and exits 0."""
    started = time.monotonic()
    code = triton.server.stop(timeout=30)
    assert code == 0 and time.monotonic() - started < 15, triton.server.output()[-2000:]
    assert "successfully unloaded 'tab' version 1" in triton.server.output()
