"""Convert's precision stage: what ``convert --precision fp16|bf16`` adds around the pass.

The pass (:mod:`deploykit.passes.precision`) only types a graph. Convert also calibrates it,
chooses what validation runs (the per-node rounding emulation, and ONNX Runtime's own kernels
where it has them), auto-fixes a graph that fails and reports what it did;
:class:`PrecisionStage` holds that for :mod:`deploykit.api`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx
import onnx_ir as ir

from deploykit.bundle.format import REFERENCE_MODEL
from deploykit.validation.auto_fix import FixProblem, FixResult, auto_fix, tradeoff
from deploykit.backends.onnxruntime.runner import OnnxRuntimeRunner
from deploykit.errors import DeployKitError
from deploykit.passes.ort_fusions import CONTRIB_DOMAIN
from deploykit.validation.compare import finite_max_abs
from deploykit.validation.layerwise import run_values
from deploykit.passes.precision import (ONNX_TYPE_NAMES, PrecisionResult, apply_precision, emulate, float_io,
                                        is_low, name_nodes)


@dataclasses.dataclass
class PrecisionStage:
    """``convert --precision fp16|bf16``: calibrate, type the graph, validate it here, auto-fix.

    Calibration runs the fp32 graph on the export inputs -- not on the validation inputs, so
    that validation stays an independent check of what calibration decided.
    """

    fp32: onnx.ModelProto
    precision: str
    io_precision: str | None
    ranges: dict[str, float]
    shapes: dict[str, tuple]
    result: PrecisionResult
    target: str = "onnxruntime"
    execution: str = ""
    fix: FixResult | None = None

    @classmethod
    def start(cls, optimized: onnx.ModelProto, precision: str, io_precision: str | None,
              calibration: dict, target: str = "onnxruntime") -> PrecisionStage:
        """Calibrate and type ``optimized`` for ``target``: ONNX Runtime's graph, or TensorRT's."""
        fp32 = name_nodes(optimized)
        values = run_values(fp32, calibration)
        ranges = {name: finite_max_abs(array) for name, array in values.items()}
        shapes = {name: array.shape for name, array in values.items()}
        result = apply_precision(fp32, precision, io_precision, ranges=ranges, target=target)
        return cls(fp32, precision, io_precision, ranges, shapes, result, target)

    @property
    def model(self) -> onnx.ModelProto:
        return self.result.model

    def candidates(self, op_library: Path | None) -> dict:
        """The emulation (the verdict: faithful per-node rounding) and, where ORT can, the typed graph."""
        label = f"deploykit graph {self.precision}"
        candidates = {f"{label}, rounding emulated per node": self.emulation(op_library)}
        direct, self.execution = typed_runner(self.model, self.precision, op_library)
        if direct is not None:
            candidates[f"{label}, onnxruntime-cpu kernels"] = direct
        return candidates

    def emulation(self, op_library: Path | None) -> OnnxRuntimeRunner:
        """The typed graph's numerics, per-node rounding in fp32 arithmetic (docs/precision.md)."""
        return OnnxRuntimeRunner.from_model(emulate(self.model), op_library)

    def auto_fix(self, reference, feed_sets: list[dict], validation, tolerances: dict, op_library: Path | None,
                 max_pinned: int = 16) -> onnx.ModelProto:
        """Pin nodes on the first feed set that failed, checking the others too; the fixed typed graph."""
        index = next((i for i, run in enumerate(validation.runs) if not run.passed), 0)
        feeds = feed_sets[index]
        others = [(other, reference.run(other)) for i, other in enumerate(feed_sets) if i != index]
        problem = FixProblem(self.fp32, self.precision, self.io_precision, self.ranges, feeds,
                             reference.run(feeds), tolerances, op_library, target=self.target, others=others)
        self.fix = auto_fix(problem, max_pinned)
        self.result = self.fix.result
        return self.model

    def to_json(self) -> dict:
        changes = self.result.stats.changes
        return {
            "precision": self.precision,
            "io_precision": self.io_precision,
            "target": self.target,
            "reference_model": REFERENCE_MODEL,
            "calibration": "fp32 run of the graph on the export inputs (seeded random)",
            "nodes": {self.precision: changes[f"nodes_{self.precision}"], "fp32": changes["nodes_fp32"]},
            "casts": changes["casts"],
            "fp32_nodes": [n.to_json() for n in self.result.fp32_nodes()],
            "tradeoff": tradeoff(self.result, self.shapes),
            "execution": self.execution,
            "auto_fix": self.fix.to_json() if self.fix else None,
        }


def typed_runner(model: onnx.ModelProto, precision: str, op_library: Path | None):
    """(runner or None, what ONNX Runtime's CPU provider does with the typed graph)."""
    missing = ort_cpu_missing_kernels(model, precision)
    listed = f"no {precision} CPU kernel for {', '.join(missing)}" if missing else ""
    try:
        runner = OnnxRuntimeRunner.from_model(float_io(model), op_library)
    except DeployKitError as error:
        return None, f"not executed on the CPU: ONNX Runtime has {listed or 'no kernel for it'} ({error})"
    if missing is None:
        return runner, (f"onnxruntime-cpu ran the {precision} graph; which nodes it upcast to fp32 is unknown "
                        "(this ONNX Runtime build cannot list its kernels safely); the verdict comes from the "
                        "per-node rounding emulation")
    if not missing:
        return runner, f"onnxruntime-cpu ran the {precision} graph with {precision} kernels throughout"
    return runner, (
        f"onnxruntime-cpu ran the {precision} graph, but it has {listed}: it computes those nodes in fp32 and "
        f"rounds only where the graph casts, which understates {precision} error; the verdict comes from the "
        "per-node rounding emulation"
    )


def ort_cpu_missing_kernels(model: onnx.ModelProto, precision: str) -> list[str] | None:
    """Op types of reduced-precision nodes with no ONNX Runtime CPU kernel of that type (None: unknown)."""
    import onnxruntime

    if set(onnxruntime.get_available_providers()) - {"CPUExecutionProvider", "AzureExecutionProvider"}:
        # Listing kernels loads every provider library; in onnxruntime-gpu builds that crashed
        # (segfault seen on the H200 with onnxruntime-gpu 1.31.1). Say "unknown" instead.
        return None
    try:
        from onnxruntime.capi import _pybind_state

        kernels = _pybind_state.get_all_opkernel_def()
    except (ImportError, AttributeError):
        return None
    wanted = ONNX_TYPE_NAMES[precision]
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    versions = {"": opset, CONTRIB_DOMAIN: 1}
    have = {
        _op_label(k.domain, k.op_name) for k in kernels
        if k.provider == "CPUExecutionProvider" and _domain(k.domain) in versions
        and k.version_range[0] <= versions[_domain(k.domain)] <= k.version_range[1]
        and any(wanted in types for types in k.type_constraints.values())
    }
    graph = ir.serde.deserialize_graph(model.graph)
    reduced = {_op_label(node.domain, node.op_type) for node in graph
               if _domain(node.domain) in versions and any(is_low(v) for v in node.outputs)}
    return sorted(reduced - have)


def _domain(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain


def _op_label(domain: str, op_type: str) -> str:
    return f"{domain}::{op_type}" if _domain(domain) else op_type
