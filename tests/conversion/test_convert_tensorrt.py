"""``convert --backend all`` builds a TensorRT-RTX engine on this GPU-less machine, with our
plugins replacing every deploykit node and the plugin library embedded in the engine.

No TensorRT runtime here can execute it (no GPU; and RTX refuses Hopper): the report must
say so plainly rather than claim a validation it did not do.
"""

import hashlib
import json

import pytest

from deploykit.native import build as native
from bundle_reports import custom_op_counts
from deploykit_cli import convert, run_deploykit
from model_zoo import save_ddp_state_dict

tensorrt = pytest.importorskip("deploykit.backends.tensorrt.shim")
try:
    tensorrt.load_tensorrt()
except Exception as problem:  # noqa: BLE001  (any import failure means: no TensorRT here)
    pytest.skip(f"no TensorRT or TensorRT-RTX: {problem}", allow_module_level=True)

CASES = {  # factory -> (input spec, extra CLI flags)
    # timm's pre-activation ResNet keeps 9 BatchNorms as deploykit nodes, each a plugin layer (densenet121's
    # 62 took three times as long to build and showed nothing more)
    "resnetv2_18": ("x:1x3x67x53", ()),
    "resnet18": ("x:1x3x67x53", ()),
    "transformer_mlp": ("tokens:1x9x40", ()),
    "resnetv2_18-plain": ("x:1x3x67x53", ("--no-custom-ops",)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_engine_with_embedded_plugins(tmp_path, case):
    name = case.removesuffix("-plain")
    spec, flags = CASES[case]
    save_ddp_state_dict(name, tmp_path / "weights.pt")
    result = convert(
        tmp_path, "weights.pt", "--factory", f"model_zoo:{name}", "--input", spec, "--batch", "1:2:4",
        "--backend", "all", "--trt-targets", "8.6,12.0", "-o", "bundle", *flags,
    )
    assert result.returncode == 0, result.stderr
    bundle = tmp_path / "bundle"
    manifest = json.loads((bundle / "manifest.json").read_text())
    report = json.loads((bundle / "report.json").read_text())
    (engine,) = manifest["engines"]
    assert engine["file"] == "model.fp32.sm86_sm120.engine" and engine["file"] in manifest["files"]
    assert engine["flavour"] == "tensorrt-rtx" and engine["targets"] == ["8.6", "12.0"]
    assert not engine["validated"] and "engine built but not executed" in engine["note"]
    assert "not executed" in result.stderr and "not executed" in (bundle / "report.html").read_text()
    nodes = sum(custom_op_counts(report).values())
    assert engine["plugin_layers"] == nodes
    engine_bytes = (bundle / engine["file"]).read_bytes()
    if nodes:
        library = native.build_plugins().tensorrt_library.read_bytes()
        assert engine["plugin_library_sha256"] == hashlib.sha256(library).hexdigest()
        assert library in engine_bytes, "the plugin library must be serialized into the engine"
        assert {layer["plugin"] for layer in engine["plugin_layer_list"]} <= {"FusedBatchNorm", "MatMulRelu"}
    else:
        assert engine["plugin_library_sha256"] is None


@pytest.fixture
def no_gpu_targets(monkeypatch):
    """Hide any GPU from the subprocess: default targets are then every one TensorRT-RTX knows."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    if tensorrt.load_tensorrt().name != "tensorrt-rtx":
        pytest.skip("plain TensorRT builds for the local GPU only: no default target list to trim")


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_linear_head_default_targets_skip_what_tensorrt_refuses(tmp_path, no_gpu_targets, precision):
    """torchvision's resnet18 ends in a Linear layer, which TensorRT-RTX cannot build in fp32 for Turing."""
    save_ddp_state_dict("resnet18", tmp_path / "weights.pt")
    result = convert(tmp_path, "weights.pt", "--factory", "model_zoo:resnet18", "--input", "x:1x3x32x32",
                     "--precision", precision, "--backend", "all", "-o", "bundle")
    assert result.returncode == 0, result.stderr
    bundle = tmp_path / "bundle"
    (engine,) = json.loads((bundle / "manifest.json").read_text())["engines"]
    (reported,) = json.loads((bundle / "report.json").read_text())["engines"]
    every = list(tensorrt.rtx_targets(tensorrt.load_tensorrt()))
    skipped = [{"target": "7.5", "architecture": "Turing", "layer": "node_linear",
                "reason": "FP32 GEMM is not supported"}] if precision == "fp32" else []
    assert engine["skipped_targets"] == reported["skipped_targets"] == skipped
    assert engine["targets"] == [t for t in every if not skipped or t != "7.5"]
    assert engine["file"] == f"model.{precision}.{'_'.join('sm' + t.replace('.', '') for t in engine['targets'])}.engine"
    described = json.loads(run_deploykit("inspect", bundle, "--json").stdout)["engines"][0]
    assert described["targets"] == engine["targets"] and described["skipped_targets"] == skipped
    printed = run_deploykit("inspect", bundle, columns=200).stderr  # rich prints to stderr
    html = (bundle / "report.html").read_text()
    if skipped:
        line = "not built for 7.5 (Turing: layer node_linear: FP32 GEMM is not supported)"
        assert line in result.stderr and line in printed and "FP32 GEMM is not supported" in html
    else:
        assert "not built for" not in result.stderr + printed and "Not built for" not in html


def test_named_targets_none_can_build_is_one_line_with_the_fix(tmp_path, no_gpu_targets):
    save_ddp_state_dict("tiny_conv", tmp_path / "weights.pt")
    result = convert(tmp_path, "weights.pt", "--factory", "model_zoo:tiny_conv", "--input", "x:1x3x8x8",
                     "--backend", "tensorrt", "--trt-targets", "7.5", "-o", "bundle")
    assert result.returncode == 3, result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "cannot build the engine for compute capability 7.5: layer node_linear for Turing (7.5): " \
           "FP32 GEMM is not supported" in line
    assert "--trt-targets 8.0," in line and "--precision fp16" in line and "internal error" not in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "bundle").exists()


def test_int8_for_tensorrt_is_symmetric_qdq_that_tensorrt_builds(tmp_path):
    """``--precision int8 --backend tensorrt``: one quantized graph, validated in ONNX Runtime and built by
    TensorRT, with only what TensorRT takes (int8 activations with zero points 0, float biases); the parser
    turns its Q/DQ nodes into quantize layers, so the engine's convolutions run in int8."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from deploykit.backends.tensorrt.builder import build_engine

    save_ddp_state_dict("residual_conv", tmp_path / "weights.pt")
    np.savez(tmp_path / "calibration.npz", x=np.random.default_rng(5).standard_normal((64, 3, 16, 16), dtype=np.float32))
    result = convert(tmp_path, "weights.pt", "--factory", "model_zoo:residual_conv", "--input", "x:1x3x16x16",
                     "--batch", "1:2:4", "--precision", "int8", "--calibration", "calibration.npz", "--backend",
                     "tensorrt", "--trt-targets", "8.9", "-o", "bundle")
    assert result.returncode == 0, result.stderr
    bundle = tmp_path / "bundle"
    (engine,) = json.loads((bundle / "manifest.json").read_text())["engines"]
    assert engine["file"] == "model.int8.sm89.engine" and engine["targets"] == ["8.9"]
    precision = json.loads((bundle / "report.json").read_text())["precision"]
    assert precision["target"] == "tensorrt" and "zero points 0" in precision["format"] and precision["nodes"]["int8"]
    model = onnx.load(bundle / "model.onnx")
    constants = {tensor.name: numpy_helper.to_array(tensor) for tensor in model.graph.initializer}
    quantizers = [node for node in model.graph.node if node.op_type == "QuantizeLinear"]
    assert quantizers
    for node in quantizers:
        zero_point = constants[node.input[2]]
        assert zero_point.dtype == np.int8 and not zero_point.any(), node.name
    dequantized = [constants[node.input[0]] for node in model.graph.node
                   if node.op_type == "DequantizeLinear" and node.input[0] in constants]
    assert dequantized and all(weights.dtype == np.int8 for weights in dequantized)  # no int32 biases
    build = build_engine(bundle / "model.onnx", batch=(1, 2, 4), input_shapes={"x": (1, 3, 16, 16)}, targets=["8.9"])
    types = {layer["type"] for layer in build.layers}
    assert {"QUANTIZE", "DEQUANTIZE", "CONVOLUTION"} <= types, types


def test_fp8_for_tensorrt_is_float8_qdq_that_tensorrt_builds(tmp_path):
    """``--precision fp8 --backend tensorrt``: float8 e4m3 Q/DQ around the matrix products (per tensor, zero
    points 0), validated in ONNX Runtime, shipped as model.onnx and built by TensorRT into an fp8 engine for
    compute capability 8.9 and newer; older targets are refused in one line, and nothing is written."""
    import numpy as np
    import onnx
    import torch
    from onnx import numpy_helper

    from deploykit.backends.tensorrt.builder import build_engine
    import model_zoo

    torch.manual_seed(0)
    torch.save(model_zoo.transformer_mlp_32().state_dict(), tmp_path / "weights.pt")
    np.savez(tmp_path / "calibration.npz", tokens=np.random.default_rng(5).standard_normal((64, 8, 32), dtype=np.float32))
    common = ("weights.pt", "--factory", "model_zoo:transformer_mlp_32", "--input", "tokens:2x8x32", "--batch", "1:2:4",
              "--precision", "fp8", "--calibration", "calibration.npz", "--backend", "tensorrt")
    refused = convert(tmp_path, *common, "--trt-targets", "8.6", "-o", "old")
    assert refused.returncode == 2 and "fp8 engines need compute capability 8.9 or newer" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "old").exists()

    result = convert(tmp_path, *common, "-o", "bundle")
    assert result.returncode == 0, result.stderr
    bundle = tmp_path / "bundle"
    manifest = json.loads((bundle / "manifest.json").read_text())
    (engine,) = manifest["engines"]
    assert manifest["precision"] == "fp8" and engine["file"].startswith("model.fp8.sm89")
    assert engine["targets"] and all(float(t) >= 8.9 for t in engine["targets"])  # the default: fp8's targets only
    precision = json.loads((bundle / "report.json").read_text())["precision"]
    assert precision["target"] == "tensorrt" and precision["nodes"] == {"fp8": 5, "float": 11}
    assert precision["calibration_method"] == "distribution"
    model = onnx.load(bundle / "model.onnx")
    constants = {tensor.name: numpy_helper.to_array(tensor) for tensor in model.graph.initializer}
    products = [node for node in model.graph.node if node.op_type == "MatMul"]
    producers = {output: node for node in model.graph.node for output in node.output}
    assert len(products) == 5 and all(producers[name].op_type == "DequantizeLinear"
                                      for node in products for name in node.input)
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear":
            zero_point = constants[node.input[2]]
            assert zero_point.dtype.name == "float8_e4m3fn" and not zero_point.astype(float).any()
            assert constants[node.input[1]].shape == ()  # per tensor
    # ONNX Runtime runs the shipped graph as ONNX's reference implementation computes it (its Relu-into-
    # QuantizeLinear rewrite, which would drop the Relus before float8 Q/DQ, is left out)
    from onnx.reference import ReferenceEvaluator

    from deploykit.backends.onnxruntime.runner import OnnxRuntimeRunner

    tokens = np.random.default_rng(9).standard_normal((3, 8, 32), dtype=np.float32)
    (expected,) = ReferenceEvaluator(model).run(None, {"tokens": tokens})
    outputs = OnnxRuntimeRunner.from_model(model).run({"tokens": tokens})
    np.testing.assert_allclose(next(iter(outputs.values())), expected, rtol=1e-5, atol=1e-5)
    build = build_engine(bundle / "model.onnx", batch=(1, 2, 4), input_shapes={"tokens": (2, 8, 32)}, targets=["8.9"])
    types = {layer["type"] for layer in build.layers}
    assert {"QUANTIZE", "DEQUANTIZE", "MATRIX_MULTIPLY"} <= types, types
