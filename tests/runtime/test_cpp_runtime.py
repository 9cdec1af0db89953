"""The C++ runtime (csrc/runtime): deploykit-run gives the Python runtime's outputs.

Built by ``deploykit build-runtime`` (cached: one build for every test and run) against the ONNX
Runtime headers deploykit fetches and the libonnxruntime.so.1.* inside the onnxruntime wheel
(loaded at run time). Its TensorRT path is compiled when TensorRT headers and the CUDA toolkit are
here; it cannot run without a GPU.
Like the Python runtime it refuses a changed bundle, paths out of it, and the bundle's own native
code without --trust-bundle. This build is configured without libtorch (the AOTInductor path and
its build with libtorch: test_cpp_runtime_aoti.py; build-runtime itself: test_build_runtime.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import deploykit
from converted_bundles import converted, copy_bundle, edit_manifest
from cpp_runtime import ROOT, built_runtime, configure_and_build, run_cpp, runtime_defines


@pytest.fixture(scope="module")
def defines() -> list[str]:
    return runtime_defines()


@pytest.fixture(scope="module")
def built() -> tuple[Path, dict]:
    """deploykit-run and build-runtime's JSON about it (which paths it was built with)."""
    build = built_runtime()
    return Path(build["executable"]), build


@pytest.mark.parametrize("name, shape", [("tabular", (3, 13)), ("transformer_mlp", (4, 9, 40))])
@pytest.mark.parametrize("op_library", [True, False], ids=["op-library", "functions"])
def test_outputs_equal_the_python_runtime(tmp_path, built, name, shape, op_library):
    executable, _ = built
    bundle = converted(name)
    runner = deploykit.load(bundle, device="cpu", op_library=op_library)
    (input_name,) = runner.input_names
    array = np.random.default_rng(5).standard_normal(shape, dtype=np.float32)
    np.save(tmp_path / "in.npy", array)
    flags = ["--trust-bundle"] if op_library else ["--no-op-library"]
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
    result = run_cpp(executable, converted("tabular"), "--inputs", tmp_path, "-o", tmp_path, "--repeat", "5",
                     "--trust-bundle")
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
    result = run_cpp(executable, *args, "-o", tmp_path, "--trust-bundle")
    assert result.returncode == code and message in result.stderr, result.stderr


def test_tensorrt_path_is_compiled_and_fails_cleanly_without_tensorrt(tmp_path, built):
    executable, build = built
    if not build["tensorrt"]:
        pytest.skip("TensorRT headers or the CUDA toolkit are missing: the TensorRT path was not compiled")
    np.save(tmp_path / "features.npy", np.ones((2, 13), np.float32))
    result = run_cpp(executable, converted("tabular"), "--backend", "tensorrt", "--inputs", tmp_path, "--trust-bundle")
    if result.returncode == 0:
        pytest.skip("TensorRT runs here")
    assert result.returncode == 3, result.stderr
    assert "built without TensorRT" not in result.stderr
    assert any(text in result.stderr for text in ("cannot load the TensorRT runtime", "has no TensorRT engine",
                                                   "cudaSetDevice failed", "TensorRT cannot load"))


def test_a_build_without_libtorch_says_how_to_get_the_aoti_path(tmp_path, built):
    executable, build = built
    assert not build["aoti"]
    result = run_cpp(executable, converted("tabular"), "--backend", "aoti", "--inputs", features(tmp_path),
                     "--trust-bundle")
    assert result.returncode == 3, result.stderr
    assert "built without libtorch" in result.stderr and "-DDEPLOYKIT_WITH_LIBTORCH=ON" in result.stderr


def test_embedding_example_builds_and_runs(tmp_path_factory, defines):
    build = tmp_path_factory.mktemp("example-build")
    configure_and_build(ROOT / "examples" / "cpp", build, *defines)
    result = run_cpp(build / "embed", converted("tabular"), "--trust-bundle")
    assert result.returncode == 0, result.stderr
    assert "output_0: float32 1x4 first=" in result.stdout and "output_1: float32 1x16" in result.stdout


# --------------------------------------------------------------------------- a bundle from a stranger

OP_LIBRARY = "libdeploykit_ort.so"


def features(directory: Path) -> Path:
    np.save(directory / "features.npy", np.ones((2, 13), np.float32))
    return directory


def record_file(bundle: Path, name: str) -> None:
    """Give the manifest the sha256 and size of bundle/name as it is now, as a forger would."""
    data = (bundle / name).read_bytes()
    edit_manifest(bundle, lambda m: m["files"].update({name: {"sha256": hashlib.sha256(data).hexdigest(),
                                                              "bytes": len(data)}}))


def engine_file(bundle: Path) -> str:
    engines = json.loads((bundle / "manifest.json").read_text()).get("engines", [])
    if not engines:
        pytest.skip("the bundle has no TensorRT engine here")
    return engines[0]["file"]


@pytest.mark.parametrize("name", ["model.onnx", OP_LIBRARY, "engine"])
def test_a_changed_file_is_refused_by_name(tmp_path, built, name):
    executable, build = built
    bundle = copy_bundle("tabular", tmp_path)
    backend = ["--backend", "tensorrt"] if name == "engine" else []
    if name == "engine":
        if not build["tensorrt"]:
            pytest.skip("the TensorRT path was not compiled")
        name = engine_file(bundle)
    with (bundle / name).open("ab") as handle:
        handle.write(b"\0")
    result = run_cpp(executable, bundle, "--inputs", features(tmp_path), "-o", tmp_path, "--trust-bundle", *backend)
    assert result.returncode == 2, result.stderr
    assert f"{name} does not match its sha256 in manifest.json" in result.stderr


