"""``deploykit.load`` and ``deploykit bench`` on the GPU.

The runtime keeps fp32 exact in ONNX Runtime's CUDA EP (which rounds to TF32 unless told not
to) unless asked, and serves a process without torch through cuda-python. Bench runs every contender on one bench stream, timed by CUDA events: an fp16 bundle of model_zoo's tabular net is benched with the fp32 bundle as its baseline and
a re-exported plain graph, so one run exercises ONNX Runtime on a caller's stream (with and
without CUDA graphs), the fp16 PyTorch contenders and the plain export made before PyTorch
touched the model.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
if CUDA not in ort.get_available_providers() or not torch.cuda.is_available():
    pytest.skip(f"needs a GPU and onnxruntime-gpu's {CUDA}", allow_module_level=True)

import model_zoo  # noqa: E402

import deploykit  # noqa: E402
from deploykit.runtime import random_inputs  # noqa: E402
from deploykit.testing import randomize_batch_norm  # noqa: E402
from deploykit_cli import run_deploykit  # noqa: E402


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> Path:
    """tabular.pt and its fp32 and fp16 bundles, batch 1..8."""
    folder = tmp_path_factory.mktemp("bundles")
    torch.manual_seed(0)
    weights = folder / "tabular.pt"
    torch.save(randomize_batch_norm(model_zoo.tabular(), seed=2).state_dict(), weights)
    for precision in ("fp32", "fp16"):
        result = run_deploykit("convert", weights, "--factory", "model_zoo:tabular", "--input", "features:1x13",
                               "--batch", "1:4:8", "--precision", precision, "-o", folder / precision)
        assert result.returncode == 0, result.stderr
    return folder


def test_fp32_stays_fp32_in_the_cuda_ep_unless_tf32_is_asked_for(bundles):
    feeds = random_inputs(deploykit.load(bundles / "fp32", device="cpu").inputs, 8, seed=3)
    expected = deploykit.load(bundles / "fp32", device="cpu").run(feeds)
    exact = deploykit.load(bundles / "fp32", device="cuda")
    assert exact.session.get_provider_options()[CUDA]["use_tf32"] == "0"
    for name, array in exact.run(feeds).items():
        np.testing.assert_allclose(array, expected[name], rtol=1e-4, atol=1e-5)
    fast = deploykit.load(bundles / "fp32", device="cuda", tf32=True)
    assert fast.session.get_provider_options()[CUDA]["use_tf32"] == "1" and "TF32 on" in fast.notes[-1]


NO_TORCH = """
import sys
sys.modules["torch"] = None  # this process has no torch: device memory comes from cuda-python
import cupy, numpy as np, deploykit
bundle, out = sys.argv[1], sys.argv[2]
features = np.random.default_rng(4).standard_normal((5, 13), dtype=np.float32)
runner = deploykit.load(bundle, device="cuda")
outputs = runner(features=cupy.asarray(features))  # __cuda_array_interface__ in ...
device = {name: cupy.asarray(array).get() for name, array in outputs.items()}  # ... and out
np.savez(out, features=features, **device)
print(runner.describe()["provider"], sorted(type(a).__name__ for a in outputs.values()))
"""


def test_device_arrays_without_torch(bundles, tmp_path):
    pytest.importorskip("cupy")
    result = subprocess.run([sys.executable, "-c", NO_TORCH, str(bundles / "fp32"), str(tmp_path / "out.npz")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == CUDA and "DeviceArray" in result.stdout
    with np.load(tmp_path / "out.npz") as saved:
        expected = deploykit.load(bundles / "fp32", device="cpu")(saved["features"])
        for name, array in expected.items():
            np.testing.assert_allclose(saved[name], array, rtol=1e-4, atol=1e-5)


def test_bench_times_every_gpu_contender_with_cuda_events(bundles, tmp_path):
    weights = bundles / "tabular.pt"
    result = run_deploykit("bench", bundles / "fp16", "--model", weights, "--factory", "model_zoo:tabular",
                           "--export-plain", "--baseline", bundles / "fp32", "--device", "cuda", "--batch", "1,8",
                           "--iterations", "20", "--warmup", "3", "--json", "-o", tmp_path)
    assert result.returncode == 0, result.stderr
    bench = json.loads(result.stdout)
    assert bench["timing"].startswith("CUDA events")
    entries = {e["key"]: e for e in bench["contenders"]}
    expected = {"pytorch", "torch-compile", "reduce-overhead", "pytorch-fp16", "torch-compile-fp16",
                "reduce-overhead-fp16", "ort-plain", "ort-functions", "ort-deploykit", "ort-cuda-graph", "baseline",
                "baseline-cuda-graph", "deploykit-load"}
    assert {k for k, e in entries.items() if e["status"] == "ok"} == expected, \
        {k: e["reason"] for k, e in entries.items() if e["status"] != "ok"}
    for key in expected:
        rows = entries[key]["results"]
        assert [r["batch"] for r in rows] == [1, 8]
        assert all(0 < r["p50_ms"] <= r["p99_ms"] < 1e3 for r in rows), (key, rows)


# --------------------------------------------------------------------------- the CUDA fast path


def test_cuda_runner_replays_a_graph_per_batch_size_and_matches_the_cpu(bundles):
    cpu = deploykit.load(bundles / "fp32", device="cpu")
    runner = deploykit.load(bundles / "fp32", device="cuda")
    assert runner.describe()["cuda_graph"] is True
    for seed, batch in enumerate((1, 8, 3) * 4 + (8, 1)):  # captured on its third run, then replayed, any order
        features = random_inputs(runner.inputs, batch, seed=seed)["features"]  # new values on every replay
        got = runner(features=torch.from_numpy(features).cuda())
        for name, expected in cpu(features=features).items():
            assert got[name].is_cuda
            np.testing.assert_allclose(got[name].cpu().numpy(), expected, rtol=1e-4, atol=1e-5)
    assert len(runner.cuda_runs.plans) == 3
    assert all(plan.graph is not None for plan in runner.cuda_runs.plans.values()), runner.notes


class _SynchronizingSession:
    """A session whose run synchronises the device while a stream captures: the capture must fail."""

    def __init__(self, session):
        self.session = session

    def __getattr__(self, name):
        return getattr(self.session, name)

    def run_with_iobinding(self, binding, options):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        return self.session.run_with_iobinding(binding, options)


def test_a_shape_whose_capture_fails_runs_uncaptured_with_a_note(bundles):
    cpu = deploykit.load(bundles / "fp32", device="cpu")
    runner = deploykit.load(bundles / "fp32", device="cuda")
    runner.cuda_runs.session = _SynchronizingSession(runner.cuda_runs.session)
    for seed in range(5):
        features = random_inputs(runner.inputs, 4, seed=seed)["features"]
        got = runner(features=torch.from_numpy(features).cuda())
        for name, expected in cpu(features=features).items():
            np.testing.assert_allclose(got[name].cpu().numpy(), expected, rtol=1e-4, atol=1e-5)
    (plan,) = runner.cuda_runs.plans.values()
    assert plan.graph is None and plan.uncapturable
    assert [note for note in runner.notes if "4x13 runs without a CUDA graph" in note], runner.notes


def test_two_runners_capturing_in_two_threads_at_once_both_match_the_cpu(bundles):
    """Two sessions of one process capture CUDA graphs at the same time (serve's instances on one GPU):
    ONNX Runtime captures in CUDA's global mode, so without backends.base.capture's lock one
    capture breaks the other (CUDA errors 900/901)."""
    cpu = deploykit.load(bundles / "fp32", device="cpu")
    runners = [deploykit.load(bundles / "fp32", device="cuda") for _ in range(2)]
    batches = (1, 8, 3, 1, 8, 3, 5, 1)
    feeds = {batch: random_inputs(cpu.inputs, batch, seed=batch)["features"] for batch in batches}
    start, errors = threading.Barrier(len(runners), timeout=60), []

    def serve(runner):
        try:
            start.wait()
            for _ in range(3):
                for batch in batches:
                    got = runner(features=torch.from_numpy(feeds[batch]).cuda())
                    for name, expected in cpu(features=feeds[batch]).items():
                        np.testing.assert_allclose(got[name].cpu().numpy(), expected, rtol=1e-4, atol=1e-5)
        except Exception as error:  # noqa: BLE001 - reported by the test thread
            errors.append(error)

    threads = [threading.Thread(target=serve, args=(runner,)) for runner in runners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors[0]
    assert all(len(runner.cuda_runs.plans) == 4 for runner in runners)


def test_outputs_handed_out_are_not_overwritten_by_the_next_replay(bundles):
    runner = deploykit.load(bundles / "fp32", device="cuda")
    first_in, second_in = (torch.from_numpy(random_inputs(runner.inputs, 4, seed=s)["features"]).cuda()
                           for s in (1, 2))
    first = {name: tensor.clone() for name, tensor in runner(features=first_in).items()}
    kept = runner(features=first_in)
    runner(features=second_in)
    for name, tensor in kept.items():
        torch.testing.assert_close(tensor, first[name])


def test_the_caller_stream_is_ordered_without_a_device_synchronize(bundles):
    """Inputs computed on a side stream right before the call, outputs read on it right after; the
    shape's graph, captured from calls on the default stream, is replayed on the side stream."""
    runner = deploykit.load(bundles / "fp32", device="cuda")
    cpu = deploykit.load(bundles / "fp32", device="cpu")
    features = random_inputs(runner.inputs, 8, seed=5)["features"]
    for seed in range(3):
        runner(features=torch.from_numpy(random_inputs(runner.inputs, 8, seed=seed)["features"]).cuda())
    assert all(plan.graph is not None for plan in runner.cuda_runs.plans.values()), runner.notes
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the input is written long after the call is queued
        given = torch.from_numpy(features).cuda(non_blocking=True) * 1.0
        got = {name: tensor * 1.0 for name, tensor in runner(features=given).items()}
    side.synchronize()
    for name, expected in cpu(features=features).items():
        np.testing.assert_allclose(got[name].cpu().numpy(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("options", [{"cuda_graph": False}, {"prefer_nhwc": True}])
def test_cuda_runner_options_give_the_same_outputs(bundles, options):
    cpu = deploykit.load(bundles / "fp16", device="cpu")
    runner = deploykit.load(bundles / "fp16", device="cuda", **options)
    assert runner.describe()["cuda_graph"] is (options.get("cuda_graph") is not False)
    feeds = random_inputs(runner.inputs, 5, seed=7)
    numpy_out = runner(feeds)  # numpy in, numpy out, through the same plans
    for name, expected in cpu(feeds).items():
        assert isinstance(numpy_out[name], np.ndarray)
        np.testing.assert_allclose(numpy_out[name].astype(np.float32), expected.astype(np.float32),
                                   rtol=2e-2, atol=2e-2)
