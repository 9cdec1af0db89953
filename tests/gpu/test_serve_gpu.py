"""``deploykit serve`` on the GPU: two instances on cuda:0 share the model's queue, batches form
under concurrent load, and every answer equals ``deploykit.load``'s on the GPU for the same rows,
in one process and with HTTP workers in front of the model process.
"""

from __future__ import annotations

import concurrent.futures
import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
if CUDA not in ort.get_available_providers() or not torch.cuda.is_available():
    pytest.skip(f"needs a GPU and onnxruntime-gpu's {CUDA}", allow_module_level=True)
pytest.importorskip("tritonclient.http")

import converted_bundles  # noqa: E402
from deploykit_cli import run_deploykit  # noqa: E402
from serving import all_started, get, infer_features, metric_samples, running_server  # noqa: E402

import deploykit  # noqa: E402

MODEL = "tabular"


@pytest.fixture(scope="module")
def bundle():
    return converted_bundles.converted(MODEL)


@pytest.mark.parametrize("workers", [1, 2])
def test_two_instances_on_one_gpu(bundle, workers):
    reference = deploykit.load(bundle, backend="onnxruntime", device="cuda:0")
    inputs = [np.random.default_rng(seed).standard_normal((1 + seed % 3, 13)).astype(np.float32)
              for seed in range(96)]
    with running_server(bundle, "--backend", "onnxruntime", "--device", "cuda:0", "--instances", "2",
                        "--max-delay-ms", "5", "--workers", workers) as server:
        config = json.loads(get(server, f"/v2/models/{MODEL}/config")[2])
        assert config["instance_group"] == [{"count": 2, "kind": "KIND_GPU", "gpus": [0]}]
        # 24 clients on threads of their own: one client's async_infer sent these one after the other
        # (2026-12-05: 11 ms apart, where its infer takes 1.4 ms: every request a run of its own, on the GPU as on
        # a CPU, with the serving code of 2026-12-04 too)
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            results = list(pool.map(lambda features: infer_features(server.url, MODEL, features), inputs))
        batches = metric_samples(server, "deploykit_batch_size", model=MODEL)
    for features, result in zip(inputs, results):
        expected = reference.run(features=features)
        for name in ("output_0", "output_1"):
            np.testing.assert_allclose(result[name], expected[name], rtol=1e-5, atol=1e-6)
    assert batches["deploykit_batch_size_sum"] == sum(len(x) for x in inputs)
    if workers == 1:  # requests shared runs (the model process of --workers waits only to fill a padded
        # bucket, and this small model answers each request before the next arrives: on 2026-12-03 one run each)
        assert batches["deploykit_batch_size_count"] < len(inputs)


