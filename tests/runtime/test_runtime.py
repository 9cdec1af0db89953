"""``deploykit.load``: a bundle runs only when it is the one deploykit validated, and takes
numpy arrays or torch tensors by name.

Bundles are converted once per session (``converted_bundles.converted``) from ``model_zoo``
models; the tabular one also carries a TensorRT-RTX engine when TensorRT-RTX is installed
(it cannot run here: no GPU), so the backend choice and its refusals are tested on the CPU.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

import deploykit
from deploykit import runtime
from deploykit.bundle.format import sha256_of
from deploykit.errors import BadInputError, EnvironmentProblem, ValidationFailed
from converted_bundles import converted, copy_bundle, edit_manifest


@pytest.fixture(scope="module")
def tabular() -> Path:
    return converted("tabular")


@pytest.fixture(scope="module")
def features() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((3, 13), dtype=np.float32)


def plain_ort(bundle: Path, feeds: dict) -> list[np.ndarray]:
    """The bundle's graph in ONNX Runtime without our library (its ONNX functions)."""
    return ort.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_runs_numpy_with_op_library(tabular, features):
    runner = deploykit.load(tabular, device="cpu")
    assert runner.describe()["op_library"] == "libdeploykit_ort.so" and runner.backend == "onnxruntime"
    outputs = runner.run({"features": features})
    assert list(outputs) == ["output_0", "output_1"] == runner.output_names
    for got, want in zip(outputs.values(), plain_ort(tabular, {"features": features})):
        assert isinstance(got, np.ndarray)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_torch_tensors_in_torch_tensors_out(tabular, features):
    runner = deploykit.load(tabular, device="cpu")
    by_numpy = runner(features)  # one bare array for a one-input model
    by_torch = runner(features=torch.from_numpy(features))
    assert all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in by_torch.values())
    for name in runner.output_names:
        np.testing.assert_array_equal(by_torch[name].numpy(), by_numpy[name])


def test_three_dimensional_input_any_batch():
    """Batch 5 lies outside the 1..4 the bundle was validated for: ONNX Runtime runs it when allowed."""
    bundle = converted("transformer_mlp")
    tokens = np.random.default_rng(1).standard_normal((5, 9, 40), dtype=np.float32)
    (want,) = plain_ort(bundle, {"tokens": tokens})
    runner = deploykit.load(bundle, "onnxruntime", "cpu", allow_unvalidated=True)
    np.testing.assert_allclose(runner(tokens)["output"], want, atol=1e-5)


@pytest.mark.parametrize("feeds, message", [
    ({"features": np.zeros((2, 13))}, "is float64, the model takes float32"),
    ({"feature": np.zeros((2, 13), np.float32)}, "no input named feature; the model takes features"),
    ({"features": np.zeros((2, 12), np.float32)}, "has shape 2x12, the model takes batchx13"),
    ({"features": np.zeros(13, np.float32)}, "has shape 13"),
    ({}, "missing features"),
    ({"features": np.ones((2, 13), np.complex128)}, "is complex128, the model takes float32"),
    ({"features": np.ones((2, 13), np.int64)}, "is int64, the model takes float32"),
    ({"features": np.zeros((2, 13), np.float32), "extra": np.zeros(1)}, "no input named extra"),
    ({"features": np.zeros((5, 13), np.float32)}, "has batch 5, outside 1..4, the batches the bundle was validated "
                                                  "for: .*allow_unvalidated=True"),
    ({"features": np.zeros((0, 13), np.float32)}, "has batch 0, outside 1..4"),
])
def test_bad_inputs_are_named(tabular, feeds, message):
    with pytest.raises(BadInputError, match=message):
        deploykit.load(tabular, device="cpu").run(feeds)


def test_unvalidated_batch_runs_when_allowed_and_says_so(tabular):
    runner = deploykit.load(tabular, device="cpu", allow_unvalidated=True)
    assert runner(np.zeros((3, 13), np.float32))["output_0"].shape == (3, 4) and runner.notes == []
    for _ in range(2):
        assert runner(np.zeros((6, 13), np.float32))["output_0"].shape == (6, 4)
    assert runner.notes == ["input features has batch 6, outside 1..4: its outputs were not validated "
                            "(the bundle was validated for that range only)"]
    assert runner.describe()["notes"] == runner.notes


