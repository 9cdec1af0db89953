"""deploykit's ONNX Runtime op library (plugins/onnxruntime) on the CPU execution provider.

Builds libdeploykit_ort.so through deploykit.native.build.build_plugins (CUDA code for sm_90 only, to
keep the compile short), loads it with register_custom_ops_library and checks hand-built
deploykit::FusedBatchNorm / deploykit::MatMulRelu graphs against numpy. The graph builders and
references here are shared with tests/gpu/test_ort_cuda.py.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from deploykit.native import build as native
from deploykit.errors import EnvironmentProblem

TEST_CUDA_ARCHS = "90"
OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("deploykit", 1)]
ONNX_TYPES = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}

# X shapes of rank 2..5 with odd sizes; the last ones are large enough to be split into chunks
# on ORT's thread pool, with chunk edges inside rows.
BN_SHAPES = [(3, 5), (2, 7, 9), (2, 3, 5, 7), (1, 4, 3, 5, 6), (3, 5, 1, 1), (2, 3, 181, 190), (1, 7, 70001)]
# (A shape, N): A of rank 2 and 3, K and N odd; the last is split by rows on the thread pool.
MATMUL_CASES = [((5, 7), 9), ((2, 3, 7), 9), ((1, 1), 1), ((3, 65, 129), 67)]


# --------------------------------------------------------------------------- graph builders


def model(op: str, inputs: list[str], elem_type: int, attributes: dict | None = None,
          functions: list[onnx.FunctionProto] | None = None) -> bytes:
    """A one-node model `Y = deploykit::op(inputs)` with dynamic shapes."""
    node = helper.make_node(op, inputs, ["Y"], domain="deploykit", **(attributes or {}))
    graph = helper.make_graph(
        [node], op, [helper.make_tensor_value_info(name, elem_type, None) for name in inputs],
        [helper.make_tensor_value_info("Y", elem_type, None)])
    proto = helper.make_model(graph, opset_imports=OPSETS, functions=functions or [])
    proto.ir_version = 10  # readable by every onnxruntime deploykit supports
    return proto.SerializeToString()


def batch_norm_model(dtype=np.float32, activation: str | None = "none", functions=None) -> bytes:
    attributes = {} if activation is None else {"activation": activation}
    return model("FusedBatchNorm", ["X", "scale", "bias"], ONNX_TYPES[dtype], attributes, functions)


def matmul_relu_model(dtype=np.float32, bias: bool = True) -> bytes:
    return model("MatMulRelu", ["A", "B", "bias"] if bias else ["A", "B"], ONNX_TYPES[dtype])


def bfloat16_matmul_relu_model(bias: bool) -> bytes:
    """MatMulRelu on bfloat16 between Casts, so numpy can feed and read float32."""
    inputs = ["A", "B", "bias"] if bias else ["A", "B"]
    casts = [helper.make_node("Cast", [name], [f"{name}_bf16"], to=TensorProto.BFLOAT16) for name in inputs]
    nodes = casts + [
        helper.make_node("MatMulRelu", [f"{name}_bf16" for name in inputs], ["Y_bf16"], domain="deploykit"),
        helper.make_node("Cast", ["Y_bf16"], ["Y"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes, "bf16", [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in inputs],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    proto = helper.make_model(graph, opset_imports=OPSETS)
    proto.ir_version = 10
    return proto.SerializeToString()


def batch_norm_function(rank: int) -> onnx.FunctionProto:
    """The ONNX fallback body of FusedBatchNorm (activation none) for one input rank."""
    shape = helper.make_tensor("shape", TensorProto.INT64, [rank - 1], [-1] + [1] * (rank - 2))
    nodes = [
        helper.make_node("Constant", [], ["shape"], value=shape),
        helper.make_node("Reshape", ["scale", "shape"], ["s"]),
        helper.make_node("Reshape", ["bias", "shape"], ["b"]),
        helper.make_node("Mul", ["X", "s"], ["xs"]),
        helper.make_node("Add", ["xs", "b"], ["Y"]),
    ]
    return helper.make_function("deploykit", "FusedBatchNorm", ["X", "scale", "bias"], ["Y"], nodes,
                                [helper.make_opsetid("", 17)])


# --------------------------------------------------------------------------- inputs and references


def batch_norm_inputs(shape, dtype, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    channels = shape[1]
    return {"X": rng.standard_normal(shape).astype(dtype),
            "scale": rng.uniform(0.5, 2.0, channels).astype(dtype) * rng.choice([-1, 1], channels).astype(dtype),
            "bias": rng.standard_normal(channels).astype(dtype)}


def batch_norm_reference(feeds, activation: str) -> np.ndarray:
    x = feeds["X"].astype(np.float32)
    expand = (-1,) + (1,) * (x.ndim - 2)
    y = x * feeds["scale"].astype(np.float32).reshape(expand) + feeds["bias"].astype(np.float32).reshape(expand)
    return np.maximum(y, 0) if activation == "relu" else y


def matmul_inputs(a_shape, n, dtype, bias: bool, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {"A": rng.standard_normal(a_shape).astype(dtype),
             "B": (rng.standard_normal((a_shape[-1], n)) / np.sqrt(a_shape[-1])).astype(dtype)}
    if bias:
        feeds["bias"] = rng.standard_normal(n).astype(dtype)
    return feeds


def matmul_reference(feeds) -> np.ndarray:
    y = feeds["A"].astype(np.float32) @ feeds["B"].astype(np.float32)
    if "bias" in feeds:
        y = y + feeds["bias"].astype(np.float32)
    return np.maximum(y, 0)


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded (to nearest even) to what bfloat16 can hold."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def tolerance(dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == np.float32 else {"rtol": 5e-3, "atol": 5e-3}


# --------------------------------------------------------------------------- sessions and profiles

_profile_ids = itertools.count()


def session(model_bytes: bytes, library: Path | None, providers=("CPUExecutionProvider",),
            profile: bool = False, threads: int = 2) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    if profile:
        options.enable_profiling = True
        options.profile_file_prefix = f"deploykit_profile_{os.getpid()}_{next(_profile_ids)}"
    if library is not None:
        options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model_bytes, options, providers=list(providers))


def profiled_nodes(sess: ort.InferenceSession) -> list[dict]:
    """op_name, provider and input element types of every node ORT ran, from its profile."""
    path = Path(sess.end_profiling())
    try:
        events = json.loads(path.read_text())
    finally:
        path.unlink(missing_ok=True)
    return [{"op": e["args"]["op_name"], "provider": e["args"]["provider"],
             "types": [next(iter(shape)) for shape in e["args"].get("input_type_shape", [])]}
            for e in events if e.get("cat") == "Node" and "op_name" in e.get("args", {})]


def profile_cases(dtype) -> list[tuple[str, bytes, dict[str, np.ndarray]]]:
    """One model per op, with feeds, for checking which kernel ORT ran."""
    return [("FusedBatchNorm", batch_norm_model(dtype, "relu"), batch_norm_inputs((2, 3, 4, 5), dtype)),
            ("MatMulRelu", matmul_relu_model(dtype), matmul_inputs((2, 4, 6), 3, dtype, True))]


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
