"""TensorRT-RTX on a machine without a GPU: our plugin library, engines with and without it.

TensorRT-RTX builds engines ahead of time on the CPU, so CI checks here what it can: that
libdeploykit_trt.so builds and loads without a GPU, that the ONNX parser turns deploykit nodes
into our IPluginV3 plugins when the library is loaded (and inlines the ONNX local functions when
it is not), that the engine carries the library, and how the parser treats function overloads.
Running engines needs an RTX-class GPU: that test is marked `gpu`.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from deploykit.native import build as native
from deploykit.backends.tensorrt import builder as dk_trt, compat, inspector, shim
from deploykit.backends.tensorrt.runner import TensorRTRunner
from deploykit.errors import BadInputError, DeployKitError, EnvironmentProblem

try:
    RTX = shim.load_tensorrt("tensorrt-rtx")
except EnvironmentProblem as problem:
    pytest.skip(f"TensorRT-RTX is not importable ({problem})", allow_module_level=True)

TEST_CUDA_ARCHS = "90"  # one architecture keeps the compile short; tests/native/test_ort_library.py shares the build
TARGETS = ["8.6", "12.0"]
BATCH = (1, 4, 16)
CHANNELS = 8


@pytest.fixture(scope="module")
def plugin_library() -> Path:
    """libdeploykit_trt.so from deploykit.native.build (TensorRT 10.14 headers from kernel-lens)."""
    build = native.build_plugins(cuda_architectures=TEST_CUDA_ARCHS)
    assert build.tensorrt_library is not None, f"no TensorRT plugin library: {build.disabled.get('tensorrt')}"
    return build.tensorrt_library


# --- models --------------------------------------------------------------------------------


def _opsets():
    return [helper.make_opsetid("", 17), helper.make_opsetid("deploykit", 1)]


def fused_batch_norm_function(activation: str, overload: str = "") -> onnx.FunctionProto:
    """The rank-4 fallback body: act(X * reshape(scale) + reshape(bias))."""
    nodes = [
        helper.make_node("Constant", [], ["shape"], value=numpy_helper.from_array(np.array([-1, 1, 1], np.int64))),
        helper.make_node("Reshape", ["scale", "shape"], ["s"]),
        helper.make_node("Reshape", ["bias", "shape"], ["b"]),
        helper.make_node("Mul", ["X", "s"], ["xs"]),
        helper.make_node("Add", ["xs", "b"], ["Y" if activation == "none" else "affine"]),
    ]
    if activation == "relu":
        nodes.append(helper.make_node("Relu", ["affine"], ["Y"]))
    function = helper.make_function("deploykit", "FusedBatchNorm", ["X", "scale", "bias"], ["Y"], nodes,
                                    [helper.make_opsetid("", 17)], attributes=["activation"])
    function.overload = overload
    return function


def fused_batch_norm_model(activations=("relu",), dtype=np.float32, overloads=False) -> onnx.ModelProto:
    """A chain of FusedBatchNorm nodes named bn0, bn1, ... over a (N, C, 5, 5) input."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    rng = np.random.default_rng(0)
    initializers = [numpy_helper.from_array(rng.standard_normal(CHANNELS).astype(dtype), name)
                    for name in ("scale", "bias")]
    nodes, current = [], "x"
    for index, activation in enumerate(activations):
        output = "y" if index == len(activations) - 1 else f"t{index}"
        node = helper.make_node("FusedBatchNorm", [current, "scale", "bias"], [output], name=f"bn{index}",
                                domain="deploykit", activation=activation)
        if overloads:
            node.overload = activation
        nodes.append(node)
        current = output
    functions = ([fused_batch_norm_function(a, overload=a) for a in dict.fromkeys(activations)]
                 if overloads else [fused_batch_norm_function(activations[0])])
    graph = helper.make_graph(nodes, "bn", [helper.make_tensor_value_info("x", elem, ["N", CHANNELS, 5, 5])],
                              [helper.make_tensor_value_info("y", elem, ["N", CHANNELS, 5, 5])], initializers)
    model = helper.make_model(graph, opset_imports=_opsets(), functions=functions, ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def matmul_relu_model(with_bias: bool, k: int = 16, n: int = 32) -> onnx.ModelProto:
    """MatMulRelu over a (N, 4, K) input, B constant (K, N), optional bias."""
    rng = np.random.default_rng(0)
    inputs = ["A", "B", "bias"] if with_bias else ["A", "B"]
    body = [helper.make_node("MatMul", ["A", "B"], ["ab"])]
    if with_bias:
        body.append(helper.make_node("Add", ["ab", "bias"], ["pre"]))
    body.append(helper.make_node("Relu", ["pre" if with_bias else "ab"], ["Y"]))
    function = helper.make_function("deploykit", "MatMulRelu", inputs, ["Y"], body, [helper.make_opsetid("", 17)])
    initializers = [numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "B")]
    if with_bias:
        initializers.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "bias"))
    node = helper.make_node("MatMulRelu", ["a", *inputs[1:]], ["y"], name="mm0", domain="deploykit")
    graph = helper.make_graph([node], "mm", [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 4, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, n])], initializers)
    model = helper.make_model(graph, opset_imports=_opsets(), functions=[function], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def _build(model: onnx.ModelProto, library: Path | None = None, **options) -> dk_trt.EngineBuild:
    options = {"batch": BATCH, "targets": TARGETS, **options}
    return dk_trt.build_engine(model.SerializeToString(), plugin_library=library, flavour="tensorrt-rtx", **options)


def _types(build: dk_trt.EngineBuild) -> list[str]:
    return [layer["type"] for layer in build.layers]


# --- tests ---------------------------------------------------------------------------------


def test_library_loads_without_a_gpu_and_exports_only_the_entry_points(plugin_library):
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(plugin_library)], capture_output=True,
                             text=True, check=True).stdout
    assert sorted(line.split()[-1] for line in symbols.splitlines()) == ["getCreators", "setLoggerFinder"]
    needed = subprocess.run(["readelf", "-d", str(plugin_library)], capture_output=True, text=True).stdout
    assert "libcuda" not in needed and "libcudart" not in needed and "libnvinfer" not in needed
    library = ctypes.CDLL(str(plugin_library))
    count = ctypes.c_int32()
    library.getCreators.restype = ctypes.c_void_p
    assert library.getCreators(ctypes.byref(count)) and count.value == 2