def test_inputs_that_passed_their_checks_pass_again_others_are_checked_on_every_call(tabular, features):
    """A runner remembers the shapes and dtypes that passed its checks; a batch outside the validated
    range is checked, and noted, on every call, and a shape that passed is refused in another dtype."""
    runner = deploykit.load(tabular, device="cpu", allow_unvalidated=True)
    for _ in range(2):
        assert runner(features)["output_0"].shape == (3, 4)
    with pytest.raises(BadInputError, match="is float64, the model takes float32"):
        runner(features.astype(np.float64))
    for _ in range(2):
        runner.notes.clear()
        runner(np.zeros((6, 13), np.float32))
        assert runner.notes == ["input features has batch 6, outside 1..4: its outputs were not validated "
                                "(the bundle was validated for that range only)"]


def test_torch_inputs_that_require_grad_or_are_strided(tabular, features):
    runner = deploykit.load(tabular, device="cpu")
    want = runner(features)
    requiring_grad = torch.from_numpy(features.copy()).requires_grad_()
    strided = torch.from_numpy(np.asfortranarray(features))
    assert not strided.is_contiguous()
    for tensor in (requiring_grad, strided):
        got = runner(features=tensor)
        for name in runner.output_names:
            np.testing.assert_array_equal(got[name].numpy(), want[name])
    assert np.shares_memory(runtime.as_feed("features", requiring_grad).value, requiring_grad.detach().numpy())


def test_a_misaligned_array_runs(tabular, features):
    """An array viewed at an odd offset of a byte buffer (as an HTTP body's binary tensor is):
    our kernels refuse misaligned pointers, so the runner hands them an aligned copy."""
    runner = deploykit.load(tabular, device="cpu")
    misaligned = np.frombuffer(b"x" + features.tobytes(), dtype=np.float32, offset=1).reshape(features.shape)
    assert not misaligned.flags.aligned
    got, want = runner(misaligned), runner(features)
    for name in runner.output_names:
        np.testing.assert_array_equal(got[name], want[name])


def test_keywords_given_beside_a_dict_take_its_place(tabular, features):
    given = runtime.collect_feeds({"features": np.zeros_like(features)}, {"features": features},
                                  deploykit.load(tabular, device="cpu").inputs)
    assert given["features"].value is features


def test_failed_validation_refused_unless_allowed(tmp_path, features):
    bundle = copy_bundle("tabular", tmp_path)
    edit_manifest(bundle, lambda m: m["validation"].update(passed=False))
    with pytest.raises(ValidationFailed, match="failed validation.*allow_failed=True") as error:
        deploykit.load(bundle, device="cpu")
    assert error.value.exit_code == 1
    assert deploykit.load(bundle, device="cpu", allow_failed=True)(features)["output_0"].shape == (3, 4)


def test_changed_file_refused(tmp_path, features):
    bundle = copy_bundle("tabular", tmp_path)
    (bundle / "model.onnx").write_bytes((bundle / "model.onnx").read_bytes() + b"\0")
    with pytest.raises(BadInputError, match="model.onnx differs from the file deploykit validated"):
        deploykit.load(bundle, device="cpu")
    (bundle / "libdeploykit_ort.so").unlink()
    with pytest.raises(BadInputError, match="libdeploykit_ort.so is missing"):
        deploykit.load(bundle, device="cpu", verify=False)


def test_unloadable_op_library_explained(tmp_path, features):
    bundle = copy_bundle("tabular", tmp_path)
    library = bundle / "libdeploykit_ort.so"
    library.write_bytes(b"not an ELF file")
    edit_manifest(bundle, lambda m: m["files"]["libdeploykit_ort.so"].update(
        sha256=sha256_of(library)))
    with pytest.raises(EnvironmentProblem, match="cannot load libdeploykit_ort.so.*op_library=False"):
        deploykit.load(bundle, device="cpu", trust_native=True)  # a changed library loads only with consent
    runner = deploykit.load(bundle, device="cpu", op_library=False)
    assert runner.notes == ["op library not loaded: deploykit ops run as their ONNX functions"] and not runner.warnings
    (want, _) = plain_ort(bundle, {"features": features})
    np.testing.assert_allclose(runner(features)["output_0"], want, atol=1e-6)


def test_other_onnxruntime_version_is_a_warning(tmp_path):
    bundle = copy_bundle("tabular", tmp_path)
    edit_manifest(bundle, lambda m: m["versions"].update(onnxruntime="1.20.0"))
    with pytest.warns(RuntimeWarning, match="validated with onnxruntime 1.20.0, running"):
        deploykit.load(bundle, device="cpu")


def test_not_a_bundle_and_newer_format(tmp_path):
    with pytest.raises(BadInputError, match="not a deploykit bundle"):
        deploykit.load(tmp_path)
    bundle = copy_bundle("tabular", tmp_path)
    edit_manifest(bundle, lambda m: m.update(format_version=99))
    with pytest.raises(EnvironmentProblem, match="newer deploykit"):
        deploykit.load(bundle)


