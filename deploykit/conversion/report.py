"""report.json: the verdict of a conversion and everything that led to it, read from its state.

The report is for people (report.html renders it); the manifest (:mod:`deploykit.bundle.manifest`)
is for the runtimes.
"""

from __future__ import annotations

import onnx

from deploykit.conversion.loading import count_batch_norms
from deploykit.conversion.state import ConversionState
from deploykit.errors import verdict
from deploykit.ops import custom_op_types
from deploykit.passes import op_histogram
from deploykit.passes.ort_fusions import ort_only_ops
from deploykit.specs import BatchRange, InputSpec
from deploykit.validation.compare import FP32_NOISE_MARGIN


def build_report(state: ConversionState) -> dict:
    options, exported, library, engine = state.options, state.exported, state.library, state.engine
    return {
        **_verdict(state),
        "created": state.created,
        "model": {
            "source": str(options.model),
            "kind": state.loaded.kind,
            "inputs": [{"name": s.name, "dtype": s.dtype, "shape": _shape_text(s, options.batch)}
                       for s in state.specs],
            "batch": options.batch.to_json() if options.batch else None,
        },
        "export": {"exporter": exported.exporter, "opset": exported.opset},
        "engines": [engine.to_json()] if engine else [],
        "aoti": state.aoti.to_json(state.validations) if state.aoti else None,
        "openvino": state.openvino.validated_entry(state.validations) if state.openvino else None,
        "custom_ops": {
            "ops": custom_op_types(state.shipped_graph),
            "library": library.path.name if library.path else None,
            "note": library.note,
        },
        "ort_fusions": _ort_fusions(state),
        "passes": [s.to_json() for s in state.shipped_pass_stats],
        "precision": _precision(state),
        "graph": _graph(state),
        "validation": {
            "reference": "pytorch-fp32-cpu",
            "fp32_noise_margin": FP32_NOISE_MARGIN,
            "inputs": str(options.feeds_path) if options.feeds_path else f"seeded random (seed {options.seed})",
            "batch_sizes": state.batch_sizes,
            "passed": state.passed,
            "candidates": [v.to_json() for v in state.validations],
        },
        "versions": state.versions,
        "native": state.native,
    }


def _verdict(state: ConversionState) -> dict:
    """verdict (pass, inconclusive or fail), summary, failures (with where they come from), notes
    and the outputs whose comparison proves nothing."""
    final = state.validations[0]
    failures = [line for v in state.shipped_validations for line in v.failures()]
    failed_checks = len(failures)
    if failures:
        failures.append(_failure_origin(state))
    rounding = final.rounding_notes()
    worst = max((o.metrics.get("max_abs", float("inf")) for r in final.runs for o in r.outputs), default=0.0)
    sizes = ", ".join(map(str, state.batch_sizes))
    summary = (f"{final.label} in {final.backend} matches PyTorch on batch sizes {sizes} "
               f"(worst max abs error {worst:.3g}{', within fp32 rounding' if rounding else ''})")
    if not state.passed:
        summary = f"{failed_checks} check(s) failed on batch sizes {sizes}"
    elif state.quantized is not None and state.quantized.calibration.random:
        summary += (f", but the {state.options.precision} scales were fitted to random inputs (no --calibration): that proves nothing "
                    "for real inputs")
    elif final.inconclusive:
        summary += (f", but that proves nothing for output {', '.join(final.inconclusive)}: "
                    "it does not depend on the input")
    return {
        "verdict": verdict(state.passed, bool(final.inconclusive)),
        "summary": summary,
        "failures": failures,
        "notes": rounding,
        "inconclusive": final.inconclusive_notes(),
    }


def _precision(state: ConversionState) -> dict:
    """fp16/bf16's stage, int8's (what was quantized, what stayed float, what calibrated it), fp8's (the
    same, with the fp16 graph's stage), or fp32."""
    if state.fp8 is not None:
        return {**state.fp8.to_json(), "graph": state.precision.to_json()}
    if state.precision is not None:
        return state.precision.to_json()
    if state.quantization is not None:
        return state.quantization.to_json()
    return {"precision": "fp32"}


def _failure_origin(state: ConversionState) -> str:
    """Which stage lost the accuracy, told by the plain export and the fp32 graph."""
    if not state.plain_validation.passed:
        return "the plain export fails as well, so the exporter (not deploykit's passes) lost accuracy"
    if state.quantization is not None:
        methods = " try --calibration-method entropy or percentile," if state.quantization.precision == "int8" else ""
        return (f"the fp32 export passes, so {state.quantization.precision} lost the accuracy: calibrate on real data "
                f"(--calibration),{methods} convert with --auto-fix, or keep --precision fp32 or fp16")
    if state.fp8 is not None:
        return ("the fp32 export passes, so fp8 or fp16 lost the accuracy: calibrate on real data (--calibration), "
                "convert with --auto-fix, or keep --precision fp16")
    if state.precision is not None:
        return (f"the fp32 export passes, so {state.options.precision} lost the accuracy: deploykit debug BUNDLE "
                "names the nodes, convert --auto-fix pins them to fp32")
    return "the plain export passes, so a deploykit pass changed the results: please report this"


def _graph(state: ConversionState) -> dict:
    """Node and op counts of the plain export against the graph that ships."""
    plain, shipped = state.exported.model, state.shipped_graph
    before, after = op_histogram(plain), op_histogram(shipped)
    return {
        "nodes_before": len(plain.graph.node),
        "nodes_after": len(shipped.graph.node),
        "batch_norm_in_model": count_batch_norms(state.loaded),
        "batch_norm_before": _batch_norm_count(plain),
        "batch_norm_after": _batch_norm_count(shipped),
        "ops": [{"name": op, "before": before.get(op, 0), "after": after.get(op, 0)}
                for op in sorted(set(before) | set(after))],
    }


def _ort_fusions(state: ConversionState) -> dict:
    """The ops only ONNX Runtime runs in the shipped graph, and what the engine was built from."""
    counts = op_histogram(state.shipped_graph)
    ops = {op: counts[op] for op in ort_only_ops(state.shipped_graph)}
    engine_graph = None
    if state.engine is not None:
        engine_graph = "the same passes without ort_fusions" if state.portable is not None else "the same graph"
    return {"enabled": state.options.ort_fusions, "ops": ops, "engine_graph": engine_graph}


def _shape_text(spec: InputSpec, batch: BatchRange | None) -> str:
    dims = ["N", *map(str, spec.shape[1:])] if batch else list(map(str, spec.shape))
    return "x".join(dims)


def _batch_norm_count(model: onnx.ModelProto) -> int:
    return sum(node.op_type == "BatchNormalization" for node in model.graph.node)
