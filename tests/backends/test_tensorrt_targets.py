"""Which compute capabilities a TensorRT-RTX engine is built for, on a machine without a GPU.

TensorRT-RTX 1.7 refuses some layers on some targets (an fp32 GEMM on Turing, 7.5). With no
targets given the builder leaves such a target out and records why; targets the caller names
are built as named or not at all; a refusal is exit 3 with the layer, never an internal error.
"""

from __future__ import annotations

import numpy as np
import pytest
import onnx
from onnx import helper, numpy_helper

from deploykit.backends.tensorrt import builder, compat, failures, shim
from deploykit.bundle import schema
from deploykit.conversion import engine
from deploykit.errors import EXIT_ENVIRONMENT, BadInputError
from deploykit.tools import doctor

try:
    RTX = shim.load_tensorrt("tensorrt-rtx")
except Exception as problem:  # noqa: BLE001 - any import failure means: no TensorRT-RTX here
    pytest.skip(f"TensorRT-RTX is not importable ({problem})", allow_module_level=True)

#: The line TensorRT-RTX 1.7.1 logs for an fp32 Linear layer on Turing (a GPU-less build logs CUDA complaints too).
TURING_LOG = ("IBuilder::buildSerializedNetwork: Error Code 1: Myelin ([pass.cpp:337: check_turing_op_compatibility] "
              "Cannot compile operation 'node_linear' for Turing (SM75): FP32 GEMM is not supported. In compileGraph "
              "at /_src/optimizer/myelin/codeGenerator.cpp:2012)")
NO_GPU_LOG = ("[cudaResources.cpp::ScopedCudaStream::25] Error Code 1: Cuda Runtime (cudaError 35: CUDA driver "
              "version is insufficient for CUDA runtime version)")


