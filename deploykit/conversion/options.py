"""What the user asks ``convert()`` for: the CLI's flags, one field each."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from deploykit.conversion.export import DEFAULT_OPSET
from deploykit.specs import BatchRange, InputSpec


@dataclasses.dataclass
class ConvertOptions:
    model: Path
    output: Path
    inputs: list[InputSpec] = dataclasses.field(default_factory=list)
    custom_ops: bool = True
    ort_fusions: bool = True  # ONNX Runtime's transformer fusions in the ONNX Runtime graph (docs/passes.md)
    backend: str = "onnxruntime"  # onnxruntime | tensorrt | aoti | all
    aoti_shapes: str = "both"  # AOTInductor packages: dynamic (one over the batch range), static (one per validated size), both
    trt_targets: list[str] | None = None
    trt_workspace_bytes: int | None = None
    batch: BatchRange | None = None
    factory: str | None = None
    trust_pickle: bool = False
    exporter: str = "auto"
    opset: int = DEFAULT_OPSET
    feeds_path: Path | None = None
    seed: int = 0
    tolerances: list[str] = dataclasses.field(default_factory=list)
    force: bool = False
    precision: str = "fp32"  # fp16/bf16/int8/fp8: docs/precision.md
    calibration_path: Path | None = None  # int8, fp8: the .npz whose samples fit the scales (None: random inputs)
    calibration_method: str = "minmax"  # int8: minmax | entropy | percentile
    io_precision: str | None = None  # None: inputs and outputs keep their declared types
    auto_fix: bool = False  # pin the nodes that break reduced-precision validation to fp32
    tune: bool = False  # after writing the bundle, time what runs here and record the fastest (docs/tuning.md)

    @property
    def quantizes_graph(self) -> bool:
        """Whether the ONNX graph itself is quantized (Q/DQ): int8, and fp8 for TensorRT."""
        return self.precision == "int8" or (self.precision == "fp8" and self.backend == "tensorrt")

    @property
    def graph_precision(self) -> str:
        """The ONNX graph's precision: fp8 for AOTInductor has its products compiled into the packages and an
        fp16 graph; a quantized graph (int8, fp8 for TensorRT) is the fp32 graph with Q/DQ."""
        return "fp16" if self.precision == "fp8" and not self.quantizes_graph else self.precision
