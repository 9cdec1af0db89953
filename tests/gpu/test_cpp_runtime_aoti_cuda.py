"""The C++ runtime's AOTInductor path on the GPU: deploykit-run built with libtorch runs a bundle's
cuda packages (converted here, on this GPU) as the Python AOTI runner does.

Needs cmake, a CUDA build of torch and a CUDA toolkit for torch's CMake config (CUDA_HOME or
/usr/local/cuda); the build is cached as in tests/runtime/test_cpp_runtime_aoti.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deploykit  # noqa: E402
from aoti_cases import INPUT, copied, inputs, manifest, package_for, this_machine, tuned  # noqa: E402
from converted_bundles import converted_aoti, edit_manifest  # noqa: E402
from cpp_runtime import built_with_libtorch, run_cpp  # noqa: E402

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)


@pytest.fixture(scope="module")
def built() -> tuple[Path, dict]:
    build = built_with_libtorch()
    return Path(build["executable"]), build


@pytest.fixture(scope="module")
def bundle() -> Path:
    converted = converted_aoti()
    devices = {entry["device"] for entry in manifest(converted)["aoti"]}
    assert devices == {"cuda"}, devices  # converted on a GPU: cuda packages
    return converted


@pytest.mark.parametrize("batch", [1, 3, 4])
def test_cuda_packages_equal_the_python_aoti_runner(tmp_path, built, bundle, batch):
    executable, _ = built
    result = run_cpp(executable, bundle, "--backend", "aoti", "--inputs", inputs(tmp_path, batch), "-o", tmp_path,
                     "--trust-bundle")
    assert result.returncode == 0, result.stderr
    assert "on cuda" in result.stderr and f"ran: {package_for(bundle, batch)}" in result.stderr, result.stderr
    runner = deploykit.load(bundle, backend="aoti", device="cuda")
    want = runner(np.load(tmp_path / f"{INPUT}.npy"))["output"]
    want = want.cpu().numpy() if hasattr(want, "cpu") else np.asarray(want)
    np.testing.assert_allclose(np.load(tmp_path / "output.npy"), want, rtol=1e-4, atol=1e-4)


def test_a_package_for_another_gpu_is_refused(tmp_path, built, bundle):
    executable, _ = built
    other = copied(bundle, tmp_path)
    edit_manifest(other, lambda m: [entry.update(cuda_arch="1.0") for entry in m["aoti"]])
    result = run_cpp(executable, other, "--backend", "aoti", "--inputs", inputs(tmp_path, 1), "--trust-bundle")
    assert result.returncode == 3, result.stderr
    assert "compiled for compute capability 1.0 and GPU 0 has" in result.stderr


def test_cpu_packages_are_asked_for_and_absent(tmp_path, built, bundle):
    executable, _ = built
    result = run_cpp(executable, bundle, "--backend", "aoti", "--aoti-device", "cpu", "--inputs", inputs(tmp_path, 1),
                     "--trust-bundle")
    assert result.returncode == 2 and "has no AOTInductor package for cpu" in result.stderr, result.stderr


def test_auto_runs_the_cuda_packages_a_table_tuned_on_this_gpu_names(tmp_path, built, bundle):
    executable, _ = built
    copy = tuned(bundle, tmp_path, this_machine("cuda"))
    result = run_cpp(executable, copy, "--inputs", inputs(tmp_path, 1), "-o", tmp_path, "--trust-bundle")
    assert result.returncode == 0, result.stderr
    assert f"ran: {package_for(bundle, 1)}" in result.stderr, result.stderr
