"""One conversion's state: what each step of the pipeline produced, every field declared here.

Each step (see ``STEPS`` in :mod:`deploykit.conversion.pipeline`) fills its own fields; a field
is None until its step has run, or stays None when its step does not run. Each stage's graph
keeps its own name, and :attr:`ConversionState.shipped_graph` is the one the bundle ships.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx

from deploykit.backends.onnxruntime.loader import OpLibrary
from deploykit.conversion.aoti import AotiStage
from deploykit.conversion.engine import EngineStage
from deploykit.conversion.export import ExportResult
from deploykit.conversion.fp8 import Fp8Stage
from deploykit.conversion.loading import LoadedModel
from deploykit.conversion.openvino import OpenVinoStage
from deploykit.conversion.options import ConvertOptions
from deploykit.conversion.precision import PrecisionStage
from deploykit.conversion.quantize import Calibration, QuantizationStage
from deploykit.passes.base import PassStats
from deploykit.specs import InputSpec
from deploykit.validation.compare import Tolerance
from deploykit.validation.validate import CandidateValidation, Remembered


@dataclasses.dataclass
class ConversionState:
    options: ConvertOptions
    # "Loading the model"
    loaded: LoadedModel | None = None
    specs: list[InputSpec] = dataclasses.field(default_factory=list)  # in the model's argument order
    # "Running the model in PyTorch"
    reference: Remembered | None = None  # the TorchRunner, run once per feed set
    example: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # the export's inputs
    feed_sets: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)  # validation's, one per batch size
    calibration: Calibration | None = None  # int8, fp8: the samples the scales are fitted to (read before the export)
    # "Exporting ONNX": exported.model is the plain export
    exported: ExportResult | None = None
    # "Optimizing the graph": ONNX Runtime's graph, with its fused contrib ops unless --no-ort-fusions
    optimized: onnx.ModelProto | None = None
    pass_stats: list[PassStats] = dataclasses.field(default_factory=list)
    # "Optimizing the graph for TensorRT": the same passes without ONNX Runtime's fusions; None where
    # the optimized graph has no op only ONNX Runtime runs
    portable: onnx.ModelProto | None = None
    # "Writing fp16|bf16 into the graph"; auto-fix updates the stage's result and statistics.
    # precision types ONNX Runtime's graph; engine_precision, with a TensorRT engine, TensorRT's graph
    precision: PrecisionStage | None = None
    typed: onnx.ModelProto | None = None
    engine_precision: PrecisionStage | None = None
    # "Quantizing to int8|fp8" (--precision int8, or fp8 for TensorRT): the QDQ graph and which nodes it quantized
    quantization: QuantizationStage | None = None
    # "Building deploykit's op library"
    library: OpLibrary = OpLibrary(None, "the graph uses no deploykit op")
    # "Building the TensorRT engine"; auto-fix rebuilds it from the fixed graph
    engine: EngineStage | None = None
    # "Compiling AOTInductor packages" (--backend aoti|all); no packages, only a note, where all skips them.
    # fp8: the Linear layers the packages compute in fp8, and their calibration
    aoti: AotiStage | None = None
    fp8: Fp8Stage | None = None
    # "Building the OpenVINO model" (--backend openvino): its files, manifest entry and runner; int8 auto-fix
    # builds it again with the nodes it keeps in float
    openvino: OpenVinoStage | None = None
    # "Validating against PyTorch"; auto-fix validates again. The first candidate is the bundle
    # as it will run, the last the plain export.
    tolerances: dict[str, Tolerance] = dataclasses.field(default_factory=dict)
    validations: list[CandidateValidation] = dataclasses.field(default_factory=list)
    # "Pinning the nodes that diverge to fp32 (--auto-fix)"
    fixed: onnx.ModelProto | None = None
    # "Writing the bundle": shared by the report and the manifest
    created: str | None = None
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    native: list[dict] = dataclasses.field(default_factory=list)  # the manifest's ``native`` entries, hashed once
    report: dict = dataclasses.field(default_factory=dict)
    # "Timing what runs here (--tune)": the manifest's tuning table
    tuning: dict | None = None

    @property
    def shipped_graph(self) -> onnx.ModelProto | None:
        """The latest graph: auto-fixed, else typed to the precision or quantized, else optimized."""
        quantized = self.quantization.model if self.quantization is not None else None
        return next((g for g in (self.fixed, self.typed, quantized, self.optimized) if g is not None), None)

    @property
    def quantized(self) -> QuantizationStage | Fp8Stage | None:
        """The int8 or fp8 stage: what was quantized, and on what it was calibrated."""
        return self.quantization or self.fp8

    @property
    def reference_graph(self) -> onnx.ModelProto | None:
        """The fp32 graph a reduced-precision or int8 graph was made from (the bundle's model.fp32.onnx)."""
        stage = self.precision or self.quantization
        return stage.fp32 if stage is not None else None

    @property
    def engine_graph(self) -> onnx.ModelProto | None:
        """What TensorRT builds from: typed for TensorRT, else quantized for it (int8, fp8: the shipped graph),
        else the graph without ONNX Runtime's ops."""
        if self.engine_precision is not None:
            return self.engine_precision.model
        if self.quantization is not None:
            return self.quantization.model
        return self.portable if self.portable is not None else self.shipped_graph

    @property
    def shipped_pass_stats(self) -> list[PassStats]:
        """The passes' statistics, then the precision pass's (of the auto-fixed graph after auto-fix)."""
        return [*self.pass_stats, self.precision.result.stats] if self.precision is not None else self.pass_stats

    @property
    def shipped_validations(self) -> list[CandidateValidation]:
        """What the bundle ships, each of which must pass; the first is the bundle as it will run."""
        return self.validations[:-1]

    @property
    def plain_validation(self) -> CandidateValidation:
        """The plain export's: it only tells where a failure came from."""
        return self.validations[-1]

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.shipped_validations)

    @property
    def batch_sizes(self) -> list[int]:
        return [run.batch for run in self.validations[0].runs]
