"""ONNX Runtime loader and runner (CPU here; the CUDA provider where onnxruntime-gpu has it)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from deploykit.errors import DeployKitError


class OnnxRuntimeRunner:
    """An InferenceSession over an in-memory model, fed and read by name."""

    def __init__(self, model: onnx.ModelProto, providers: tuple[str, ...] = ("CPUExecutionProvider",)):
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only: warnings would flood the progress display
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
