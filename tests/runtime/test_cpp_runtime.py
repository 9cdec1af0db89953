"""The C++ runtime (csrc/runtime): deploykit-run gives the Python runtime's outputs.

Built once per module with CMake against the ONNX Runtime headers deploykit fetches and the
libonnxruntime.so.1.* inside the onnxruntime wheel (loaded at run time). Its TensorRT path is
compiled when TensorRT headers and the CUDA toolkit are here; it cannot run without a GPU.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

import deploykit
from deploykit.native import build as native
from converted_bundles import converted

ROOT = Path(__file__).resolve().parents[2]


def ort_library() -> Path:
    (library,) = (Path(onnxruntime.__file__).parent / "capi").glob("libonnxruntime.so.*")
    return library


def configure_and_build(source: Path, build: Path, *defines: str) -> str:
    configure = subprocess.run(["cmake", "-S", source, "-B", build, *defines], capture_output=True, text=True)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    compiled = subprocess.run(["cmake", "--build", build, "-j2"], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    return configure.stdout


@pytest.fixture(scope="module")
def defines() -> list[str]:
    if shutil.which("cmake") is None:
        pytest.skip("no cmake")
    headers, problem = native.ort_headers()
    if headers is None:
        pytest.skip(f"no ONNX Runtime headers: {problem}")
    trt_headers, _ = native.tensorrt_headers()
    return [f"-DORT_INCLUDE_DIR={headers}", f"-DORT_LIBRARY={ort_library()}", f"-DTENSORRT_INCLUDE_DIR={trt_headers or ''}"]


@pytest.fixture(scope="module")
def built(tmp_path_factory, defines) -> tuple[Path, str]:
    build = tmp_path_factory.mktemp("runtime-build")
    log = configure_and_build(ROOT / "csrc" / "runtime", build, *defines)
    return build / "deploykit-run", log


def run_cpp(executable: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([executable, *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name, shape", [("tabular", (3, 13)), ("transformer_mlp", (4, 9, 40))])
@pytest.mark.parametrize("op_library", [True, False], ids=["op-library", "functions"])
def test_outputs_equal_the_python_runtime(tmp_path, built, name, shape, op_library):
    executable, _ = built
    bundle = converted(name)
    runner = deploykit.load(bundle, device="cpu", op_library=op_library)
    (input_name,) = runner.input_names
    array = np.random.default_rng(5).standard_normal(shape, dtype=np.float32)
    np.save(tmp_path / "in.npy", array)
    flags = [] if op_library else ["--no-op-library"]
    result = run_cpp(executable, bundle, "--input", f"{input_name}=" + str(tmp_path / "in.npy"), "-o", tmp_path, *flags)
    assert result.returncode == 0, result.stderr
    assert ("libdeploykit_ort.so" in result.stderr) is op_library and "ONNX Runtime 1." in result.stderr
    expected = runner(array)
    for output, want in expected.items():
        got = np.load(tmp_path / f"{output}.npy")
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_inputs_from_a_directory_and_repeat(tmp_path, built):
    executable, _ = built
    np.save(tmp_path / "features.npy", np.ones((2, 13), np.float32))
    result = run_cpp(executable, converted("tabular"), "--inputs", tmp_path, "-o", tmp_path, "--repeat", "5")
    assert result.returncode == 0, result.stderr
    assert "(5 runs)" in result.stderr and np.load(tmp_path / "output_1.npy").shape == (2, 16)


@pytest.mark.parametrize("case, code, message", [
    ("dtype", 2, "input features is float64 2x13, the model takes float32 Nx13"),
    ("missing", 2, "missing input features"),
    ("not npy", 2, "is not a .npy file"),
    ("not a bundle", 2, "is not a deploykit bundle"),
    ("ort library", 3, "cannot load ONNX Runtime"),
    ("usage", 2, "unknown option --frobnicate"),
])
def test_errors_have_the_cli_exit_codes(tmp_path, built, case, code, message):
    executable, _ = built
    bundle = converted("tabular")
    np.save(tmp_path / "f64.npy", np.ones((2, 13)))
    (tmp_path / "bad.npy").write_text("hello")
    args = {
        "dtype": [bundle, "--input", f"features={tmp_path / 'f64.npy'}"],
        "missing": [bundle],
        "not npy": [bundle, "--input", f"features={tmp_path / 'bad.npy'}"],
        "not a bundle": [tmp_path],
        "ort library": [bundle, "--ort-library", tmp_path / "libnothing.so", "--inputs", tmp_path],
        "usage": [bundle, "--frobnicate"],
    }[case]
    result = run_cpp(executable, *args, "-o", tmp_path)
    assert result.returncode == code and message in result.stderr, result.stderr


def test_tensorrt_path_is_compiled_and_fails_cleanly_without_tensorrt(tmp_path, built):
    executable, log = built
    if "TensorRT path enabled" not in log:
        pytest.skip("TensorRT headers or the CUDA toolkit are missing: the TensorRT path was not compiled")
    np.save(tmp_path / "features.npy", np.ones((2, 13), np.float32))
    result = run_cpp(executable, converted("tabular"), "--backend", "tensorrt", "--inputs", tmp_path)
    if result.returncode == 0:
        pytest.skip("TensorRT runs here")
    assert result.returncode == 3, result.stderr
    assert "built without TensorRT" not in result.stderr
    assert any(text in result.stderr for text in ("cannot load the TensorRT runtime", "has no TensorRT engine",
                                                   "cudaSetDevice failed", "TensorRT cannot load"))


def test_embedding_example_builds_and_runs(tmp_path_factory, defines):
    build = tmp_path_factory.mktemp("example-build")
    configure_and_build(ROOT / "examples" / "cpp", build, *defines)
    result = run_cpp(build / "embed", converted("tabular"))
    assert result.returncode == 0, result.stderr
    assert "output_0: float32 1x4 first=" in result.stdout and "output_1: float32 1x16" in result.stdout
