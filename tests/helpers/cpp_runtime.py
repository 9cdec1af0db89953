"""Building and running the C++ runtime (csrc/runtime) in tests: ``deploykit build-runtime``, as users
build it, once per option set and cached in deploykit's cache; the CMake defines it uses serve the
tests that configure a tree of their own (examples/cpp, a configure that must fail).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from deploykit.errors import EnvironmentProblem
from deploykit.native import runtime_build
from deploykit_cli import run_deploykit

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def built_runtime(*options: str) -> dict:
    """``deploykit build-runtime --json OPTIONS``: the build's JSON (skips where exit 3 says a piece is missing)."""
    result = run_deploykit("build-runtime", "--json", *options, timeout=1800)
    if result.returncode == 3:
        pytest.skip(result.stderr.strip())
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def built_with_libtorch() -> dict:
    """deploykit-run with the AOTInductor path (the torch wheel's libtorch)."""
    build = built_runtime("--with-libtorch")
    assert build["aoti"], build
    return build


def runtime_defines(with_libtorch: bool = False) -> list[str]:
    """build-runtime's CMake defines as -D arguments (skips the test where cmake or a header is missing)."""
    if shutil.which("cmake") is None:
        pytest.skip("no cmake")
    try:
        defines = runtime_build.cmake_defines(with_libtorch)
    except EnvironmentProblem as problem:
        pytest.skip(str(problem))
    return [f"-D{name}={value}" for name, value in defines.items()]


def configure_and_build(source: Path, build: Path, *defines: str) -> str:
    """CMake's configure output for a tree that embeds the runtime."""
    configure = subprocess.run(["cmake", "-S", source, "-B", build, *defines], capture_output=True, text=True)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    compiled = subprocess.run(["cmake", "--build", build, "-j2"], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    return configure.stdout


def run_cpp(executable: Path | str, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    """deploykit-run with ``args``; if a signal kills it, its stderr gets a backtrace where a debugger is here."""
    command = [str(executable), *map(str, args)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    if result.returncode < 0:
        result.stderr += backtrace(command)
    return result


def with_cache(cache: Path) -> dict:
    """This process's environment with deploykit's cache at ``cache`` (made if missing: an empty cache is a
    machine whose deploykit built and wrote nothing, so every native file of a bundle is foreign there)."""
    cache.mkdir(parents=True, exist_ok=True)
    return {**without_cache(), "DEPLOYKIT_CACHE": str(cache)}


def without_cache() -> dict:
    """This process's environment without DEPLOYKIT_CACHE: the cache is ~/.cache/deploykit of $HOME."""
    return {name: value for name, value in os.environ.items() if name != "DEPLOYKIT_CACHE"}


def backtrace(command: list[str]) -> str:
    """The stack where ``command`` crashes, from gdb or cuda-gdb (the GPU machine has only the latter)."""
    debugger = shutil.which("gdb") or shutil.which("cuda-gdb")
    if debugger is None:
        return "\n(no gdb or cuda-gdb here for a backtrace)"
    traced = subprocess.run([debugger, "-batch", "-ex", "run", "-ex", "bt 30", "--args", *command],
                            capture_output=True, text=True, timeout=300)
    frames = traced.stdout[max(traced.stdout.find("\n#0 "), 0):]  # the signal's line, then the innermost frame first
    return "\n--- backtrace (" + Path(debugger).name + ") ---\n" + frames[:6000] + traced.stderr[-1000:]