def linear_head(dtype) -> bytes:
    """A classifier's head alone: one Gemm named "head" over (2, 16) inputs."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((16, 8)).astype(dtype), "w")
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "w"], ["y"], name="head")], "head",
                              [helper.make_tensor_value_info("x", elem, [2, 16])],
                              [helper.make_tensor_value_info("y", elem, [2, 8])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10).SerializeToString()


@pytest.fixture
def no_gpu(monkeypatch):
    """Default targets as on a machine without a GPU, also where there is one."""
    monkeypatch.setattr(builder, "local_gpus", lambda: "no NVIDIA driver here (test)")


def test_the_log_names_layer_target_and_reason():
    (failure,) = failures.layer_failures([NO_GPU_LOG, TURING_LOG])
    assert failure == failures.LayerFailure("node_linear", "7.5", "FP32 GEMM is not supported", "Turing")
    assert str(failure) == "layer node_linear for Turing (7.5): FP32 GEMM is not supported"
    (unknown,) = failures.layer_failures([NO_GPU_LOG, "Error Code 2: something else broke"])
    assert unknown.target is None and unknown.reason == "Error Code 2: something else broke"


def test_fp32_default_targets_leave_out_turing_and_say_why(no_gpu):
    build = builder.build_engine(linear_head(np.float32), flavour="tensorrt-rtx")
    assert build.targets == tuple(t for t in shim.rtx_targets(RTX) if t != "7.5")
    assert [f.to_json() for f in build.skipped] == [
        {"target": "7.5", "architecture": "Turing", "layer": "head", "reason": "FP32 GEMM is not supported"}]


def test_fp16_default_targets_are_every_target(no_gpu):
    build = builder.build_engine(linear_head(np.float16), flavour="tensorrt-rtx")
    assert build.targets == shim.rtx_targets(RTX) and build.skipped == ()


@pytest.mark.parametrize("targets", [["7.5"], ["7.5", "8.6"]])
def test_named_targets_are_built_as_named_or_refused(targets):
    with pytest.raises(failures.EngineBuildError) as error:
        builder.build_engine(linear_head(np.float32), flavour="tensorrt-rtx", targets=targets)
    assert error.value.exit_code == EXIT_ENVIRONMENT and error.value.targets == tuple(targets)
    assert error.value.choices == shim.rtx_targets(RTX)
    assert "layer head for Turing (7.5): FP32 GEMM is not supported" in str(error.value)
    assert "\n" not in str(error.value)


def test_named_targets_that_build_are_honoured():
    build = builder.build_engine(linear_head(np.float32), flavour="tensorrt-rtx", targets=["8.6", "12.0"])
    assert build.targets == ("8.6", "12.0") and build.skipped == ()


def test_a_minimum_capability_narrows_default_targets_and_refuses_older_named_ones(monkeypatch):
    """fp8's minimum (8.9): without targets, RTX's from 8.9 up, also on a GPU too old for it (8.6 here);
    a named older target is refused before any build, in one line."""
    monkeypatch.setattr(builder, "local_gpus", lambda: (("NVIDIA RTX A6000", "8.6"),))
    minimum = engine.FP8_CAPABILITY
    chosen = builder._choose_targets(RTX, None, minimum)
    assert chosen == tuple(t for t in shim.rtx_targets(RTX) if float(t) >= 8.9) and chosen
    with pytest.raises(BadInputError, match=r"8\.9 or newer .*not 8\.0, 8\.6 \(the targets asked for\)"):
        builder._choose_targets(RTX, ["8.0", "8.6", "8.9"], minimum)
    assert builder._choose_targets(RTX, ["8.9"], minimum) == ("8.9",)


SKIPPED = {"target": "7.5", "architecture": "Turing", "layer": "node_linear", "reason": "FP32 GEMM is not supported"}
ENGINE = {"file": "m.engine", "flavour": "tensorrt-rtx", "version": "1.7.1.116", "targets": ["8.0", "8.6"]}


def test_a_turing_gpu_hears_why_the_engine_skipped_it():
    installed = (ENGINE["version"], shim.rtx_targets(RTX))
    problem = compat.engine_problem({**ENGINE, "skipped_targets": [SKIPPED]}, installed, (("Tesla T4", "7.5"),))
    assert "refused layer node_linear there (FP32 GEMM is not supported)" in problem
    assert doctor._engine_fix(problem) == "convert with --precision fp16 --trt-targets 7.5"
    assert compat.engine_problem(ENGINE, installed, (("Tesla T4", "7.5"),)).endswith("--trt-targets 7.5")


def test_manifests_with_and_without_skipped_targets_are_read():
    assert schema.Engine.model_validate(ENGINE).skipped_targets == []
    (skipped,) = schema.Engine.model_validate({**ENGINE, "skipped_targets": [SKIPPED]}).skipped_targets
    assert (skipped.target, skipped.layer, skipped.reason) == ("7.5", "node_linear", "FP32 GEMM is not supported")


def _graph(*nodes) -> onnx.ModelProto:
    return helper.make_model(helper.make_graph(list(nodes), "g", [], []))


def test_the_conversion_names_the_options_that_avoid_the_refusal():
    turing = failures.LayerFailure("head", "7.5", "FP32 GEMM is not supported", "Turing")
    error = failures.EngineBuildError("refused", [turing], ["7.5", "8.6"], shim.rtx_targets(RTX))
    plain = _graph(helper.make_node("Gemm", ["x", "w"], ["y"], name="head"))
    assert engine._fixes(error, plain, "fp32") == [
        "--trt-targets 8.6 (without 7.5)", "--precision fp16", "--backend onnxruntime (no engine)"]
    assert engine._fixes(error, plain, "fp16")[0] == "--trt-targets 8.6 (without 7.5)"
    ours = _graph(helper.make_node("FusedBatchNorm", ["x", "s", "b"], ["y"], name="bn0", domain="deploykit"))
    unnamed = failures.EngineBuildError("parse", [failures.LayerFailure(None, None, "node bn0: bad activation")], [])
    assert engine._fixes(unnamed, ours, "fp32") == ["--no-custom-ops", "--backend onnxruntime (no engine)"]
    assert "--no-custom-ops" not in engine._fixes(error, ours, "fp32")  # the refused layer is not ours