def test_bad_backend_and_device(tabular):
    with pytest.raises(BadInputError, match="backend 'tflite'"):
        deploykit.load(tabular, backend="tflite")
    with pytest.raises(BadInputError, match="use auto, cpu, cuda or cuda:N"):
        deploykit.load(tabular, device="gpu")
    with pytest.raises(EnvironmentProblem, match="no CUDAExecutionProvider: .*onnxruntime-gpu"):
        if runtime.ort_has_cuda():
            pytest.skip("onnxruntime-gpu is installed")
        deploykit.load(tabular, backend="onnxruntime", device="cuda")


def test_engine_choice_on_a_machine_without_gpu(tabular):
    manifest = json.loads((tabular / "manifest.json").read_text())
    if not manifest["engines"]:
        pytest.skip("no TensorRT here: the bundle has no engine")
    if runtime.has_gpu():
        pytest.skip("this machine has a GPU")
    runner = deploykit.load(tabular)  # auto: the engine cannot run here, ONNX Runtime does
    assert runner.backend == "onnxruntime"
    assert any("TensorRT engine not used" in note and "need an NVIDIA GPU" in note for note in runner.notes)
    with pytest.raises(EnvironmentProblem, match="cannot run model.fp32.sm86_sm120.engine here"):
        deploykit.load(tabular, backend="tensorrt")
    with pytest.raises(BadInputError, match="TensorRT runs on the GPU only"):
        deploykit.load(tabular, backend="tensorrt", device="cpu")


def test_auto_backend_passes_over_a_foreign_engine_with_plugins(monkeypatch, tmp_path):
    """Where an engine could run, backend="auto" still gives way to ONNX Runtime (with a note) when
    the engine's plugins were not built here and no consent is given; consent or an explicit
    backend="tensorrt" picks the engine (whose loader then asks for consent itself)."""
    from deploykit.bundle.read import Bundle
    from deploykit.runtime import choose

    monkeypatch.setattr(choose, "engine_problem_here", lambda entry: None)  # as on a GPU it was built for
    engine = {"file": "m.engine", "flavour": "tensorrt", "version": "10.14", "targets": ["9.0"], "plugin_layers": 2}
    bundle = Bundle(tmp_path, {"engines": [engine], "files": {"m.engine": {"sha256": "0" * 64, "bytes": 1}}})
    backend, _, notes = choose.choose_backend(bundle, "auto", "auto")
    assert backend == "onnxruntime" and any("not build" in note and "--trust-bundle" in note for note in notes)
    assert choose.choose_backend(bundle, "auto", "auto", trust_native=True)[0] == "tensorrt"
    assert choose.choose_backend(bundle, "tensorrt", "auto")[0] == "tensorrt"
    without_plugins = Bundle(tmp_path, {"engines": [{**engine, "plugin_layers": 0}], "files": bundle.manifest["files"]})
    assert choose.choose_backend(without_plugins, "auto", "auto")[0] == "tensorrt"


ENGINE = {"file": "m.engine", "flavour": "tensorrt-rtx", "version": "1.7.1.116", "targets": ["8.6", "12.0"]}
RTX_TARGETS = ("7.5", "8.0", "8.6", "8.9", "12.0", "12.1")


@pytest.mark.parametrize("installed, gpus, expected", [
    (("1.7.1.116", RTX_TARGETS), (("RTX 4090", "8.9"),), "built for compute capability 8.6, 12.0.*is 8.9"),
    (("1.7.1.116", RTX_TARGETS), (("NVIDIA H200", "9.0"),), "does not run on compute capability 9.0 .*pip install tensorrt"),
    (("1.8.0.1", RTX_TARGETS), (("RTX A6000", "8.6"),), "built with TensorRT-RTX 1.7.1.116 and this machine has 1.8.0.1"),
    ((None, None), (("RTX A6000", "8.6"),), "not installed: pip install tensorrt-rtx-cu13-libs==1.7.1.116"),
    (("1.7.1.116", RTX_TARGETS), "no NVIDIA driver here", "need an NVIDIA GPU and no NVIDIA driver here"),
    (("1.7.1.116", RTX_TARGETS), (("RTX A6000", "8.6"),), None),
])
def test_engine_problem(installed, gpus, expected):
    problem = runtime.engine_problem(ENGINE, installed, gpus)
    assert problem is None if expected is None else re.search(expected, problem), problem


def test_full_tensorrt_engine_on_hopper_is_fine():
    entry = {**ENGINE, "flavour": "tensorrt", "version": "10.14.1", "targets": ["9.0"]}
    assert runtime.engine_problem(entry, ("10.14.1", None), (("NVIDIA H200", "9.0"),)) is None


