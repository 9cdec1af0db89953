"""deploykit's ONNX Runtime op library on the CUDA execution provider (needs onnxruntime-gpu).

The same hand-built graphs as tests/native/test_ort_library.py (tests/helpers/op_library_cases.py), run with
providers [CUDAExecutionProvider, CPUExecutionProvider] and checked against numpy; ORT's
profile must show our nodes assigned to CUDAExecutionProvider. Builds with
DEPLOYKIT_CUDA_ARCHS=90 unless that variable is set. On an offline machine, point
DEPLOYKIT_CACHE at a cache prepared elsewhere with ``deploykit.native.build.fetch_headers()``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

pytestmark = pytest.mark.gpu

CUDA = "CUDAExecutionProvider"
PROVIDERS = (CUDA, "CPUExecutionProvider")

if CUDA not in ort.get_available_providers():
    pytest.skip(f"onnxruntime {ort.__version__} has no {CUDA} (install onnxruntime-gpu)", allow_module_level=True)

import op_library_cases as cases  # noqa: E402  (graph builders and numpy references)

from deploykit.native import build as native  # noqa: E402

# Larger products as well, so the cuBLASLt path (not only small fallbacks) is exercised.
MATMUL_CASES = cases.MATMUL_CASES + [((4, 128, 256), 384), ((1000, 512), 1000)]
INVALID_ARGUMENT = ort.capi.onnxruntime_pybind11_state.InvalidArgument


def cuda_tolerance(dtype) -> dict[str, float]:
    return {"rtol": 1e-4, "atol": 1e-4} if dtype == np.float32 else {"rtol": 1e-2, "atol": 1e-2}


@pytest.fixture(scope="module")
def library() -> Path:
    """The op library built with CUDA (sm_90 unless DEPLOYKIT_CUDA_ARCHS says otherwise)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEPLOYKIT_CUDA_ARCHS", os.environ.get("DEPLOYKIT_CUDA_ARCHS") or cases.TEST_CUDA_ARCHS)
        build = native.build_plugins()
    assert build.ort_library is not None, f"no ORT library: {build.disabled.get('onnxruntime')}"
    assert build.cuda, f"the library was built without CUDA: {build.disabled.get('cuda')}"
    return build.ort_library


@pytest.fixture(scope="module", autouse=True)
def cuda_session_works():
    """Skip (not fail) when the CUDA provider is compiled in but cannot start (no driver/GPU)."""
    relu = helper.make_graph([helper.make_node("Relu", ["X"], ["Y"])], "relu",
                             [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1])],
                             [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1])])
    proto = helper.make_model(relu, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 10
    sess = cases.session(proto.SerializeToString(), None, PROVIDERS)
    if sess.get_providers()[0] != CUDA:
        pytest.skip(f"{CUDA} did not start (no GPU, driver or CUDA libraries)")


@pytest.fixture(autouse=True)
def _profiles_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def run(model_bytes: bytes, library: Path, feeds: dict, **options) -> np.ndarray:
    (y,) = cases.session(model_bytes, library, PROVIDERS, **options).run(None, feeds)
    return y


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("activation", ["none", "relu"])
@pytest.mark.parametrize("shape", cases.BN_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_batch_norm_on_cuda_matches_numpy(library, shape, activation, dtype):
    feeds = cases.batch_norm_inputs(shape, dtype)
    y = run(cases.batch_norm_model(dtype, activation), library, feeds)
    assert y.dtype == dtype and y.shape == shape
    np.testing.assert_allclose(y.astype(np.float32), cases.batch_norm_reference(feeds, activation),
                               **cases.tolerance(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("a_shape,n", MATMUL_CASES, ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else str(c))
def test_matmul_relu_on_cuda_matches_numpy(library, a_shape, n, bias, dtype):
    feeds = cases.matmul_inputs(a_shape, n, dtype, bias)
    y = run(cases.matmul_relu_model(dtype, bias), library, feeds)
    assert y.dtype == dtype and y.shape == a_shape[:-1] + (n,)
    np.testing.assert_allclose(y.astype(np.float32), cases.matmul_reference(feeds), **cuda_tolerance(dtype))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_matmul_relu_bfloat16_on_cuda_matches_numpy(library, bias):
    feeds = {k: cases.round_to_bfloat16(v) for k, v in cases.matmul_inputs((2, 64, 96), 80, np.float32, bias).items()}
    y = run(cases.bfloat16_matmul_relu_model(bias), library, feeds)
    np.testing.assert_allclose(y, cases.matmul_reference(feeds), rtol=3e-2, atol=3e-2)


def test_tf32_is_used_only_when_asked_for_and_stays_close(library):
    feeds = cases.matmul_inputs((256, 512), 256, np.float32, bias=True)
    options = ort.SessionOptions()
    options.add_session_config_entry("deploykit.allow_tf32", "1")
    options.register_custom_ops_library(str(library))
    sess = ort.InferenceSession(cases.matmul_relu_model(np.float32, True), options, providers=list(PROVIDERS))
    (y,) = sess.run(None, feeds)
    np.testing.assert_allclose(y, cases.matmul_reference(feeds), rtol=1e-2, atol=1e-2)


def test_chained_ops_see_each_others_results_on_the_stream(library):
    """FusedBatchNorm feeding MatMulRelu: both run on ORT's stream, in order, without host syncs."""
    nodes = [helper.make_node("FusedBatchNorm", ["X", "scale", "bias"], ["H"], domain="deploykit", activation="relu"),
             helper.make_node("MatMulRelu", ["H", "B"], ["Y"], domain="deploykit")]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("X", "scale", "bias", "B")]
    graph = helper.make_graph(nodes, "chain", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    proto = helper.make_model(graph, opset_imports=cases.OPSETS)
    proto.ir_version = 10
    feeds = cases.batch_norm_inputs((8, 64, 128), np.float32)
    feeds["B"] = cases.matmul_inputs((1, 128), 96, np.float32, False)["B"]
    hidden = cases.batch_norm_reference(feeds, "relu")
    expected = cases.matmul_reference({"A": hidden, "B": feeds["B"]})
    sess = cases.session(proto.SerializeToString(), library, PROVIDERS)
    for _ in range(3):
        np.testing.assert_allclose(sess.run(None, feeds)[0], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_profile_shows_our_nodes_on_the_cuda_provider(library, dtype):
    for op, model_bytes, feeds in cases.profile_cases(dtype):
        sess = cases.session(model_bytes, library, PROVIDERS, profile=True)
        sess.run(None, feeds)
        ours = [node for node in cases.profiled_nodes(sess) if node["op"] == op]
        assert ours and all(node["provider"] == CUDA for node in ours), ours


def test_bad_shapes_on_cuda_are_invalid_arguments(library):
    feeds = cases.batch_norm_inputs((2, 3, 4, 5), np.float32)
    feeds["bias"] = feeds["bias"][:1]
    with pytest.raises(INVALID_ARGUMENT, match=r"got scale \[3\] and bias \[1\]"):
        run(cases.batch_norm_model(), library, feeds)
    feeds = cases.matmul_inputs((2, 7), 9, np.float32, bias=False)
    feeds["B"] = feeds["B"][:6]
    with pytest.raises(INVALID_ARGUMENT, match="needs A of shape"):
        run(cases.matmul_relu_model(bias=False), library, feeds)
