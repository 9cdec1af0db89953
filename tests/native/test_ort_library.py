"""deploykit's ONNX Runtime op library (plugins/onnxruntime) on the CPU execution provider.

Builds libdeploykit_ort.so through deploykit.native.build.build_plugins (CUDA code for sm_90 only, to
keep the compile short), loads it with register_custom_ops_library and checks hand-built
deploykit::FusedBatchNorm / deploykit::MatMulRelu graphs (tests/helpers/op_library_cases.py,
shared with tests/gpu/test_ort_cuda.py) against numpy.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from deploykit.native import build as native
from deploykit.errors import EnvironmentProblem
from op_library_cases import (
    BN_SHAPES, MATMUL_CASES, OPSETS, TEST_CUDA_ARCHS, batch_norm_function, batch_norm_inputs,
    batch_norm_model, batch_norm_reference, bfloat16_matmul_relu_model, matmul_inputs,
    matmul_reference, matmul_relu_model, profile_cases, profiled_nodes, round_to_bfloat16, session,
    tolerance,
)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def build():
    """One build of csrc/ (sm_90 only for CUDA) shared by the module."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEPLOYKIT_CUDA_ARCHS", TEST_CUDA_ARCHS)
        result = native.build_plugins()
    assert result.ort_library is not None, f"no ORT library: {result.disabled.get('onnxruntime')}"
    return result


@pytest.fixture(scope="module")
def library(build) -> Path:
    return build.ort_library


@pytest.fixture(autouse=True)
def _test_archs(monkeypatch):
    monkeypatch.setenv("DEPLOYKIT_CUDA_ARCHS", TEST_CUDA_ARCHS)


@pytest.fixture(autouse=True)
def _profiles_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # ORT writes profiles into the working directory


# --------------------------------------------------------------------------- build and load


def test_second_build_is_cached(build):
    start = time.monotonic()
    again = native.build_plugins()
    assert again.cached and again.ort_library == build.ort_library
    assert time.monotonic() - start < 2.0
    assert again.build_dir.parent.parent == native.cache_dir()


def test_find_ort_library_returns_the_built_library(build):
    assert native.find_ort_library() == build.ort_library


def test_library_loads_without_a_gpu_and_exports_only_the_entry_point(library):
    lib = ctypes.CDLL(str(library))
    assert hasattr(lib, "RegisterCustomOps")
    assert not hasattr(lib, "dk_fused_batch_norm_cpu")  # kernels are linked statically, kept private


