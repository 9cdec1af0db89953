"""Build ``deploykit-run`` (``csrc/runtime``) once per source/option hash, as ``build.py`` builds the op library.

The headers come from where the op library's come from (``build.ort_headers``, ``json_headers``,
``tensorrt_headers``: the environment, else fetched once into the cache); the default ONNX Runtime
library is the one inside the installed onnxruntime (or onnxruntime-gpu) wheel, and libtorch (for
the AOTInductor path, ``with_libtorch``) the torch wheel's. Builds live in
``$DEPLOYKIT_CACHE/runtime/<key>``; the key hashes the sources, the headers, the toolchain and the
options, so an unchanged tree is reused at once and the few most recently used builds are kept.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import time
from pathlib import Path

from deploykit.errors import EnvironmentProblem
from deploykit.native import build as native

RUNTIME_FORMAT = 1  # bump when the recipe changes in a way the key cannot see
SOURCES = native.SOURCE_ROOT / "csrc" / "runtime"
EXECUTABLE = "deploykit-run"
CUDA_TOOLKIT_HINT = "install the CUDA toolkit (apt-get install cuda-toolkit) or set CUDA_HOME to one"
# A configure error CMake prints, and what to install for it.
CONFIGURE_FIXES = (
    ("Could NOT find OpenSSL", "install OpenSSL's headers (apt-get install libssl-dev)"),
    ("Torch", "install torch (pip install torch), or build without --with-libtorch"),
    ("CUDA", CUDA_TOOLKIT_HINT),
)


@dataclasses.dataclass(frozen=True)
class RuntimeBuild:
    """One build of ``deploykit-run``: where it is and which backends it was built with."""

    executable: Path
    tensorrt: bool
    aoti: bool
    ort_library: str
    notes: tuple[str, ...]
    cached: bool
    seconds: float

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "executable": str(self.executable), "notes": list(self.notes)}

    def summary(self) -> list[str]:
        """Lines for the CLI: the executable, then each backend path and why one is off."""
        when = "cached" if self.cached else f"built in {self.seconds:.0f} s"
        return [f"{EXECUTABLE}: {self.executable} ({when})",
                f"onnxruntime: default library {self.ort_library or 'none (pass --ort-library PATH)'}",
                f"tensorrt: {'built' if self.tensorrt else 'not built'}",
                f"aoti: {'built (libtorch)' if self.aoti else 'not built (--with-libtorch builds it)'}",
                *self.notes]


def build_runtime(with_libtorch: bool = False, tensorrt: bool = True, force: bool = False,
                  verbose: bool = False) -> RuntimeBuild:
    """``deploykit-run`` from the cache, else configured and compiled into it.

    Raises EnvironmentProblem naming what to install when a toolchain piece, a header set or
    (``with_libtorch``) torch or the CUDA toolkit it asks for is missing.
    """
    toolchain = native.find_toolchain()
    defines = cmake_defines(with_libtorch, tensorrt)
    key = _key(toolchain, defines)
    root = native.cache_dir() / "runtime"
    build_dir = root / key
    with native._locked(build_dir.with_suffix(".lock")):
        if force:
            shutil.rmtree(build_dir, ignore_errors=True)
        elif (cached := _read_manifest(build_dir, key)) is not None:
            os.utime(build_dir / native.MANIFEST)  # last used: what pruning keeps
            return cached
        build = _build(build_dir, key, toolchain, defines, verbose)
    native.prune_builds(native.KEEP_BUILDS, root)
    return build


def cmake_defines(with_libtorch: bool = False, tensorrt: bool = True) -> dict[str, str]:
    """The cache variables of csrc/runtime/CMakeLists.txt for this machine (also for a program that
    embeds the runtime, e.g. examples/cpp)."""
    defines = {
        "CMAKE_BUILD_TYPE": "Release",
        "ORT_INCLUDE_DIR": str(_required_headers("ONNX Runtime", native.ort_headers)),
        "NLOHMANN_JSON_INCLUDE_DIR": str(_required_headers("nlohmann/json", native.json_headers)),
        "ORT_LIBRARY": str(wheel_ort_library() or ""),
        "DK_RUNTIME_WITH_TENSORRT": "ON" if tensorrt else "OFF",
        "TENSORRT_INCLUDE_DIR": str((native.tensorrt_headers()[0] or "") if tensorrt else ""),
        "DEPLOYKIT_WITH_LIBTORCH": "ON" if with_libtorch else "OFF",
    }
    if with_libtorch:
        defines.update(_libtorch_defines())
    return defines


def wheel_ort_library() -> Path | None:
    """``libonnxruntime.so.*`` inside the installed onnxruntime package (CPU or GPU wheel), found without importing it."""
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        return None
    libraries = sorted(Path(spec.submodule_search_locations[0], "capi").glob("libonnxruntime.so.*"))
    return libraries[-1] if libraries else None


def cuda_toolkit() -> Path | None:
    """A CUDA toolkit root (headers and cudart): $CUDA_HOME, $CUDA_PATH, else /usr/local/cuda."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    return next((Path(c) for c in candidates if c and (Path(c) / "include" / "cuda_runtime_api.h").is_file()), None)


def _required_headers(what: str, finder) -> Path:
    path, problem = finder()
    if path is None:
        raise EnvironmentProblem(f"deploykit-run needs the {what} headers: {problem}")
    return path


