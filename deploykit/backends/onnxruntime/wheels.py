"""Which ONNX Runtime wheel is installed: deploykit depends on neither, its extras pick one.

``onnxruntime`` (CPU) and ``onnxruntime-gpu`` both install the ``onnxruntime`` package, so with
both the last one installed overwrites the other's files; pip cannot keep one out, so neither is a
base dependency: ``deploykit[cpu]`` brings the CPU wheel, ``deploykit[gpu]`` the GPU wheel and
cuda-python. Read from the installed distributions' metadata, not from an import (which the
broken mix of both can fail).
"""

from __future__ import annotations

import importlib.metadata

from deploykit.errors import EnvironmentProblem

CPU, GPU = "onnxruntime", "onnxruntime-gpu"
CPU_EXTRA, GPU_EXTRA = "deploykit[cpu]", "deploykit[gpu]"
INSTALL = f"pip install '{CPU_EXTRA}' (CPU only), or pip install '{GPU_EXTRA}' on an NVIDIA GPU machine"


def installed() -> dict[str, str]:
    """{distribution: version} of the ONNX Runtime wheels installed."""
    found = {}
    for name in (CPU, GPU):
        try:
            found[name] = importlib.metadata.distribution(name).version
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def fix(wheels: dict[str, str], gpu: bool) -> str | None:
    """The command that leaves exactly one wheel (the GPU one on a machine with a GPU), or None when one is."""
    if not wheels:
        return f"pip install '{GPU_EXTRA if gpu else CPU_EXTRA}'"
    if len(wheels) == 1:
        return None
    keep = GPU if gpu else CPU
    return f"pip uninstall -y {CPU} {GPU} && pip install {keep}=={wheels[keep]}"  # reinstalls the files both wrote


def require() -> None:
    """EnvironmentProblem naming the extras when no ONNX Runtime wheel is installed."""
    if not installed():
        raise EnvironmentProblem(f"ONNX Runtime is not installed: {INSTALL}")


def missing_import(error: BaseException) -> bool:
    """Whether ``error`` is the ImportError of ``import onnxruntime`` without the package."""
    return isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] == "onnxruntime"
