"""Converted models run in ONNX Runtime's CUDA execution provider with our CUDA kernels.

Each model (random weights, randomised BatchNorm statistics) goes through
``deploykit.api.convert`` (CPU validation included); its bundle then runs on the GPU with
deploykit's op library and must match PyTorch (fp32, CPU). ORT's profile must show every
deploykit node executed by CUDAExecutionProvider, i.e. by our CUDA kernels. TF32 is off
in the provider so the comparison holds at fp32 tolerances.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
if CUDA not in ort.get_available_providers():
    pytest.skip(f"onnxruntime {ort.__version__} has no {CUDA} (install onnxruntime-gpu)", allow_module_level=True)

import model_zoo  # noqa: E402
import op_library_cases as ort_cases  # noqa: E402  (session and profile helpers)

from deploykit.api import ConvertOptions, convert  # noqa: E402
from deploykit.backends.torch.runner import flatten_outputs  # noqa: E402
from deploykit.validation.compare import Tolerance, compare_output  # noqa: E402
from deploykit.specs import BatchRange, InputSpec  # noqa: E402
from deploykit.testing import randomize_batch_norm  # noqa: E402

# factory -> (input, deploykit op the bundle must contain and run on the GPU)
MODELS = {
    "densenet121": ("x:1x3x64x57", "FusedBatchNorm"),
    "resnet18": ("x:1x3x67x53", None),
    "transformer_mlp": ("tokens:1x33x40", "MatMulRelu"),
    "tabular": ("features:1x13", "MatMulRelu"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_bundle_runs_our_cuda_kernels_and_matches_pytorch(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)  # ORT writes its profile into the working directory
    spec, op = MODELS[name]
    torch.manual_seed(0)
    model = randomize_batch_norm(getattr(model_zoo, name)(), seed=5)
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    result = convert(ConvertOptions(
        model=tmp_path / "weights.pt", output=tmp_path / "bundle", factory=f"model_zoo:{name}",
        inputs=[InputSpec.parse(spec)], batch=BatchRange(1, 2, 5),
    ))
    assert result.passed, result.report["failures"]
    library = result.report["custom_ops"]["library"]
    assert (op is None) == (library is None)

    onnx_model = onnx.load(tmp_path / "bundle" / "model.onnx")
    providers = [(CUDA, {"use_tf32": "0"}), "CPUExecutionProvider"]
    session = ort_cases.session(onnx_model.SerializeToString(), tmp_path / "bundle" / library if library else None,
                                providers, profile=True)
    spec = InputSpec.parse(spec).with_batch(5)
    x = np.random.default_rng(7).standard_normal(spec.shape, dtype=np.float32)
    actual = session.run(None, {spec.name: x})
    with torch.inference_mode():
        expected = [t.numpy() for t in flatten_outputs(model.eval()(torch.from_numpy(x)))]
    assert len(actual) == len(expected)
    for index, (want, got) in enumerate(zip(expected, actual)):
        comparison = compare_output(f"output {index}", want, got, Tolerance.for_precision("fp32"))
        assert comparison.passed, comparison.failures

    ran = ort_cases.profiled_nodes(session)
    ours = [node for node in ran if node["op"] == op]
    if op is not None:
        assert ours and all(node["provider"] == CUDA for node in ours), ours
    print(f"{name}: max abs {comparison.metrics['max_abs']:.3g}, {len(ours)} {op} nodes ran on CUDA")
