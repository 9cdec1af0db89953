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
from serving import get, infer_features, metric_samples, running_server  # noqa: E402

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

