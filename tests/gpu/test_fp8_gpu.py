"""``convert --precision fp8 --backend aoti`` on a GPU with fp8 tensor cores: a transformers BERT
(random weights) whose Linear products run in e4m3 through cuBLASLt inside the cuda packages,
validated against PyTorch fp32, and run by ``deploykit.load`` as validated.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU that torch sees", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("fp8 needs compute capability 8.9 or newer", allow_module_level=True)

from deploykit_cli import convert  # noqa: E402

import deploykit  # noqa: E402
import model_zoo  # noqa: E402

INPUTS = ["--input", "input_ids:1x16:int64", "--input", "attention_mask:1x16:int64"]


def _tokens(samples: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, 8, (samples, 16)), "attention_mask": rng.integers(0, 8, (samples, 16))}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8-gpu")
    torch.manual_seed(0)
    torch.save(model_zoo.bert_tiny().state_dict(), folder / "weights.pt")
    np.savez(folder / "calibration.npz", **_tokens(64, seed=7))
    result = convert(folder, "weights.pt", "--factory", "model_zoo:bert_tiny", *INPUTS, "--batch", "1:4:8",
                     "--precision", "fp8", "--backend", "aoti", "--aoti-shapes", "both",
                     "--calibration", "calibration.npz", "-o", "bundle")
    return folder, result


def test_fp8_cuda_packages_pass(converted):
    folder, result = converted
    assert result.returncode == 0, result.stderr
    manifest = json.loads((folder / "bundle" / "manifest.json").read_text())
    assert manifest["precision"] == "fp8" and manifest["aoti"]
    for entry in manifest["aoti"]:
        assert entry["device"] == "cuda" and entry["precision"] == "fp8" and entry["validated"], entry
    assert len(manifest["quantization"]["quantized_nodes"]) == 12  # 2 layers x (q, k, v, output, 2 MLP)


def test_fp8_bundle_runs_as_validated(converted):
    folder, _ = converted
    feeds = _tokens(3, seed=11)
    model = model_zoo.bert_tiny()
    model.load_state_dict(torch.load(folder / "weights.pt"))
    with torch.inference_mode():
        expected = model.eval()(*(torch.from_numpy(a) for a in feeds.values())).numpy()
    runner = deploykit.load(folder / "bundle", backend="aoti", device="cuda")
    got = next(iter(runner(**{name: torch.from_numpy(a).cuda() for name, a in feeds.items()}).values()))
    got = got.float().cpu().numpy()
    cosine = float(np.dot(got.ravel(), expected.ravel()) / np.linalg.norm(got) / np.linalg.norm(expected))
    assert cosine > 0.99, cosine  # fp8's default bound (docs/precision.md)
