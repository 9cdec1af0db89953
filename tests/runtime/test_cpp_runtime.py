"""The C++ runtime (csrc/runtime): deploykit-run gives the Python runtime's outputs.

Built by ``deploykit build-runtime`` (cached: one build for every test and run) against the ONNX
Runtime headers deploykit fetches and the libonnxruntime.so.1.* inside the onnxruntime wheel
(loaded at run time). Its TensorRT path is compiled when TensorRT headers and the CUDA toolkit are
here; it cannot run without a GPU.
Like the Python runtime it refuses a changed bundle, paths out of it, and native code from the bundle
that this machine's deploykit did not build or write unless --trust-bundle (tested with the foreign
library of the Python side's tests, tests/helpers/foreign_library.py). This build is configured
without libtorch (the AOTInductor path and its build with libtorch: test_cpp_runtime_aoti.py;
build-runtime itself: test_build_runtime.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import deploykit
from converted_bundles import converted, copy_bundle, edit_manifest
from cpp_runtime import (ROOT, built_runtime, configure_and_build, run_cpp, runtime_defines, with_cache,
                         without_cache)
from deploykit.bundle import trust
from deploykit.bundle.read import open_bundle
from deploykit.native import build as native
from foreign_library import LIBRARY, foreign_bundle


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


@pytest.mark.slow
def test_embedding_example_builds_and_runs(tmp_path_factory, defines):
    build = tmp_path_factory.mktemp("example-build")
    configure_and_build(ROOT / "examples" / "cpp", build, *defines)
    result = run_cpp(build / "embed", converted("tabular"))  # converted here: its op library needs no consent
    assert result.returncode == 0, result.stderr
    assert "output_0: float32 1x4 first=" in result.stdout and "output_1: float32 1x16" in result.stdout


# --------------------------------------------------------------------------- a bundle from a stranger

def features(directory: Path) -> Path:
    np.save(directory / "features.npy", np.ones((2, 13), np.float32))
    return directory


def engine_file(bundle: Path) -> str:
    engines = json.loads((bundle / "manifest.json").read_text()).get("engines", [])
    if not engines:
        pytest.skip("the bundle has no TensorRT engine here")
    return engines[0]["file"]


@pytest.mark.parametrize("name", ["model.onnx", LIBRARY, "engine"])
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
    original = "model.onnx" if entry == "model" else LIBRARY
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


# --------------------------------------------------------------------------- whose native code runs: trust.py's rule

def python_provenance(bundle: Path, kind: str = trust.OP_LIBRARY) -> str:
    """What the Python runtime (deploykit.bundle.trust) makes of the bundle's native file of ``kind`` here."""
    [native] = [n for n in trust.native_files(open_bundle(bundle)) if n.kind == kind]
    return native.provenance


def assert_refused(result: subprocess.CompletedProcess, library: Path) -> None:
    """Exit 2 and one line naming the library, the rule it failed and the ways out."""
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert f"{library} is native code this machine's deploykit did not build" in line, line
    assert all(way in line for way in ("--trust-bundle", "--op-library PATH", "--no-op-library")), line