def test_missing_toolchain_is_an_environment_problem(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(native.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(EnvironmentProblem, match="cmake not found: install") as error:
        native.build_plugins()
    assert error.value.exit_code == 3


def test_cuda_architectures_come_from_argument_then_environment(monkeypatch):
    monkeypatch.delenv("DEPLOYKIT_CUDA_ARCHS")
    assert native.cuda_archs() == native.DEFAULT_CUDA_ARCHITECTURES
    monkeypatch.setenv("DEPLOYKIT_CUDA_ARCHS", "86,90")
    assert native.cuda_archs() == "86;90"
    assert native.cuda_archs([90, "120"]) == "90;120"


def test_apt_sources_in_both_formats_are_parsed():
    one_line = "deb [signed-by=/k.gpg arch=amd64] http://mirror.example/debian bookworm main contrib # x\n"
    deb822 = ("Types: deb\n# comment\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
              "Components: main\n\nTypes: deb\nURIs: http://mirror.example/debian-security\n"
              "Suites: bookworm-security\nComponents: main\nEnabled: no\n")
    assert native._parse_one_line(one_line) == [
        ("deb", "http://mirror.example/debian", ["bookworm"], ["main", "contrib"])]
    assert native._parse_deb822(deb822) == [
        ("deb", "http://mirror.example/debian", ["bookworm", "bookworm-updates"], ["main"])]


# --------------------------------------------------------------------------- FusedBatchNorm


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("shape", BN_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_batch_norm_matches_numpy(library, shape, activation, dtype):
    feeds = batch_norm_inputs(shape, dtype)
    (y,) = session(batch_norm_model(dtype, activation), library).run(None, feeds)
    assert y.dtype == dtype and y.shape == shape
    np.testing.assert_allclose(y.astype(np.float32), batch_norm_reference(feeds, activation), **tolerance(dtype))


def test_fused_batch_norm_activation_defaults_to_none(library):
    feeds = batch_norm_inputs((2, 3, 4), np.float32)
    (y,) = session(batch_norm_model(activation=None), library).run(None, feeds)
    np.testing.assert_allclose(y, batch_norm_reference(feeds, "none"), rtol=1e-6, atol=1e-6)


def test_fused_batch_norm_empty_batch(library):
    feeds = batch_norm_inputs((0, 3, 4), np.float32)
    (y,) = session(batch_norm_model(), library).run(None, feeds)
    assert y.shape == (0, 3, 4)


# --------------------------------------------------------------------------- MatMulRelu


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("a_shape,n", MATMUL_CASES, ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else str(c))
def test_matmul_relu_matches_numpy(library, a_shape, n, bias, dtype):
    feeds = matmul_inputs(a_shape, n, dtype, bias)
    (y,) = session(matmul_relu_model(dtype, bias), library).run(None, feeds)
    assert y.dtype == dtype and y.shape == a_shape[:-1] + (n,)
    np.testing.assert_allclose(y.astype(np.float32), matmul_reference(feeds), **tolerance(dtype))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_matmul_relu_bfloat16_matches_numpy(library, bias):
    feeds = {k: round_to_bfloat16(v) for k, v in matmul_inputs((2, 5, 33), 17, np.float32, bias).items()}
    (y,) = session(bfloat16_matmul_relu_model(bias), library).run(None, feeds)
    np.testing.assert_allclose(y, matmul_reference(feeds), rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------- our kernel is what ran


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_profile_shows_our_kernels_on_the_cpu_provider(library, dtype):
    for op, model_bytes, feeds in profile_cases(dtype):
        sess = session(model_bytes, library, profile=True)
        sess.run(None, feeds)
        # One node, ours, fed the model's own type: ORT inserted no Casts around it.
        assert profiled_nodes(sess) == [{"op": op, "provider": "CPUExecutionProvider",
                                         "types": [np.dtype(dtype).name.replace("32", "")] * 3}]


def test_registered_kernel_is_preferred_over_the_local_function(library):
    feeds = batch_norm_inputs((2, 3, 4, 5), np.float32)
    model_bytes = batch_norm_model(activation=None, functions=[batch_norm_function(4)])
    ours = session(model_bytes, library, profile=True)
    fallback = session(model_bytes, None, profile=True)
    for sess in (ours, fallback):
        (y,) = sess.run(None, feeds)
        np.testing.assert_allclose(y, batch_norm_reference(feeds, "none"), rtol=1e-5, atol=1e-5)
    assert [n["op"] for n in profiled_nodes(ours)] == ["FusedBatchNorm"]
    assert "FusedBatchNorm" not in [n["op"] for n in profiled_nodes(fallback)]


def test_without_library_or_function_the_model_does_not_load():
    with pytest.raises(Exception, match="FusedBatchNorm"):
        session(batch_norm_model(), None)


# --------------------------------------------------------------------------- errors, not crashes


INVALID_ARGUMENT = ort.capi.onnxruntime_pybind11_state.InvalidArgument


def test_wrong_scale_length_is_an_invalid_argument(library):
    feeds = batch_norm_inputs((2, 3, 4, 5), np.float32)
    feeds["scale"] = feeds["scale"][:2]
    with pytest.raises(INVALID_ARGUMENT, match=r"scale and bias must have shape \[C\] = \[3\].*got scale \[2\]"):
        session(batch_norm_model(), library).run(None, feeds)


def test_rank_one_input_is_an_invalid_argument(library):
    feeds = {"X": np.ones(3, np.float32), "scale": np.ones(3, np.float32), "bias": np.ones(3, np.float32)}
    with pytest.raises(INVALID_ARGUMENT, match="X must have rank >= 2"):
        session(batch_norm_model(), library).run(None, feeds)


def test_unknown_activation_fails_at_session_creation(library):
    with pytest.raises(Exception, match='activation must be "none" or "relu", got "gelu"'):
        session(batch_norm_model(activation="gelu"), library)


@pytest.mark.parametrize("change,message", [
    (lambda f: f.update(B=f["B"][:5]), r"B of shape \[K, N\], got A \[2, 7\] and B \[5, 9\]"),
    (lambda f: f.update(bias=f["bias"][:4]), r"bias must have shape \[N\] = \[9\], got \[4\]"),
    (lambda f: f.update(A=f["A"][0]), r"needs A of shape \[\.\.\., M, K\]"),
])
def test_bad_matmul_shapes_are_invalid_arguments(library, change, message):
    feeds = matmul_inputs((2, 7), 9, np.float32, bias=True)
    change(feeds)
    with pytest.raises(INVALID_ARGUMENT, match=message):
        session(matmul_relu_model(bias=True), library).run(None, feeds)


def test_mixed_element_types_are_rejected_when_loading(library):
    node = helper.make_node("FusedBatchNorm", ["X", "scale", "bias"], ["Y"], domain="deploykit")
    graph = helper.make_graph([node], "mixed", [
        helper.make_tensor_value_info("X", TensorProto.FLOAT16, None),
        helper.make_tensor_value_info("scale", TensorProto.FLOAT, None),
        helper.make_tensor_value_info("bias", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT16, None)])
    proto = helper.make_model(graph, opset_imports=OPSETS)
    proto.ir_version = 10
    with pytest.raises(Exception, match="FusedBatchNorm"):
        session(proto.SerializeToString(), library)


def test_cache_dir_follows_deploykit_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DEPLOYKIT_CACHE", str(tmp_path / "carried"))
    assert native.cache_dir() == (tmp_path / "carried").resolve()
    monkeypatch.delenv("DEPLOYKIT_CACHE")
    assert native.cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "deploykit"
