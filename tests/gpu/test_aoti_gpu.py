"""AOTInductor packages on the GPU: ``convert --backend aoti`` compiles cuda packages for this GPU,
finds out whether each replays as a CUDA graph, and the runner's graph replay equals its plain run,
keeps what the caller holds, runs on the caller's stream and serves the dynamic batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU that torch sees", allow_module_level=True)

from converted_bundles import aoti_source_model, converted_aoti  # noqa: E402

import deploykit  # noqa: E402

DYNAMIC = "aoti-cuda-dynamic.pt2"


@pytest.fixture(scope="module")
def bundle() -> Path:
    return converted_aoti()


@pytest.fixture(scope="module")
def model(bundle) -> torch.nn.Module:
    return aoti_source_model(bundle)


def images(batch: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 8, 8, generator=generator).cuda()


def in_pytorch(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(x.cpu())


def test_cuda_packages_for_this_gpu(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    entries = {entry["file"]: entry for entry in manifest["aoti"]}
    assert set(entries) == {DYNAMIC, "aoti-cuda-b1.pt2", "aoti-cuda-b2.pt2", "aoti-cuda-b4.pt2"}
    major, minor = torch.cuda.get_device_capability()
    for entry in entries.values():
        assert entry["device"] == "cuda" and entry["cuda_arch"] == f"{major}.{minor}"
        assert entry["gpu"] == torch.cuda.get_device_name() and entry["torch"] == torch.__version__
        assert entry["validated"] is True and entry["inductor_configs"] == {"freezing": True}
        assert entry["cuda_graph"] is True  # a conv, a norm and a linear layer capture
    assert {n["kind"] for n in manifest["native"]} == {"aoti-package"}


@pytest.mark.parametrize("batch", [1, 3, 4])
def test_graph_replay_equals_plain_run(bundle, model, batch):
    graphs = deploykit.load(bundle, backend="aoti", device="cuda")
    plain = deploykit.load(bundle, backend="aoti", device="cuda", cuda_graph=False)
    assert graphs.describe()["cuda_graph"] and not plain.describe()["cuda_graph"]
    x = images(batch, seed=batch)
    replayed, ran = graphs(x=x)["output"], plain(x=x)["output"]
    assert replayed.is_cuda and replayed.dtype == torch.float32
    torch.testing.assert_close(replayed, ran, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(replayed.cpu(), in_pytorch(model, x), rtol=1e-5, atol=1e-5)  # exact fp32, no TF32


def test_outputs_are_not_overwritten_by_the_next_call(bundle, model):
    runner = deploykit.load(bundle, backend="aoti", device="cuda")
    first_input, second_input = images(2, seed=1), images(2, seed=2)
    first = runner(x=first_input)["output"]
    held = first.clone()
    second = runner(x=second_input)["output"]  # the same graph replayed
    assert first.data_ptr() != second.data_ptr()
    torch.testing.assert_close(first, held, rtol=0, atol=0)
    torch.testing.assert_close(second.cpu(), in_pytorch(model, second_input), rtol=1e-5, atol=1e-5)


def test_runs_on_the_callers_stream(bundle, model):
    runner = deploykit.load(bundle, backend="aoti", device="cuda")
    stream = torch.cuda.Stream()
    x = images(4, seed=4)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = runner(x=x)["output"]
        out = out * 1  # queued behind the replay on the same stream
    stream.synchronize()
    torch.testing.assert_close(out.cpu(), in_pytorch(model, x), rtol=1e-5, atol=1e-5)


def test_dynamic_batch(bundle, model):
    runner = deploykit.load(bundle, backend="aoti", device="cuda", packages="dynamic")
    for batch in (1, 2, 3, 4):
        x = images(batch, seed=10 + batch)
        torch.testing.assert_close(runner(x=x)["output"].cpu(), in_pytorch(model, x), rtol=1e-5, atol=1e-5)
    assert set(runner.served.values()) == {DYNAMIC}


def test_numpy_and_cuda_arrays(bundle, model):
    runner = deploykit.load(bundle, backend="aoti", device="cuda")
    x = images(3, seed=3)
    out = runner(x=x.cpu().numpy())["output"]
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, in_pytorch(model, x).numpy(), rtol=1e-5, atol=1e-5)
    cupy = pytest.importorskip("cupy")
    device_out = runner(x=cupy.asarray(x.cpu().numpy()))["output"]
    assert hasattr(device_out, "__cuda_array_interface__") and not isinstance(device_out, torch.Tensor)
    torch.cuda.synchronize()
    np.testing.assert_allclose(cupy.asnumpy(cupy.asarray(device_out)), out, rtol=1e-6, atol=1e-6)


def test_cuda_n_loads_and_runs_on_gpu_n(bundle, model):
    """device="cuda:1" checks GPU 1's capability (not GPU 0's) and runs there."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs that torch sees")
    runner = deploykit.load(bundle, backend="aoti", device="cuda:1")
    x = images(2).to("cuda:1")
    [output] = runner(x).values()
    assert runner.device_id == 1 and output.device == torch.device("cuda", 1)
    torch.testing.assert_close(output.cpu(), in_pytorch(model, x), rtol=1e-5, atol=1e-5)