def test_registry_finds_our_creators_by_op_type(plugin_library):
    dk_trt.load_plugin_library(plugin_library, "tensorrt-rtx")
    creators = {(c.name, c.plugin_version, c.plugin_namespace)
                for c in RTX.module.get_plugin_registry().all_creators}
    assert {("FusedBatchNorm", "1", ""), ("MatMulRelu", "1", "")} <= creators


def test_rtx_library_link_exists_before_parsing():
    link = dk_trt.ensure_rtx_library_link()
    if link is not None:  # None: not the PyPI wheel layout
        assert link.exists() and os.readlink(link) == "libtensorrt_rtx.so.1"


@pytest.mark.parametrize("activation", ["relu", "none"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_fused_batch_norm_becomes_our_plugin(plugin_library, activation, dtype):
    build = _build(fused_batch_norm_model((activation,), dtype=dtype), plugin_library)
    assert build.flavour == "tensorrt-rtx" and build.targets == tuple(TARGETS)
    assert [(l["name"], l["plugin"], l["version"], l["config"]) for l in build.plugin_layers] == [
        ("bn0", "FusedBatchNorm", "1", f"FusedBatchNorm(activation={activation})")]
    assert "ACTIVATION" not in _types(build)  # the function body is not in the network
    library = plugin_library.read_bytes()
    assert library in build.engine, "the engine must carry the plugin library (plugins_to_serialize)"
    assert len(build.engine) > len(library)


@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_relu_becomes_our_plugin(plugin_library, with_bias):
    build = _build(matmul_relu_model(with_bias), plugin_library, batch=(1, 2, 8))
    assert [(l["name"], l["plugin"]) for l in build.plugin_layers] == [("mm0", "MatMulRelu")]
    assert "MATRIX_MULTIPLY" not in _types(build)
    assert plugin_library.read_bytes() in build.engine


def test_without_the_library_the_parser_inlines_the_functions(plugin_library):
    for model, expected in ((fused_batch_norm_model(("relu",)), {"ELEMENTWISE", "ACTIVATION"}),
                            (matmul_relu_model(True), {"MATRIX_MULTIPLY", "ACTIVATION"})):
        build = _build(model)
        assert build.plugin_layers == () and build.plugin_library is None
        assert expected <= set(_types(build))
        assert plugin_library.read_bytes()[:4096] not in build.engine
        assert len(build.engine) < plugin_library.stat().st_size


def test_rtx_parser_ignores_function_overloads():
    """FINDING (TensorRT-RTX 1.7): the parser keys local functions by (domain, name) only.

    With two FusedBatchNorm functions, overloads "relu" and "none", and one node using each,
    ONNX Runtime runs each node's own overload, but TensorRT-RTX inlines the *first* function
    listed for both nodes, silently: the result is wrong without our plugin library. If this
    starts failing, RTX has learned overloads: update docs/ops.md and deploykit/ops.
    """
    import onnxruntime as ort

    activations = ("relu", "none")
    forward = fused_batch_norm_model(activations, overloads=True)
    x = np.random.default_rng(1).standard_normal((2, CHANNELS, 5, 5)).astype(np.float32)
    scale, bias = (numpy_helper.to_array(t).reshape(1, -1, 1, 1) for t in forward.graph.initializer)
    expected = np.maximum(x * scale + bias, 0) * scale + bias
    ort_y = ort.InferenceSession(forward.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(ort_y, expected, rtol=1e-5, atol=1e-5)  # ONNX Runtime honours overloads

    learned = "TensorRT-RTX now honours function overloads: revisit deploykit/ops and this test"
    assert _types(_build(forward)).count("ACTIVATION") == 2, learned  # relu listed first: both get Relu
    backward = fused_batch_norm_model(activations, overloads=True)
    backward.functions.reverse()
    assert _types(_build(backward)).count("ACTIVATION") == 0, learned  # none listed first: neither does


def test_overloaded_nodes_become_plugins_with_their_own_activation(plugin_library):
    build = _build(fused_batch_norm_model(("relu", "none"), overloads=True), plugin_library)
    assert [(l["name"], l["config"]) for l in build.plugin_layers] == [
        ("bn0", "FusedBatchNorm(activation=relu)"), ("bn1", "FusedBatchNorm(activation=none)")]


def test_parser_errors_name_the_node_and_our_reason(plugin_library):
    with pytest.raises(DeployKitError, match=r'node bn0 \(FusedBatchNorm\).*activation must be "none" or "relu", got "gelu"'):
        _build(fused_batch_norm_model(("gelu",)), plugin_library)


def test_options_are_checked_before_building(tmp_path):
    model = fused_batch_norm_model(("relu",))
    with pytest.raises(BadInputError, match=r"compute capability 9\.0.*supports .*8\.6"):
        _build(model, targets=["9.0"])
    with pytest.raises(BadInputError, match="dynamic dimensions"):
        _build(model, batch=None)
    with pytest.raises(EnvironmentProblem, match="does not exist"):
        _build(model, tmp_path / "missing.so")


def test_from_a_file_with_workspace_and_timing_cache(tmp_path, plugin_library):
    model, cache = tmp_path / "model.onnx", tmp_path / "timing.cache"
    onnx.save(matmul_relu_model(False), model)
    build = dk_trt.build_engine(model, plugin_library=plugin_library, batch=(1, 2, 8), targets=["8.9"],
                                workspace_bytes=64 << 20, timing_cache=cache, flavour="tensorrt-rtx")
    assert build.targets == ("8.9",) and build.plugin_layers and cache.is_file()


def test_missing_tensorrt_says_what_to_install(monkeypatch):
    shim.load_tensorrt.cache_clear()
    monkeypatch.setattr(shim.importlib.util, "find_spec", lambda name, *args: None)
    try:
        with pytest.raises(EnvironmentProblem) as error:
            shim.load_tensorrt()
    finally:
        monkeypatch.undo()
        shim.load_tensorrt.cache_clear()
    assert "pip install tensorrt " in str(error.value)
    assert "pip install tensorrt-rtx-cu13-libs tensorrt-rtx-cu13-bindings" in str(error.value)


def test_unwritable_libs_folder_gives_a_one_line_fix(monkeypatch, tmp_path):
    (tmp_path / "libtensorrt_rtx.so.1").write_bytes(b"")
    spec = importlib.util.spec_from_file_location("tensorrt_rtx_libs", tmp_path / "__init__.py",
                                                  submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(shim.importlib.util, "find_spec", lambda name, *args: spec)

    def refuse(self, target):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "symlink_to", refuse)
    with pytest.raises(EnvironmentProblem, match=r"ln -s libtensorrt_rtx\.so\.1 .*libtensorrt_rtx\.so") as error:
        shim.ensure_rtx_library_link()
    assert "\n" not in str(error.value)


def _rtx_problem_here() -> tuple[bool, str]:
    """(ok, reason) for any TensorRT-RTX engine on this machine."""
    problem = compat.engine_problem_here({"flavour": "tensorrt-rtx", "version": RTX.version})
    return problem is None, problem or ""


def test_can_run_here_says_why_not():
    ok, reason = _rtx_problem_here()
    gpus = shim.local_gpus()
    if isinstance(gpus, str):
        assert not ok and gpus in reason
    elif gpus[0][1] not in shim.rtx_targets(RTX):
        assert not ok and f"compute capability {gpus[0][1]}" in reason
    else:
        assert ok, reason


@pytest.mark.gpu
def test_engine_runs_and_the_inspector_shows_our_plugin(plugin_library):
    ok, reason = _rtx_problem_here()
    if not ok:
        pytest.skip(reason)
    build = _build(fused_batch_norm_model(("relu",)), plugin_library, targets=None)
    assert any(inspector.is_plugin_layer(layer) for layer in inspector.inspect_engine(build))
    x = np.random.default_rng(2).standard_normal((3, CHANNELS, 5, 5)).astype(np.float32)
    scale, bias = (numpy_helper.to_array(t).reshape(1, -1, 1, 1) for t in fused_batch_norm_model().graph.initializer)
    with TensorRTRunner.from_build(build) as runner:
        y = runner.run({"x": x})["y"]
    np.testing.assert_allclose(y, np.maximum(x * scale + bias, 0), rtol=1e-5, atol=1e-5)