def test_on_a_gpu_serve_takes_http_workers_by_default(bundle):
    """Without --workers, a model on a GPU is fed by HTTP processes (half the cores, at most 8) and answers
    as ``deploykit.load`` does."""
    from deploykit.serving.placement import auto_workers

    workers = auto_workers(("cuda:0",))
    features = np.random.default_rng(1).standard_normal((3, 13)).astype(np.float32)
    with running_server(bundle, "--backend", "onnxruntime", "--device", "cuda:0") as server:
        result = infer_features(server.url, MODEL, features)
        started = " ".join(all_started(server).split())  # the console may wrap its line anywhere between words
    assert (f"{workers} workers)" in started) == (workers > 1), started
    expected = deploykit.load(bundle, backend="onnxruntime", device="cuda:0").run(features=features)
    np.testing.assert_allclose(result["output_0"], expected["output_0"], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_one_instance_per_gpu(bundle):
    """--device cuda --instances 2 on two GPUs: one runner on each, both answering; cuda:K beyond them refused."""
    from deploykit.serving.models import ServeOptions, load_models

    model = load_models([bundle], ServeOptions(backend="onnxruntime", devices=("cuda",), instances=2))[0]
    assert [runner.device_id for runner in model.runners] == [0, 1]
    features = np.random.default_rng(0).standard_normal((3, 13)).astype(np.float32)
    first, second = (runner.run(features=features) for runner in model.runners)
    np.testing.assert_allclose(second["output_0"], first["output_0"], rtol=1e-5, atol=1e-6)
    with running_server(bundle, "--backend", "onnxruntime", "--device", "cuda", "--instances", "2") as server:
        config = json.loads(get(server, f"/v2/models/{MODEL}/config")[2])
        assert config["instance_group"] == [{"count": 1, "kind": "KIND_GPU", "gpus": [0, 1]}]
        assert "(cuda:0, cuda:1), 2 instance(s)" in server.output()
    count = torch.cuda.device_count()
    result = run_deploykit("serve", bundle, "--device", f"cuda:{count}")
    assert result.returncode == 2 and f"this process sees {count} GPU(s)" in result.stderr



@pytest.fixture
def shared_buffers(tmp_path):
    """Request buffers of 4 MiB mapped from the RAM disk, as ``serve --workers`` makes them (the driver
    refuses to page-lock a mapping of a file on a disk): ``shared_buffers(n)`` makes n."""
    import mmap
    import os
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="deploykit-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else tmp_path)

    def make(count: int) -> list:
        memories = []
        for index in range(count):
            path = os.path.join(folder, f"buffer-{index}")
            with open(path, "wb") as file:
                file.truncate(4 << 20)
            with open(path, "r+b") as file:
                memories.append(mmap.mmap(file.fileno(), 0))
        return memories

    yield make
    shutil.rmtree(folder)


def test_batches_go_to_the_gpu_from_page_locked_shared_memory(shared_buffers):
    """Rows DMA'd from a page-locked shared-memory buffer into the GPU batch equal numpy's
    concatenation, padding rows that held data are zero again; rows in pageable memory are batched
    on the host instead, then copied to the same GPU batch."""
    from deploykit.serving.staging import DeviceStaging, HostRegistry

    registry = HostRegistry(torch, 0)
    staging = DeviceStaging(torch, torch.device("cuda", 0), registry)
    [shared_buffer] = shared_buffers(1)
    registry.add(shared_buffer)
    assert len(registry) == 1, "cudaHostRegister refused a shared-memory mapping"
    rng = np.random.default_rng(0)
    shared = np.ndarray((5, 3, 64, 128), np.float32, buffer=shared_buffer)
    shared[:] = rng.standard_normal(shared.shape)
    zeros = np.zeros((3, 3, 64, 128), np.float32)
    batch = staging.feeds(["x"], [{"x": shared[:3]}, {"x": shared[3:]}], 5, 8)["x"]
    assert batch.device == torch.device("cuda", 0)
    np.testing.assert_array_equal(batch.cpu().numpy(), np.concatenate([shared, zeros]))
    batch = staging.feeds(["x"], [{"x": shared[:1]}], 1, 4)["x"]
    np.testing.assert_array_equal(batch.cpu().numpy(), np.concatenate([shared[:1], zeros]))
    pageable = rng.standard_normal((2, 3, 64, 128)).astype(np.float32)
    on_host = staging.feeds(["x"], [{"x": shared[:1]}, {"x": pageable}], 3, 4)["x"]
    assert on_host.data_ptr() == batch.data_ptr() and "x" in staging._buffers
    np.testing.assert_array_equal(on_host.cpu().numpy(), np.concatenate([shared[:1], pageable, zeros[:1]]))
    batch = staging.feeds(["x"], [{"x": shared[:2]}], 2, 8)["x"]  # rows 4-7 held data two batches ago
    np.testing.assert_array_equal(batch.cpu().numpy(), np.concatenate([shared[:2], zeros, zeros[:3]]))
    registry.remove(shared_buffer)
    assert len(registry) == 0


def test_a_gpu_batch_from_shared_memory_answers_as_the_runner_does(bundle, shared_buffers, monkeypatch):
    """The model process's path for one batch: request rows in page-locked buffers, batched on the
    GPU, run by ONNX Runtime's CUDA provider with CUDA inputs, each request's rows of the outputs
    copied by DMA into its own buffer (small rows and answers let through here), equal to running
    each request alone; then the same requests with answers too small to be worth a DMA each."""
    from pathlib import Path

    from deploykit.serving import staging as staging_module
    from deploykit.serving.batching import run_rows
    from deploykit.serving.models import ServedModel
    from deploykit.serving.staging import DeviceStaging, HostRegistry

    monkeypatch.setattr(staging_module, "DMA_MIN_BYTES", 0)
    runner = deploykit.load(bundle, backend="onnxruntime", device="cuda:0")
    model = ServedModel(MODEL, Path(bundle), [runner], ["cuda:0"], max_batch=4, buckets=[1, 2, 4], allow_nan=False)
    registry = HostRegistry(torch, 0)
    memories = shared_buffers(2)
    for memory in memories:
        registry.add(memory)
    staging = DeviceStaging(torch, torch.device("cuda", 0), registry)
    rng = np.random.default_rng(1)
    requests = []
    for memory, rows in zip(memories, (2, 1)):
        features = np.ndarray((rows, 13), np.float32, buffer=memory, offset=1 << 20)  # answers go from the start
        features[:] = rng.standard_normal(features.shape)
        requests.append({"features": features})
    expected = [runner.run(features=np.array(request["features"])) for request in requests]
    answers = run_rows(model, runner, requests, [2, 1], staging)
    assert staging._on_device, "the batch was not assembled on the GPU"
    for answer, memory, wanted in zip(answers, memories, expected):
        for name, value in wanted.items():
            assert np.shares_memory(answer[name], np.frombuffer(memory, np.uint8)), "not answered in the buffer"
            np.testing.assert_allclose(answer[name], value, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(staging_module, "DMA_MIN_BYTES", 1 << 20)  # rows through the host, one copy of answers back
    for answer, wanted in zip(run_rows(model, runner, requests, [2, 1], staging), expected):
        for name, value in wanted.items():
            assert isinstance(answer[name], np.ndarray)
            np.testing.assert_allclose(answer[name], value, rtol=1e-5, atol=1e-6)
    for memory in memories:
        registry.remove(memory)


def test_a_one_process_gpu_batch_answers_as_the_runner_does(bundle):
    """``deploykit serve``'s one-process batcher on a GPU: rows assembled in page-locked memory, padded
    (3 rows to a bucket of 4), copied to the GPU whole, run with CUDA inputs, and only the rows that hold
    data copied back; equal to running each request alone."""
    from pathlib import Path

    from deploykit.serving.batching import run_rows
    from deploykit.serving.models import ServedModel
    from deploykit.serving.staging import PinnedStaging

    runner = deploykit.load(bundle, backend="onnxruntime", device="cuda:0")
    model = ServedModel(MODEL, Path(bundle), [runner], ["cuda:0"], max_batch=4, buckets=[1, 2, 4], allow_nan=False)
    staging = PinnedStaging.for_runner(runner, 0)
    rng = np.random.default_rng(2)
    requests = [{"features": rng.standard_normal((rows, 13)).astype(np.float32)} for rows in (2, 1)]
    answers = run_rows(model, runner, requests, [2, 1], staging)
    assert staging._on_device["features"].batch.device == torch.device("cuda", 0)
    for request, answer in zip(requests, answers):
        for name, value in runner.run(features=request["features"]).items():
            assert isinstance(answer[name], np.ndarray) and answer[name].shape == value.shape
            np.testing.assert_allclose(answer[name], value, rtol=1e-5, atol=1e-6)