@pytest.mark.parametrize("case", ["absolute", "dot-dot", "symlink"])
@pytest.mark.parametrize("entry", ["model", "op library"])
def test_a_manifest_path_out_of_the_bundle_is_refused(tmp_path, built, case, entry):
    executable, _ = built
    bundle = copy_bundle("tabular", tmp_path / "b")
    original = "model.onnx" if entry == "model" else OP_LIBRARY
    outside = tmp_path / ("outside.onnx" if entry == "model" else "outside.so")
    shutil.copy(bundle / original, outside)
    name = {"absolute": str(outside), "dot-dot": f"../../{outside.name}", "symlink": original}[case]
    if case == "symlink":
        (bundle / original).unlink()
        (bundle / original).symlink_to(outside)

    def point_at_outside(manifest):
        manifest["files"][name] = manifest["files"][original]
        if entry == "model":
            manifest["model"] = name
        else:
            manifest["custom_op_libraries"][0]["file"] = name
    edit_manifest(bundle, point_at_outside)
    result = run_cpp(executable, bundle, "--inputs", features(tmp_path), "-o", tmp_path, "--trust-bundle")
    assert result.returncode == 2, result.stderr
    expected = "leads out of the bundle" if case == "symlink" else "which is not a path inside the bundle"
    assert expected in result.stderr and name in result.stderr, result.stderr


@pytest.mark.parametrize("text, message", [
    ("{not json", "manifest.json: not JSON"),
    ("[1, 2]", "must be a JSON object, not array"),
    ('{"format": "deploykit-bundle", "format_version": "one"}', "'format_version' must be a whole number"),
    ('{"format": "deploykit-bundle", "format_version": 2}', "format_version 2; this deploykit-run reads 1"),
    ('{"format": "other", "format_version": 1}', "'format' must be \"deploykit-bundle\""),
    ('{"format": "deploykit-bundle", "format_version": 1, "model": "model.onnx"}', "'files' is missing"),
    ('{"format": "deploykit-bundle", "format_version": 1, "model": 3, "files": {}}', "'model' must be a string"),
])
def test_a_malformed_manifest_is_bad_input(tmp_path, built, text, message):
    executable, _ = built
    bundle = copy_bundle("tabular", tmp_path)
    (bundle / "manifest.json").write_text(text)
    result = run_cpp(executable, bundle, "--inputs", features(tmp_path), "-o", tmp_path)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "internal error" not in result.stderr


def test_the_op_library_needs_consent_or_a_library_of_ones_own(tmp_path, built):
    executable, _ = built
    bundle = converted("tabular")
    refused = run_cpp(executable, bundle, "--inputs", features(tmp_path), "-o", tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert f"{bundle / OP_LIBRARY} is native code from the bundle" in refused.stderr
    assert "--trust-bundle" in refused.stderr and not (tmp_path / "output_0.npy").exists()
    own = tmp_path / "mine.so"
    shutil.copy(bundle / OP_LIBRARY, own)
    ran = run_cpp(executable, bundle, "--inputs", tmp_path, "-o", tmp_path, "--op-library", own)
    assert ran.returncode == 0 and f"op library: {own}" in ran.stderr, ran.stderr


def constructor_library(directory: Path, marker: Path) -> Path:
    """A shared library whose constructor writes `marker`: it shows whether anything loaded it."""
    source = directory / "constructor.c"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void mark(void) {\n'
                      f'  FILE* f = fopen("{marker}", "w"); if (f) fclose(f);\n}}\n')
    library = directory / "libconstructor.so"
    compiled = subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", library, source],
                              capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr
    return library


def test_a_swapped_op_library_with_its_sha256_updated_never_loads_without_consent(tmp_path, built):
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    executable, _ = built
    marker = tmp_path / "constructor-ran"
    bundle = copy_bundle("tabular", tmp_path / "b")
    shutil.copy(constructor_library(tmp_path, marker), bundle / OP_LIBRARY)
    record_file(bundle, OP_LIBRARY)
    refused = run_cpp(executable, bundle, "--inputs", features(tmp_path), "-o", tmp_path)
    assert refused.returncode == 2 and "is native code from the bundle" in refused.stderr, refused.stderr
    assert not marker.exists()
    trusted = run_cpp(executable, bundle, "--inputs", tmp_path, "-o", tmp_path, "--trust-bundle")
    assert marker.exists(), trusted.stderr  # the consent is what stood between the bundle and its code


def test_an_engine_with_plugins_needs_consent(tmp_path, built):
    executable, build = built
    if not build["tensorrt"]:
        pytest.skip("the TensorRT path was not compiled")
    bundle = converted("tabular")
    name = engine_file(bundle)
    result = run_cpp(executable, bundle, "--backend", "tensorrt", "--inputs", features(tmp_path), "-o", tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"{bundle / name} is native code from the bundle" in result.stderr and "--plugin PATH" in result.stderr