class FakeCudaArray:
    """Any CUDA array library's object (CuPy, Numba) as the runtime sees it."""

    def __init__(self, shape, typestr="<f4"):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (1234, False),
                                         "strides": None, "version": 3}


def test_cuda_array_interface_inputs(tabular):
    feed = runtime.as_feed("features", FakeCudaArray((2, 13)))
    assert feed.on_device and feed.pointer == 1234 and feed.shape == (2, 13) and feed.dtype == np.float32
    with pytest.raises(BadInputError, match="CUDA array but this runner runs on the CPU"):
        deploykit.load(tabular, device="cpu").run(features=FakeCudaArray((2, 13)))
    array = runtime.DeviceArray(99, (2, 3), np.float16)
    assert array.__cuda_array_interface__["typestr"] == "<f2" and array.nbytes == 12


def test_cuda_python_memory_reports_a_missing_driver():
    if runtime.has_gpu():
        pytest.skip("this machine has a GPU")
    pytest.importorskip("cuda.bindings")
    with pytest.raises(EnvironmentProblem, match="CUDA cudaSetDevice\\(0\\) failed"):
        runtime.CudaPythonMemory(0)


def test_random_inputs_and_npz(tmp_path, tabular):
    specs = deploykit.load(tabular, device="cpu").inputs
    assert runtime.random_inputs(specs)["features"].shape == (2, 13)  # the optimum batch
    assert runtime.random_inputs(specs, batch=4)["features"].shape == (4, 13)
    np.savez(tmp_path / "x.npz", features=np.ones((3, 13)))
    assert runtime.bundle_feeds(specs, tmp_path / "x.npz")["features"].dtype == np.float32
    np.savez(tmp_path / "y.npz", other=np.ones((3, 13)))
    with pytest.raises(BadInputError, match="lacks features"):
        runtime.bundle_feeds(specs, tmp_path / "y.npz")


EXACT_CASTS = {
    "float64": np.random.default_rng(2).standard_normal((3, 13), dtype=np.float32).astype(np.float64),
    "float64 inf nan": np.array([[np.inf, -np.inf, np.nan, -0.0] * 3 + [2.0**127]]),
    "int64": np.arange(-13, 13).reshape(2, 13),
    "complex, no imaginary part": np.arange(13, dtype=np.complex128).reshape(1, 13),
}


@pytest.mark.parametrize("values", EXACT_CASTS.values(), ids=EXACT_CASTS)
def test_npz_casts_where_exact(tmp_path, tabular, values):
    specs = deploykit.load(tabular, device="cpu").inputs
    np.savez(tmp_path / "x.npz", features=values)
    cast = runtime.bundle_feeds(specs, tmp_path / "x.npz")["features"]
    assert cast.dtype == np.float32
    np.testing.assert_array_equal(cast.astype(values.dtype), values)


LOSSY_CASTS = {
    "complex": (np.full((2, 13), 1 + 2j), "complex128, the model takes float32.* 26 of its values .*\(1\+2j\) "
                                          "becomes 1.0"),
    "float64 overflow": (np.full((2, 13), 1e300), "float64, the model takes float32.* 1e\+300 becomes inf"),
    "float64 rounding": (np.full((1, 13), 0.1), "float64, the model takes float32.* 0.1 becomes 0.10000000149"),
    "int64 beyond float32": (np.full((1, 13), 2**24 + 1), "int64, the model takes float32.* 16777217 becomes"),
}


@pytest.mark.parametrize("values, message", LOSSY_CASTS.values(), ids=LOSSY_CASTS)
def test_npz_lossy_cast_refused(tmp_path, tabular, values, message):
    specs = deploykit.load(tabular, device="cpu").inputs
    np.savez(tmp_path / "x.npz", features=values)
    with pytest.raises(BadInputError, match=f"input features is {message}.*: save it as float32"):
        runtime.bundle_feeds(specs, tmp_path / "x.npz")


def test_npz_int64_beyond_int32_refused(tmp_path):
    specs = [{"name": "ids", "dtype": "int32", "shape": [2]}]
    np.savez(tmp_path / "x.npz", ids=np.array([7, -7]))
    assert runtime.bundle_feeds(specs, tmp_path / "x.npz")["ids"].dtype == np.int32
    np.savez(tmp_path / "y.npz", ids=np.array([7, 2**31]))
    with pytest.raises(BadInputError, match="input ids is int64, the model takes int32.* 2147483648 becomes -2147483648"):
        runtime.bundle_feeds(specs, tmp_path / "y.npz")