def test_a_bundle_converted_here_runs_without_consent_saying_why(tmp_path, built):
    executable, _ = built
    bundle = converted("tabular")
    result = run_cpp(executable, bundle, "--inputs", features(tmp_path), "-o", tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"op library: {bundle / LIBRARY} ({trust.WRITTEN_HERE})" in result.stderr
    assert python_provenance(bundle) == trust.WRITTEN_HERE


def test_a_library_identical_to_this_machines_build_runs_without_consent(tmp_path, built, monkeypatch):
    """A cache that never wrote the bundle, whose build manifest lists a library of the same bytes."""
    executable, _ = built
    bundle = converted("tabular")
    cache = tmp_path / "cache"
    (cache / "build" / "key" / "lib").mkdir(parents=True)
    shutil.copy(bundle / LIBRARY, cache / "build" / "key" / "lib" / LIBRARY)
    listed = {"libraries": {"onnxruntime": f"lib/{LIBRARY}"}}
    (cache / "build" / "key" / native.MANIFEST).write_text(json.dumps(listed))
    result = run_cpp(executable, bundle, "--inputs", features(tmp_path), "-o", tmp_path, env=with_cache(cache))
    assert result.returncode == 0, result.stderr
    assert f"op library: {bundle / LIBRARY} ({trust.SAME_AS_BUILD})" in result.stderr
    monkeypatch.setenv("DEPLOYKIT_CACHE", str(cache))
    assert python_provenance(bundle) == trust.SAME_AS_BUILD


@pytest.mark.parametrize("variable", ["DEPLOYKIT_CACHE", "HOME"])
def test_with_an_empty_cache_the_bundles_library_is_foreign(tmp_path, built, monkeypatch, variable):
    """An empty $DEPLOYKIT_CACHE, or no DEPLOYKIT_CACHE and a $HOME whose ~/.cache/deploykit is empty."""
    executable, _ = built
    bundle = converted("tabular")
    empty = tmp_path / "empty"
    empty.mkdir()
    env = with_cache(empty) if variable == "DEPLOYKIT_CACHE" else {**without_cache(), "HOME": str(empty)}
    assert_refused(run_cpp(executable, bundle, "--inputs", features(tmp_path), "-o", tmp_path, env=env),
                   bundle / LIBRARY)
    assert not (tmp_path / "output_0.npy").exists()
    monkeypatch.delenv("DEPLOYKIT_CACHE", raising=False)
    monkeypatch.setenv(variable, str(empty))
    assert python_provenance(bundle) == trust.FOREIGN


def test_a_foreign_library_is_refused_and_runs_with_consent_saying_so(tmp_path, built):
    """The stranger's library of tests/helpers/foreign_library.py, as the Python runtime's tests use it."""
    executable, _ = built
    bundle, marker = foreign_bundle(tmp_path)
    assert_refused(run_cpp(executable, bundle, "--inputs", features(tmp_path), "-o", tmp_path), bundle / LIBRARY)
    assert not marker.exists()
    assert python_provenance(bundle) == trust.FOREIGN
    assert deploykit.load(bundle, device="cpu").library != bundle / LIBRARY and not marker.exists()
    trusted = run_cpp(executable, bundle, "--inputs", tmp_path, "-o", tmp_path, "--trust-bundle")
    assert trusted.returncode == 0, trusted.stderr
    assert f"op library: {bundle / LIBRARY} (trusted with --trust-bundle)" in trusted.stderr
    assert marker.read_text() == "loaded"  # the consent is what stood between the bundle and its code


def test_a_library_of_ones_own_instead_of_a_foreign_one(tmp_path, built):
    executable, _ = built
    bundle, marker = foreign_bundle(tmp_path)
    own = tmp_path / "mine.so"
    shutil.copy(converted("tabular") / LIBRARY, own)
    ran = run_cpp(executable, bundle, "--inputs", features(tmp_path), "-o", tmp_path, "--op-library", own)
    assert ran.returncode == 0 and f"op library: {own}\n" in ran.stderr, ran.stderr
    assert not marker.exists()


def test_a_foreign_engine_with_plugins_needs_consent(tmp_path, built):
    executable, build = built
    if not build["tensorrt"]:
        pytest.skip("the TensorRT path was not compiled")
    bundle = converted("tabular")
    name = engine_file(bundle)
    result = run_cpp(executable, bundle, "--backend", "tensorrt", "--inputs", features(tmp_path), "-o", tmp_path,
                     env=with_cache(tmp_path / "empty"))
    assert result.returncode == 2, result.stderr
    assert f"{bundle / name} is native code this machine's deploykit did not build" in result.stderr
    assert "--plugin PATH" in result.stderr


def test_an_engine_converted_here_runs_its_plugins_without_consent(tmp_path, built):
    """Without a GPU, TensorRT itself is what is missing then (exit 3); with one, the engine runs, saying why."""
    executable, build = built
    if not build["tensorrt"]:
        pytest.skip("the TensorRT path was not compiled")
    bundle = converted("tabular")
    engine_file(bundle)
    result = run_cpp(executable, bundle, "--backend", "tensorrt", "--inputs", features(tmp_path), "-o", tmp_path)
    assert "did not build" not in result.stderr, result.stderr
    assert result.returncode == 3 or f"(its plugins: {trust.WRITTEN_HERE})" in result.stderr, result.stderr
    assert python_provenance(bundle, trust.ENGINE) == trust.WRITTEN_HERE
