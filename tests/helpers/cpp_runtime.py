"""Building and running the C++ runtime (csrc/runtime) in tests: the CMake defines for the headers
deploykit fetches, the ONNX Runtime library inside the onnxruntime wheel, and libtorch's from the
torch wheel for the AOTInductor path.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import onnxruntime
import pytest

from deploykit.native import build as native

ROOT = Path(__file__).resolve().parents[2]


def ort_library() -> Path:
    (library,) = (Path(onnxruntime.__file__).parent / "capi").glob("libonnxruntime.so.*")
    return library


def configure_and_build(source: Path, build: Path, *defines: str) -> str:
    """CMake's configure output (the runtime says there which paths it built)."""
    configure = subprocess.run(["cmake", "-S", source, "-B", build, *defines], capture_output=True, text=True)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    compiled = subprocess.run(["cmake", "--build", build, "-j2"], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    return configure.stdout


def runtime_defines() -> list[str]:
    """The defines every runtime build needs (skips the test where cmake or a header is missing)."""
    if shutil.which("cmake") is None:
        pytest.skip("no cmake")
    headers, problem = native.ort_headers()
    if headers is None:
        pytest.skip(f"no ONNX Runtime headers: {problem}")
    json_headers, problem = native.json_headers()
    if json_headers is None:
        pytest.skip(f"no nlohmann/json headers: {problem}")
    trt_headers, _ = native.tensorrt_headers()
    return [f"-DORT_INCLUDE_DIR={headers}", f"-DORT_LIBRARY={ort_library()}", f"-DTENSORRT_INCLUDE_DIR={trt_headers or ''}",
            f"-DNLOHMANN_JSON_INCLUDE_DIR={json_headers}"]


def cuda_toolkit() -> Path | None:
    """A CUDA toolkit root (headers and cudart), which a CUDA build of torch's CMake config asks for."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    return next((Path(c) for c in candidates if c and (Path(c) / "include" / "cuda_runtime_api.h").is_file()), None)


def libtorch_defines() -> list[str]:
    """What find_package(Torch) needs to find the torch wheel's libtorch (skips where it cannot)."""
    import torch

    defines = ["-DDEPLOYKIT_WITH_LIBTORCH=ON", f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"]
    if torch.version.cuda:
        toolkit = cuda_toolkit()
        if toolkit is None:
            pytest.skip(f"torch {torch.__version__} is a CUDA build and its CMake config needs a CUDA toolkit "
                        "(set CUDA_HOME)")
        defines.append(f"-DCUDA_TOOLKIT_ROOT_DIR={toolkit}")
    return defines


def cached_build_dir(name: str) -> Path:
    """A build folder in deploykit's cache, one per checkout and torch, that CMake rebuilds incrementally."""
    import torch

    key = hashlib.sha256(f"{ROOT}\0{torch.__version__}".encode()).hexdigest()[:16]
    return native.cache_dir() / "test-builds" / f"{name}-{key}"


def built_with_libtorch() -> tuple[Path, str]:
    """deploykit-run built with the torch wheel's libtorch in its cached folder, and CMake's configure log."""
    build = cached_build_dir("runtime-libtorch")
    start = time.perf_counter()
    log = configure_and_build(ROOT / "csrc" / "runtime", build, *runtime_defines(), *libtorch_defines())
    print(f"deploykit-run with libtorch built in {time.perf_counter() - start:.1f} s ({build})")
    assert "AOTInductor path enabled" in log, log
    return build / "deploykit-run", log


def run_cpp(executable: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([executable, *map(str, args)], capture_output=True, text=True, timeout=120)