def test_npz_array_without_an_input_refused(tmp_path, tabular):
    specs = deploykit.load(tabular, device="cpu").inputs
    np.savez(tmp_path / "x.npz", features=np.ones((3, 13), np.float32), mask=np.ones(3))
    with pytest.raises(BadInputError, match="holds mask, which the model has no input for; the model takes "
                                            "features \\(float32, batchx13\\): leave mask out"):
        runtime.bundle_feeds(specs, tmp_path / "x.npz")


def test_runs_without_torch(tabular):
    """The runtime needs numpy and ONNX Runtime only: torch is blocked from importing here."""
    code = ("import sys; sys.modules['torch'] = None; import numpy, deploykit; "
            f"r = deploykit.load({str(tabular)!r}, device='cpu'); "
            "print(r(numpy.ones((2, 13), 'float32'))['output_1'].shape, 'torch' in sys.modules and sys.modules['torch'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "(2, 16) None", result.stderr


def test_output_shapes_follow_the_inputs(tabular, features):
    """What IOBinding preallocates on a GPU: output shapes from the inputs' symbolic sizes."""
    runner = deploykit.load(tabular, device="cpu")
    given = runtime.collect_feeds({"features": features}, {}, runner.inputs)
    assert runner.output_shapes(given) == [(3, 4), (3, 16)]


# --------------------------------------------------------------------------- on a GPU


def _cuda_runner(bundle: Path, backend: str):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU and a CUDA build of torch")
    try:
        return deploykit.load(bundle, backend=backend, device="cuda")
    except EnvironmentProblem as problem:
        pytest.skip(str(problem))


@pytest.mark.gpu
def test_cuda_tensors_stay_on_the_gpu(tabular, features):
    """ONNX Runtime's CUDA EP through IOBinding. (The TensorRT path needs a bundle with an
    engine and a GPU that TensorRT runs on; no machine here has both.)"""
    runner = _cuda_runner(tabular, "onnxruntime")
    outputs = runner(features=torch.from_numpy(features).cuda())
    assert all(t.is_cuda for t in outputs.values())
    reference = deploykit.load(tabular, device="cpu")(features)
    for name, tensor in outputs.items():
        np.testing.assert_allclose(tensor.cpu().numpy(), reference[name], rtol=1e-3, atol=1e-3)
    assert isinstance(runner(features)["output_0"], np.ndarray)


def test_npz_rounding_to_a_narrower_float_only_where_noted(tmp_path):
    """validate's reference runs the rounded values too, so there a rounding is noted, not refused."""
    specs = [{"name": "x", "dtype": "float16", "shape": [2]}]
    np.savez(tmp_path / "x.npz", x=np.array([0.1, 1.0], np.float32))
    with pytest.raises(BadInputError, match="input x is float32, the model takes float16"):
        runtime.bundle_feeds(specs, tmp_path / "x.npz")
    notes: list[str] = []
    assert runtime.bundle_feeds(specs, tmp_path / "x.npz", rounding_notes=notes)["x"].dtype == np.float16
    assert notes == [f"--inputs {tmp_path / 'x.npz'}: input x rounded from float32 to float16, "
                     "the bundle's input dtype (1 values changed)"]
    np.savez(tmp_path / "y.npz", x=np.array([1e6, 1.0], np.float32))
    with pytest.raises(BadInputError, match="1000000.0 becomes inf"):
        runtime.bundle_feeds(specs, tmp_path / "y.npz", rounding_notes=[])


@pytest.mark.parametrize(("precision", "elem_type", "initializer_type"), [
    ("fp32", 1, 1), ("int8", 1, 3), ("fp16", 10, 10), ("bf16", 16, 16), ("fp8", 1, 17), ("fp8", 10, 10)])
def test_a_bundles_precision_skips_the_rewrites_its_graph_would(precision, elem_type, initializer_type):
    """Which of ONNX Runtime's rewrites a bundle's session leaves out follows from its precision as from
    reading its graph (a tensor typed fp16/bf16), so it is not read again; fp8's graph is read (fp16 for
    AOTInductor, fp32 with float8 Q/DQ for TensorRT)."""
    import onnx
    from onnx import helper

    from deploykit.backends.onnxruntime.loader import _broken_rewrites

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", elem_type, [1])],
                              [helper.make_tensor_value_info("y", elem_type, [1])],
                              [helper.make_tensor("w", initializer_type, [1], [0])])
    model = helper.make_model(graph)
    for cpu in (True, False):
        assert _broken_rewrites(model, cpu, precision) == _broken_rewrites(onnx.ModelProto.FromString(
            model.SerializeToString()), cpu)
