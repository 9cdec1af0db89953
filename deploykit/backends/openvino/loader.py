"""Opening OpenVINO: the import with the fix when it is missing, and a model compiled for the CPU.

OpenVINO is optional (``deploykit[openvino]``); everything here imports it only when called.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from deploykit.errors import EnvironmentProblem

EXTRA = "deploykit[openvino]"
INSTALL = f"pip install '{EXTRA}'"
#: What the CPU plugin is told. Its default on CPUs with AMX or AVX-512 bf16 computes float ops in bf16,
#: which moved an "fp32" resnet50 to cosine 0.995 (BENCHMARKS.md): the bundle runs the precision it validated.
#: LATENCY: one stream over all cores, as a server's batcher and a single caller both want.
CPU_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY"}
#: What ``load(..., backend="openvino")`` passes on to the runner.
OPTIONS = ("threads",)


def import_openvino():
    """The ``openvino`` module, or EnvironmentProblem naming the extra."""
    try:
        import openvino
    except ImportError as error:
        raise EnvironmentProblem(f"OpenVINO is not installed ({error}): {INSTALL}") from None
    return openvino


def available() -> bool:
    """Whether ``openvino`` imports here (``load(backend="auto")`` falls back to ONNX Runtime when not)."""
    try:
        import_openvino()
    except EnvironmentProblem:
        return False
    return True


def installed_version() -> str:
    """The installed OpenVINO's release (the manifest records the one that validated the model)."""
    import_openvino()
    return importlib.metadata.version("openvino")


def compile_model(xml: Path, weights: Path, threads: int | None = None):
    """The model read from its two files and compiled for the CPU (``threads``: its thread count)."""
    ov = import_openvino()
    core = ov.Core()
    config = dict(CPU_CONFIG)
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    return core.compile_model(core.read_model(str(xml), str(weights)), "CPU", config)
