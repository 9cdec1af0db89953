"""``deploykit build-runtime``: one command builds deploykit-run, caches it and says where it is.

The build is the one every C++ runtime test uses (cpp_runtime.built_runtime), so only the first
test of a session on a changed tree compiles it (~30 s on 2 shared cores).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from converted_bundles import converted
from cpp_runtime import built_runtime, run_cpp
from deploykit.cli import main
from deploykit.native import build as native
from deploykit.native import runtime_build
from deploykit_cli import run_deploykit


@pytest.fixture(scope="module")
def executable() -> Path:
    return Path(built_runtime()["executable"])


def test_the_printed_path_runs_a_bundle_into_a_new_nested_folder(tmp_path, executable):
    printed = run_deploykit("build-runtime", "--print-path")
    assert printed.returncode == 0, printed.stderr
    assert Path(printed.stdout.strip()) == executable
    array = np.random.default_rng(2).standard_normal((3, 13), dtype=np.float32)
    np.save(tmp_path / "features.npy", array)
    out = tmp_path / "not" / "yet" / "there"
    result = run_cpp(printed.stdout.strip(), converted("tabular"), "--input", f"features={tmp_path / 'features.npy'}",
                     "-o", out, "--no-op-library")
    assert result.returncode == 0, result.stderr
    assert np.load(out / "output_0.npy").shape == (3, 4) and np.load(out / "output_1.npy").shape == (3, 16)


def test_a_second_call_is_a_cache_hit(executable):
    start = time.perf_counter()
    again = run_deploykit("build-runtime", "--json")
    seconds = time.perf_counter() - start
    assert again.returncode == 0, again.stderr
    build = json.loads(again.stdout)
    assert build["cached"] and Path(build["executable"]) == executable
    assert seconds < 20, f"a cached build-runtime took {seconds:.1f} s"  # python start and a hash, no compiler
    table = run_deploykit("build-runtime")
    assert f"deploykit-run: {executable} (cached)" in table.stderr.replace("\n", "")


def test_an_output_folder_that_cannot_be_made_is_exit_2(tmp_path, executable):
    np.save(tmp_path / "features.npy", np.ones((2, 13), np.float32))
    (tmp_path / "file").write_text("in the way")
    result = run_cpp(executable, converted("tabular"), "--inputs", tmp_path, "-o", tmp_path / "file" / "out",
                     "--no-op-library")
    assert result.returncode == 2, result.stderr
    assert f"cannot create the output folder {tmp_path / 'file' / 'out'}" in result.stderr


def test_a_missing_toolchain_is_exit_3_naming_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(native.sys, "executable", str(tmp_path / "python"))
    result = CliRunner().invoke(main, ["build-runtime"])
    assert result.exit_code == 3, result.output
    assert "cmake not found: install CMake >= 3.24" in result.output and "internal error" not in result.output


def test_missing_headers_are_exit_3_naming_what_to_set(tmp_path):
    result = run_deploykit("build-runtime", "--print-path", env={"NLOHMANN_JSON_ROOT": str(tmp_path)})
    assert result.returncode == 3, result.stderr
    assert "deploykit-run needs the nlohmann/json headers" in result.stderr
    assert "point NLOHMANN_JSON_ROOT at an unpacked nlohmann/json release" in result.stderr and not result.stdout


def test_libtorch_from_a_cuda_torch_without_a_toolkit_is_exit_3(monkeypatch):
    torch = pytest.importorskip("torch")
    if not torch.version.cuda:
        pytest.skip("a CPU build of torch needs no CUDA toolkit")
    monkeypatch.setattr(runtime_build, "cuda_toolkit", lambda: None)
    result = CliRunner().invoke(main, ["build-runtime", "--with-libtorch"])
    assert result.exit_code == 3, result.output
    assert "needs the CUDA toolkit: install the CUDA toolkit" in result.output and "CUDA_HOME" in result.output