def _libtorch_defines() -> dict[str, str]:
    """find_package(Torch) pointed at the torch wheel; a CUDA build of torch also needs a toolkit."""
    try:
        import torch
    except ImportError:
        raise EnvironmentProblem("--with-libtorch needs torch: pip install torch") from None
    defines = {"CMAKE_PREFIX_PATH": torch.utils.cmake_prefix_path}
    if torch.version.cuda:
        toolkit = cuda_toolkit()
        if toolkit is None:
            raise EnvironmentProblem(f"torch {torch.__version__} is a CUDA build and libtorch's CMake config needs the "
                                     f"CUDA toolkit: {CUDA_TOOLKIT_HINT}, or use a CPU build of torch")
        defines["CUDA_TOOLKIT_ROOT_DIR"] = str(toolkit)
    return defines


def _key(toolchain: native.Toolchain, defines: dict[str, str]) -> str:
    """Hash of the sources, the headers they include, the toolchain and the options."""
    digest = hashlib.sha256()
    torch_version = _version("torch") if defines["DEPLOYKIT_WITH_LIBTORCH"] == "ON" else ""
    for part in (RUNTIME_FORMAT, toolchain.generator, toolchain.cmake_version, toolchain.cxx,
                 os.environ.get("CC", ""), native._which("nvcc") or "", platform.machine(), torch_version,
                 *sorted(f"{name}={value}" for name, value in defines.items())):
        digest.update(f"{part}\0".encode())
    headers = [Path(defines["ORT_INCLUDE_DIR"]) / "onnxruntime_c_api.h",
               Path(defines["NLOHMANN_JSON_INCLUDE_DIR"]) / "nlohmann" / "json.hpp"]
    if defines["TENSORRT_INCLUDE_DIR"]:
        headers.append(Path(defines["TENSORRT_INCLUDE_DIR"]) / "NvInferVersion.h")
    sources = sorted(p for p in SOURCES.rglob("*")  # what CMake reads: not the README
                     if p.is_file() and not p.name.startswith(".") and p.suffix != ".md")
    for path in (*headers, *sources):
        digest.update(str(path).encode() + b"\0" + (path.read_bytes() if path.is_file() else b"-"))
    return digest.hexdigest()[:16]


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _build(build_dir: Path, key: str, toolchain: native.Toolchain, defines: dict[str, str],
           verbose: bool) -> RuntimeBuild:
    """Configure and compile; a step that fails is an EnvironmentProblem naming the fix and the log."""
    start = time.monotonic()
    log = native._new_log(build_dir)
    configure = native._run_step(
        [toolchain.cmake, "-S", str(SOURCES), "-B", str(build_dir), "-G", toolchain.generator,
         f"-DCMAKE_MAKE_PROGRAM={toolchain.make_program}", *(f"-D{n}={v}" for n, v in defines.items())],
        log, verbose)
    if configure.returncode != 0:
        raise EnvironmentProblem(f"cmake could not configure {EXECUTABLE}: {native._last_error(configure.stdout)}; "
                                 f"{_configure_fix(configure.stdout)} (log: {log})")
    compiled = native._run_step(native.compile_command(build_dir, toolchain, EXECUTABLE), log, verbose)
    executable = build_dir / EXECUTABLE
    if compiled.returncode != 0 or not executable.is_file():
        raise EnvironmentProblem(f"compiling {EXECUTABLE} failed: {native._last_error(compiled.stdout)} "
                                 f"(a C++17 compiler is needed, C++20 with --with-libtorch; log: {log})")
    build = RuntimeBuild(executable, "TensorRT path enabled" in configure.stdout,
                         "AOTInductor path enabled" in configure.stdout, defines["ORT_LIBRARY"],
                         _disabled_notes(configure.stdout, defines), False, time.monotonic() - start)
    _write_manifest(build_dir, key, build)
    return build


def _configure_fix(output: str) -> str:
    errors = output[output.find("CMake Error"):] if "CMake Error" in output else output
    for marker, fix in CONFIGURE_FIXES:
        if marker in errors:
            return fix
    return "see the log"


def _disabled_notes(output: str, defines: dict[str, str]) -> tuple[str, ...]:
    """Why a backend path is off, from the configure's 'deploykit runtime: ... disabled: why' lines."""
    notes = [f"{m.group(1)}: {m.group(2)}" for m in
             re.finditer(r"deploykit runtime: (TensorRT path) disabled: (.+)$", output, re.MULTILINE)]
    if not defines["ORT_LIBRARY"]:
        notes.append("no onnxruntime wheel installed: deploykit-run needs --ort-library PATH or DEPLOYKIT_ORT_LIBRARY")
    return tuple(notes)


def _write_manifest(build_dir: Path, key: str, build: RuntimeBuild) -> None:
    data = {**build.to_json(), "key": key, "executable": build.executable.name}
    (build_dir / native.MANIFEST).write_text(json.dumps(data, indent=1))


def _read_manifest(build_dir: Path, key: str) -> RuntimeBuild | None:
    """The recorded build if it is complete and its executable is still there."""
    try:
        data = json.loads((build_dir / native.MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    executable = build_dir / str(data.get("executable", ""))
    if data.get("key") != key or not executable.is_file():
        return None
    return RuntimeBuild(executable, bool(data.get("tensorrt")), bool(data.get("aoti")), str(data.get("ort_library", "")),
                        tuple(data.get("notes", ())), True, float(data.get("seconds", 0.0)))
