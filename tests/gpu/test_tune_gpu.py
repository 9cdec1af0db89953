"""Tuning on the GPU: ONNX Runtime's CUDA provider with CUDA graphs on and off (and NHWC kernels on
and off for a graph with convolutions), the TensorRT engine where one runs here, each checked and
timed by CUDA events on one stream; ``deploykit.load`` then routes by the table on this GPU and
ignores a table from another GPU, saying so. Bench times torch.compile(mode="reduce-overhead")
with CUDA graphs in fp32 and fp16.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnxruntime as ort
import pytest
import torch

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
if CUDA not in ort.get_available_providers() or not torch.cuda.is_available():
    pytest.skip(f"needs a GPU and onnxruntime-gpu's {CUDA}", allow_module_level=True)

import model_zoo  # noqa: E402
import numpy as np  # noqa: E402

import deploykit  # noqa: E402
from deploykit.runtime import open_bundle, random_inputs  # noqa: E402
from deploykit.testing import randomize_batch_norm  # noqa: E402
from deploykit.tuning.route import TunedRunner  # noqa: E402
from converted_bundles import edit_manifest  # noqa: E402
from deploykit_cli import run_deploykit  # noqa: E402

FAST = ["--iterations", "5", "--warmup", "2"]


def converted(folder: Path, name: str, spec: str, *extra: str) -> tuple[Path, Path]:
    torch.manual_seed(0)
    weights = folder / f"{name}.pt"
    torch.save(randomize_batch_norm(getattr(model_zoo, name)(), seed=2).state_dict(), weights)
    bundle = folder / f"{name}{'-'.join(extra)}"
    result = run_deploykit("convert", weights, "--factory", f"model_zoo:{name}", "--input", spec, "--batch", "1:4:8",
                           "-o", bundle, *extra)
    assert result.returncode == 0, result.stderr
    return bundle, weights


@pytest.fixture(scope="module")
def tabular(tmp_path_factory) -> tuple[Path, Path]:
    return converted(tmp_path_factory.mktemp("tabular"), "tabular", "features:1x13")


def tune(bundle: Path, weights: Path, factory: str) -> dict:
    result = run_deploykit("tune", bundle, "--model", weights, "--factory", factory, "--device", "cuda", "--json",
                           *FAST)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_tune_on_the_gpu_records_this_gpu_and_cuda_graph_candidates(tabular):
    bundle, weights = tabular
    table = tune(bundle, weights, "model_zoo:tabular")
    assert (table["device"], table["gpu"]) == ("cuda", torch.cuda.get_device_name())
    assert table["cuda_arch"] == "{}.{}".format(*torch.cuda.get_device_capability())
    assert [c["batch"] for c in table["choices"]] == [1, 4, 8]
    labels = {c["label"] for c in table["choices"][0]["candidates"]}
    assert {"ONNX Runtime, CUDA, no CUDA graph", "ONNX Runtime, CUDA, CUDA graph"} <= labels
    for choice in table["choices"]:
        [chosen] = [c for c in choice["candidates"] if c["chosen"]]
        assert chosen["passed"] and chosen["p50_ms"] > 0
        timed = [c for c in choice["candidates"] if c["passed"]]
        assert chosen["p50_ms"] == min(c["p50_ms"] for c in timed)


def test_load_routes_on_this_gpu_and_ignores_another(tabular, tmp_path):
    bundle, weights = tabular
    tune(bundle, weights, "model_zoo:tabular")
    runner = deploykit.load(bundle, device="cuda")
    assert isinstance(runner, TunedRunner)
    cpu = deploykit.load(bundle, backend="onnxruntime", device="cpu")
    for batch in (1, 3, 8):
        feeds = random_inputs(cpu.inputs, batch, seed=batch)
        expected = cpu.run(feeds)
        for name, value in runner.run(feeds).items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-5)
    edit_manifest(bundle, lambda m: m["tuning"].update(gpu="NVIDIA Other GPU"))
    other = deploykit.load(bundle, device="cuda")
    assert not isinstance(other, TunedRunner)
    assert any(note.startswith("tuning not used: it was tuned on GPU NVIDIA Other GPU") for note in other.notes)


def test_a_graph_with_convolutions_has_nhwc_candidates(tmp_path):
    bundle, weights = converted(tmp_path, "tiny_conv", "x:1x3x8x8")
    table = tune(bundle, weights, "model_zoo:tiny_conv")
    nhwc = [c for c in table["choices"][0]["candidates"] if "NHWC" in c["label"]]
    assert len(nhwc) == 2  # with and without CUDA graphs
    assert all(c["p50_ms"] is not None or "prefer_nhwc" in c["reason"] for c in nhwc)
    assert open_bundle(bundle).file_problems() == {}


def test_bench_reduce_overhead_runs_cuda_graphs_in_fp32_and_fp16(tmp_path):
    bundle, weights = converted(tmp_path, "tabular", "features:1x13", "--precision", "fp16")
    result = run_deploykit("bench", bundle, "--model", weights, "--factory", "model_zoo:tabular", "--device", "cuda",
                           "--batch", "4", "--only", "reduce-overhead,reduce-overhead-fp16,ort-deploykit,deploykit-load",
                           "--json", "-o", tmp_path, *FAST)
    assert result.returncode == 0, result.stderr
    entries = {e["key"]: e for e in json.loads(result.stdout)["contenders"]}
    for key in ("reduce-overhead", "reduce-overhead-fp16", "ort-deploykit", "deploykit-load"):
        assert entries[key]["status"] == "ok", entries[key]["reason"]
    assert "CPU" not in entries["reduce-overhead"]["label"]
    [fp16] = entries["reduce-overhead-fp16"]["results"]
    [ours] = entries["ort-deploykit"]["results"]
    assert entries["ort-deploykit"]["precision"] == "fp16"
    assert ours["vs_reduce_overhead"] == pytest.approx(ours["p50_ms"] / fp16["p50_ms"])


def test_bench_interleaves_cuda_graph_contenders_at_two_batch_sizes(tmp_path):
    """reduce-overhead in fp32 and fp16, ONNX Runtime's CUDA graph and deploykit.load alive together
    and timed in interleaved rounds; freed (torch.compile reset) before the second batch size."""
    bundle, weights = converted(tmp_path, "tabular", "features:1x13", "--precision", "fp16")
    keys = ("reduce-overhead", "reduce-overhead-fp16", "ort-cuda-graph", "deploykit-load")
    result = run_deploykit("bench", bundle, "--model", weights, "--factory", "model_zoo:tabular", "--device", "cuda",
                           "--batch", "1,8", "--only", ",".join(keys), "--rounds", "3", "--iterations", "6",
                           "--warmup", "2", "--json", "-o", tmp_path)
    assert result.returncode == 0, result.stderr
    entries = {e["key"]: e for e in json.loads(result.stdout)["contenders"]}
    for key in keys:
        assert entries[key]["status"] == "ok", entries[key]["reason"]
        assert [r["batch"] for r in entries[key]["results"]] == [1, 8]
        for row in entries[key]["results"]:
            assert row["rounds"] == 3 and row["iterations"] == 6 and all(ms > 0 for ms in row["round_p50_ms"])
            assert min(row["round_p50_ms"]) <= row["p50_ms"] <= max(row["round_p50_ms"])
