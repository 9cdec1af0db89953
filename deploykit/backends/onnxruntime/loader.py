"""ONNX Runtime loader and runner (CPU here; the CUDA provider where onnxruntime-gpu has it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from deploykit.native import build as native
from deploykit.errors import DeployKitError, EnvironmentProblem


@dataclasses.dataclass(frozen=True)
class OpLibrary:
    """deploykit's custom-op library for ONNX Runtime, or why it is not available."""

    path: Path | None
    note: str


def find_op_library() -> OpLibrary:
    """Build (once, cached) or find the library; without it, models run their ONNX functions."""
    try:
        path = native.find_ort_library()
    except EnvironmentProblem as problem:
        return OpLibrary(None, f"op library unavailable ({problem}); validated the ONNX function fallback")
    return OpLibrary(path, f"validated with {path.name} (our kernels) and with the ONNX function fallback")


class OnnxRuntimeRunner:
    """An InferenceSession over an in-memory model, fed and read by name."""

    def __init__(
        self,
        model: onnx.ModelProto,
        providers: tuple[str, ...] = ("CPUExecutionProvider",),
        op_library: Path | None = None,
    ):
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only: warnings would flood the progress display
        if op_library is not None:
            options.register_custom_ops_library(str(op_library))
        try:
            self.session = ort.InferenceSession(
                model.SerializeToString(), options, providers=list(providers)
            )
        except Exception as error:
            raise DeployKitError(
                f"ONNX Runtime {ort.__version__} cannot load the converted model: "
                f"{str(error).splitlines()[0]}"
            ) from error
        self.name = f"onnxruntime-{providers[0].removesuffix('ExecutionProvider').lower()}"
        self.output_names = [output.name for output in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.session.run(None, feeds)
        return dict(zip(self.output_names, outputs))
