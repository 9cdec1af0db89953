"""The C++ runtime's AOTInductor path: deploykit-run built with the torch wheel's libtorch runs a
bundle's AOTInductor packages as the Python AOTI runner does.

The build lives in deploykit's cache (one folder per checkout and torch) and CMake rebuilds it
incrementally: 16 s cold on 2 idle cores, 50 s on the shared ones here (a configure of 2-3 s, then
the runtime compiled against libtorch's headers), 3 s when nothing changed. The bundle
(converted_aoti: model_zoo's tiny_conv, batch 1:2:4, static packages for batch 1, 2 and 4 and a
dynamic one over 1..4, as tests/backends/test_aoti.py uses it) is converted once per session.
CUDA packages: tests/gpu/test_cpp_runtime_aoti_cuda.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

import deploykit
from aoti_cases import INPUT, copied, device_of, inputs, package_for, this_machine, tuned
from converted_bundles import converted, converted_aoti, edit_manifest
from cpp_runtime import ROOT, built_with_libtorch, run_cpp, runtime_defines, with_cache
from deploykit.bundle import trust
from deploykit.bundle.read import open_bundle

# libtorch's C++ build and the AOTInductor conversion: minutes on 2 cores (make test-slow, CI)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built() -> tuple[Path, dict]:
    build = built_with_libtorch()
    return Path(build["executable"]), build


@pytest.fixture(scope="module")
def bundle() -> Path:
    return converted_aoti()


@pytest.mark.parametrize("batch", [1, 3, 4])
def test_outputs_equal_the_python_aoti_runner(tmp_path, built, bundle, batch):
    executable, _ = built
    result = run_cpp(executable, bundle, "--backend", "aoti", "--inputs", inputs(tmp_path, batch), "-o", tmp_path,
                     "--trust-bundle")
    assert result.returncode == 0, result.stderr
    assert f"ran: {package_for(bundle, batch)}" in result.stderr, result.stderr
    assert f"on {device_of(bundle)}" in result.stderr
    runner = deploykit.load(bundle, backend="aoti", device=device_of(bundle))
    expected = runner(np.load(tmp_path / f"{INPUT}.npy"))
    for output, want in expected.items():
        got = np.load(tmp_path / f"{output}.npy")
        want = np.asarray(want)
        assert got.dtype == want.dtype and got.shape == want.shape == (batch, 5)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_the_private_copies_of_packages_are_removed(tmp_path, built, bundle):
    """deploykit-run loads a copy of each verified package from a folder of its own, gone at exit."""
    import os

    executable, _ = built
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    result = run_cpp(executable, bundle, "--backend", "aoti", "--inputs", inputs(tmp_path, 1), "-o", tmp_path,
                     "--trust-bundle", env={**os.environ, "TMPDIR": str(temporary)})
    assert result.returncode == 0, result.stderr
    assert not list(temporary.glob("deploykit-aoti-*"))


@pytest.mark.parametrize("choice, batch, runs", [
    (["--aoti-package", "DYNAMIC"], 1, "DYNAMIC"),
    (["--aoti-packages", "dynamic"], 1, "DYNAMIC"),
    (["--aoti-packages", "static"], 4, "STATIC"),
    (["--aoti-packages", "static"], 3, "batch 3 is not one the bundle's AOTInductor packages for"),
    (["--aoti-package", "other.pt2"], 1, "the manifest lists no such AOTInductor package"),
    (["--aoti-packages", "some"], 1, "--aoti-packages some: use both, static or dynamic"),
])
def test_the_packages_of_ones_choice(tmp_path, built, bundle, choice, batch, runs):
    executable, _ = built
    dynamic, static = package_for(bundle, 3), package_for(bundle, batch)
    choice = [dynamic if part == "DYNAMIC" else part for part in choice]
    result = run_cpp(executable, bundle, "--backend", "aoti", *choice, "--inputs", inputs(tmp_path, batch),
                     "-o", tmp_path, "--trust-bundle")
    if runs in ("DYNAMIC", "STATIC"):
        assert result.returncode == 0, result.stderr
        assert f"ran: {dynamic if runs == 'DYNAMIC' else static}" in result.stderr, result.stderr
    else:
        assert result.returncode == 2 and runs in result.stderr, result.stderr


def test_the_package_is_loaded_from_a_private_copy_that_is_removed(tmp_path, built, bundle, monkeypatch):
    executable, _ = built
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setenv("TMPDIR", str(private))
    result = run_cpp(executable, bundle, "--backend", "aoti", "--inputs", inputs(tmp_path, 3), "-o", tmp_path,
                     "--trust-bundle")
    assert result.returncode == 0, result.stderr
    assert not list(private.glob("deploykit-aoti-*"))


def test_packages_converted_here_run_without_consent_saying_why(tmp_path, built, bundle):
    executable, _ = built
    result = run_cpp(executable, bundle, "--backend", "aoti", "--inputs", inputs(tmp_path, 1), "-o", tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"{package_for(bundle, 1)} (batch 1, {trust.WRITTEN_HERE})" in result.stderr, result.stderr


def test_a_foreign_package_needs_consent(tmp_path, built, bundle, monkeypatch):
    """With an empty cache nothing here built or wrote the packages: the Python runtime calls them foreign too."""
    executable, _ = built
    empty = with_cache(tmp_path / "empty")
    result = run_cpp(executable, bundle, "--backend", "aoti", "--inputs", inputs(tmp_path, 1), "-o", tmp_path,
                     env=empty)
    assert result.returncode == 2, result.stderr
    assert "is native code this machine's deploykit did not build" in result.stderr
    assert "--trust-bundle" in result.stderr and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "output.npy").exists()
    trusted = run_cpp(executable, bundle, "--backend", "aoti", "--inputs", tmp_path, "-o", tmp_path, "--trust-bundle",
                      env=empty)
    assert trusted.returncode == 0, trusted.stderr
    assert f"{package_for(bundle, 1)} (batch 1, trusted with --trust-bundle)" in trusted.stderr, trusted.stderr
    monkeypatch.setenv("DEPLOYKIT_CACHE", empty["DEPLOYKIT_CACHE"])
    assert {n.provenance for n in trust.native_files(open_bundle(bundle))} == {trust.FOREIGN}


def test_a_changed_package_is_refused_by_name(tmp_path, built, bundle):
    executable, _ = built
    changed = copied(bundle, tmp_path)
    name = package_for(changed, 1)
    with (changed / name).open("ab") as handle:
        handle.write(b"\0")
    result = run_cpp(executable, changed, "--backend", "aoti", "--inputs", inputs(tmp_path, 1), "-o", tmp_path,
                     "--trust-bundle")
    assert result.returncode == 2, result.stderr
    assert f"{name} does not match its sha256 in manifest.json" in result.stderr


def other_machine(entry: dict, what: str) -> None:
    """Make a manifest entry say it was compiled by another torch release or for another CPU or GPU."""
    if what == "torch":
        entry["torch"] = "2.0.0"
    elif entry["device"] == "cuda":
        entry["cuda_arch"] = "1.0"
    else:
        entry["cpu_isa"] = "sve256"


@pytest.mark.parametrize("what, message", [("torch", "compiled by torch 2.0.0"), ("machine", "compiled for")])
def test_packages_that_cannot_run_here_are_left_out_or_refused(tmp_path, built, bundle, what, message):
    executable, _ = built
    one = copied(bundle, tmp_path / "one")
    static = package_for(one, 1)
    edit_manifest(one, lambda m: [other_machine(e, what) for e in m["aoti"] if e["file"] == static])
    ran = run_cpp(executable, one, "--backend", "aoti", "--inputs", inputs(tmp_path, 1), "-o", tmp_path, "--trust-bundle")
    assert ran.returncode == 0, ran.stderr
    assert f"ran: {package_for(one, 3)}" in ran.stderr and f"left out {static}: it was {message}" in ran.stderr
    every = copied(bundle, tmp_path / "every")
    edit_manifest(every, lambda m: [other_machine(e, what) for e in m["aoti"]])
    refused = run_cpp(executable, every, "--backend", "aoti", "--inputs", tmp_path, "-o", tmp_path, "--trust-bundle")
    assert refused.returncode == 3 and message in refused.stderr, refused.stderr
    assert "cannot run" in refused.stderr and "internal error" not in refused.stderr


@pytest.mark.parametrize("case, message", [
    ("batch", "batch 5 is not one the bundle's AOTInductor packages"),
    ("dtype", "input x is float64 1x3x8x8, the model takes float32 Nx3x8x8"),
    ("device", "has no AOTInductor package for"),
])
def test_bad_input_is_exit_2(tmp_path, built, bundle, case, message):
    executable, _ = built
    other = "cpu" if device_of(bundle) == "cuda" else "cuda"
    extra = {"batch": [], "dtype": [], "device": ["--aoti-device", other]}[case]
    feeds = inputs(tmp_path, 5) if case == "batch" else inputs(tmp_path, 1, np.float64 if case == "dtype" else np.float32)
    result = run_cpp(executable, bundle, "--backend", "aoti", "--inputs", feeds, "-o", tmp_path, "--trust-bundle", *extra)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_malformed_aoti_entry_is_bad_input(tmp_path, built, bundle):
    executable, _ = built
    broken = copied(bundle, tmp_path)
    edit_manifest(broken, lambda m: m["aoti"][0].pop("batch"))
    result = run_cpp(executable, broken, "--backend", "aoti", "--inputs", inputs(tmp_path, 1), "--trust-bundle")
    assert result.returncode == 2 and "'aoti[0].batch' is missing" in result.stderr, result.stderr


def test_a_bundle_without_aoti_still_runs_on_onnxruntime(tmp_path, built):
    executable, _ = built
    plain = converted("tabular")
    array = np.random.default_rng(3).standard_normal((3, 13), dtype=np.float32)
    np.save(tmp_path / "features.npy", array)
    result = run_cpp(executable, plain, "--inputs", tmp_path, "-o", tmp_path, "--trust-bundle")
    assert result.returncode == 0 and "onnxruntime: " in result.stderr, result.stderr
    for output, want in deploykit.load(plain, device="cpu")(array).items():
        np.testing.assert_allclose(np.load(tmp_path / f"{output}.npy"), want, rtol=1e-6, atol=1e-6)
    aoti = run_cpp(executable, plain, "--backend", "aoti", "--inputs", tmp_path, "--trust-bundle")
    assert aoti.returncode == 2 and "has no AOTInductor package: convert with --backend aoti" in aoti.stderr


# --------------------------------------------------------------------------- backend auto and the tuning table

@pytest.mark.parametrize("batch, runs", [(1, 1), (2, 3), (3, None), (4, None)])
def test_auto_runs_the_packages_the_tuning_table_names_for_the_batch(tmp_path, built, bundle, batch, runs):
    """runs: the batch whose package runs (package_for), None for ONNX Runtime."""
    executable, _ = built
    copy = tuned(bundle, tmp_path, this_machine(device_of(bundle)))
    result = run_cpp(executable, copy, "--inputs", inputs(tmp_path, batch), "-o", tmp_path, "--trust-bundle")
    assert result.returncode == 0, result.stderr
    routes = f"batch 1 -> aoti static; batch 2 -> aoti {package_for(bundle, 3)}; batch 4 -> onnxruntime;"
    assert routes in result.stderr, result.stderr
    ran = [line for line in result.stderr.splitlines() if "ran: aoti-" in line]
    assert [line.split("ran: ")[1] for line in ran] == ([package_for(bundle, runs)] if runs else []), result.stderr
    want = deploykit.load(copy, backend="onnxruntime", device="cpu")(np.load(tmp_path / f"{INPUT}.npy"))["output"]
    np.testing.assert_allclose(np.load(tmp_path / "output.npy"), want, rtol=1e-5, atol=1e-5)


def test_auto_gives_a_tuned_package_way_to_onnxruntime_without_consent(tmp_path, built, bundle):
    executable, _ = built
    copy = tuned(bundle, tmp_path, this_machine(device_of(bundle)))
    result = run_cpp(executable, copy, "--inputs", inputs(tmp_path, 1), "-o", tmp_path, "--no-op-library",
                     env=with_cache(tmp_path / "empty"))
    assert result.returncode == 0, result.stderr
    assert "batch 1: the tuned aoti static does not run here" in result.stderr
    assert "is native code this machine's deploykit did not build" in result.stderr and "ran:" not in result.stderr


def test_auto_ignores_a_table_tuned_on_another_machine(tmp_path, built, bundle):
    executable, _ = built
    copy = tuned(bundle, tmp_path, {"device": "cuda", "gpu": "Another GPU", "cuda_arch": "1.0"})
    result = run_cpp(executable, copy, "--inputs", inputs(tmp_path, 1), "-o", tmp_path, "--trust-bundle")
    assert result.returncode == 0, result.stderr
    assert "tuning not used: it was tuned on" in result.stderr and "ran:" not in result.stderr


# --------------------------------------------------------------------------- configuring

@pytest.mark.parametrize("value, message", [("ON", "Torch"), ("MAYBE", "use AUTO, ON or OFF")])
def test_configure_fails_clearly_when_libtorch_is_required_and_missing(tmp_path, value, message):
    configure = subprocess.run(["cmake", "-S", ROOT / "csrc" / "runtime", "-B", tmp_path / "build", *runtime_defines(),
                                f"-DDEPLOYKIT_WITH_LIBTORCH={value}", f"-DCMAKE_PREFIX_PATH={tmp_path}",
                                "-DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF"], capture_output=True, text=True)
    assert configure.returncode != 0 and message in configure.stdout + configure.stderr


def test_the_libtorch_build_calls_no_std_filesystem_function(built):
    """libtorch's libraries export their own copies of std::filesystem, and a program linking libtorch
    binds its calls to them: torch 2.11's remove_all crashed deploykit-run on every AOTInductor run.
    The runtime goes through POSIX calls instead, so it imports none of those functions."""
    executable, _ = built
    imported = subprocess.run(["nm", "-u", "-C", executable], capture_output=True, text=True, check=True).stdout
    assert "std::filesystem" not in imported
    assert "libtorch" in subprocess.run(["ldd", executable], capture_output=True, text=True, check=True).stdout
