"""Layer-wise comparison of two graphs, and the auto-fix that pins diverging nodes to fp32.

A reduced-precision graph that fails validation rarely says why: the error shows at the
outputs, many nodes after its cause. Here both graphs run with every intermediate tensor
exposed, tensors are matched by name (:func:`deploykit.passes.precision.source_name`), and
the first node whose output leaves the tolerance, and every node that creates Inf/NaN, are
named. :func:`auto_fix` pins those nodes to fp32 and tries again, until the outputs pass or
a bound on pinned nodes is reached.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import onnxruntime as ort

from deploykit.backends.onnxruntime import OnnxRuntimeRunner
from deploykit.compare import Tolerance, compare_output
from deploykit.errors import BadInputError, DeployKitError
from deploykit.feeds import load_feeds, random_feeds
from deploykit.passes.precision import (
    FLOAT, PrecisionResult, apply_precision, emulate, float_io, name_nodes, source_name, type_custom_op_outputs,
)
from deploykit.specs import InputSpec

_FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
#: Multiply-adds per output element are counted for these ops; others count one per element.
_MATRIX_OPS = {"Conv", "ConvTranspose", "MatMul", "Gemm", "MatMulRelu"}
_OUTPUT_METRICS = ("max_abs", "max_rel", "cosine", "top1_agreement", "nan", "inf")


# --- running with intermediates ---------------------------------------------------------------


def expose_values(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with every float tensor a node writes added to the graph outputs."""
    ir_model = ir.serde.deserialize_model(model)
    common_passes.ShapeInferencePass(strict_mode=False)(ir_model)
    type_custom_op_outputs(ir_model.graph)
    graph = ir_model.graph
    present = {value.name for value in graph.outputs}
    for node in graph:
        for value in node.outputs:
            if value.dtype in _FLOAT_TYPES and value.name not in present and "~" not in value.name:
                graph.outputs.append(value)
                present.add(value.name)
    return ir.serde.serialize_model(ir_model)


def run_values(model: onnx.ModelProto, feeds: dict[str, np.ndarray], op_library: Path | None = None,
               optimize: bool = True) -> dict:
    """Every float tensor of one CPU run (inputs and node outputs), by name.

    ``optimize=False`` turns ONNX Runtime's graph rewrites off: the graph's own semantics.
    """
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if op_library is not None:
        options.register_custom_ops_library(str(op_library))
    try:
        session = ort.InferenceSession(expose_values(model).SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
    except Exception as error:
        first_line = str(error).splitlines()[0]
        raise DeployKitError(f"ONNX Runtime {ort.__version__} cannot load the graph: {first_line}") from error
    inputs = {i.name: i.type for i in session.get_inputs()}
    arrays = session.run(None, {name: _as_input(array, inputs[name]) for name, array in feeds.items()
                                if name in inputs})
    values = dict(zip((o.name for o in session.get_outputs()), arrays))
    return {**{k: v for k, v in feeds.items() if v.dtype.kind == "f"}, **values}


def _as_input(array: np.ndarray, onnx_type: str):
    """fp32 data for an fp16 or bf16 input, converted as a caller would (bf16 via an OrtValue)."""
    if array.dtype.kind != "f" or onnx_type not in ("tensor(float16)", "tensor(bfloat16)"):
        return array
    if onnx_type == "tensor(float16)":
        return array.astype(np.float16)
    bits = array.astype(ml_dtypes.bfloat16).view(np.uint16)
    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, onnx.TensorProto.BFLOAT16)


def _max_abs(array: np.ndarray) -> float:
    magnitudes = np.abs(array[np.isfinite(array)].astype(np.float64))
    return float(magnitudes.max(initial=0.0))


# --- comparing layer by layer -----------------------------------------------------------------


@dataclasses.dataclass
class LayerDiff:
    """One node output of the candidate against the reference's tensor of the same name."""

    node: str
    op: str
    output: str
    dtype: str
    max_abs: float
    scale: float
    cosine: float
    new_nonfinite: int
    inputs_finite: bool
    diverged: bool

    def error(self) -> dict:
        return {"max_abs": self.max_abs, "max_ref": self.scale, "cosine": self.cosine,
                "new_inf_nan": self.new_nonfinite}

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def compare_layers(graph: ir.Graph, reference: dict, candidate: dict, tolerance: Tolerance) -> list[LayerDiff]:
    """Diffs of each node output of ``graph`` (topological order) present in both runs.

    An output diverges when it has Inf/NaN the reference lacks, or ``max |d| > atol + rtol *
    max |ref|`` (the tolerance scaled by the tensor's magnitude), or its cosine is below
    ``min_cosine``.
    """
    diffs = []
    for node in graph:
        inputs_finite = all(
            np.isfinite(candidate[v.name]).all() for v in node.inputs if v is not None and v.name in candidate
        )
        for value in node.outputs:
            ref, cand = reference.get(source_name(value.name)), candidate.get(value.name)
            if ref is None or cand is None or ref.shape != cand.shape:
                continue
            diffs.append(_diff(node, value, ref, cand, inputs_finite, tolerance))
    return diffs


def _diff(node: ir.Node, value: ir.Value, ref: np.ndarray, cand: np.ndarray, inputs_finite: bool,
          tol: Tolerance) -> LayerDiff:
    ref64, cand64 = ref.astype(np.float64).ravel(), cand.astype(np.float64).ravel()
    finite = np.isfinite(ref64) & np.isfinite(cand64)
    delta = np.abs(ref64[finite] - cand64[finite])
    max_abs, scale = float(delta.max(initial=0.0)), float(np.abs(ref64[finite]).max(initial=0.0))
    cosine = _cosine(ref64[finite], cand64[finite])
    new_nonfinite = int((np.isfinite(ref64) & ~np.isfinite(cand64)).sum())
    diverged = new_nonfinite > 0 or max_abs > tol.atol + tol.rtol * scale or cosine < tol.min_cosine
    dtype = str(value.dtype.name).lower() if value.dtype is not None else "?"
    return LayerDiff(node.name, node.op_type, value.name, dtype, max_abs, scale, cosine, new_nonfinite,
                     inputs_finite, diverged)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    if norm == 0.0:
        return 1.0 if not a.any() and not b.any() else 0.0
    return float(np.dot(a, b) / norm)


# --- finding the nodes to pin ------------------------------------------------------------------


@dataclasses.dataclass
class Culprit:
    node: str
    op: str
    reason: str
    symptom: LayerDiff


def find_culprits(graph: ir.Graph, diffs: list[LayerDiff], pinnable: set[str]) -> list[Culprit]:
    """Nodes to pin: the first diverging node and every node that creates Inf/NaN.

    A boundary Cast that overflows is fixed by keeping its readers fp32; an fp32 node that
    diverges got reduced-precision inputs, so the nodes computing those are pinned.
    """
    nodes = {node.name: node for node in graph}
    origins = [d for d in diffs if d.new_nonfinite and d.inputs_finite]
    first = next((d for d in diffs if d.diverged), None)
    culprits: dict[str, Culprit] = {}
    for diff in origins + ([first] if first else []):
        why = "overflows to Inf/NaN" if diff.new_nonfinite and diff.inputs_finite else "diverges first"
        for node, reason in _responsible(nodes[diff.node], diff, why):
            if node.name in pinnable and node.name not in culprits:
                culprits[node.name] = Culprit(node.name, node.op_type, reason, diff)
    return list(culprits.values())


def _is_low(value: ir.Value | None) -> bool:
    return value is not None and value.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _responsible(node: ir.Node, diff: LayerDiff, why: str):
    """(node, reason) pairs whose fp32 computation would remove the symptom at ``node``."""
    if node.op_type == "Cast" and any(_is_low(v) for v in node.outputs):
        for reader in node.outputs[0].consumers():
            yield reader, f"reads {source_name(diff.output)}, which {why} when cast to {diff.dtype}"
        return
    if any(_is_low(v) for v in node.outputs):
        yield node, f"its output {source_name(diff.output)} {why}"
        return
    for value in node.inputs:  # an fp32 node: its reduced-precision inputs are the cause
        producer = value.producer() if value is not None else None
        if producer is not None and producer.op_type == "Cast" and _is_low(producer.inputs[0]):
            source = producer.inputs[0].producer()
            if source is not None:
                yield source, (f"computes {source_name(value.name)}, which fp32 node {diff.node} ({diff.op}) "
                               f"reads rounded to {producer.inputs[0].dtype.name.lower()}; {diff.node} {why}")


# --- the auto-fix loop ------------------------------------------------------------------------


@dataclasses.dataclass
class PinnedNode:
    node: str
    op: str
    reason: str
    round: int
    error_before: dict
    error_after: dict | None = None
    symptom: str = ""
    symptom_before: dict | None = None
    symptom_after: dict | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class FixResult:
    result: PrecisionResult
    pinned: list[PinnedNode]
    passed: bool
    failures: list[str]
    rounds: int
    stopped: str
    outputs_before: dict
    outputs_after: dict
    tradeoff: dict

    def to_json(self) -> dict:
        return {
            "passed": self.passed, "rounds": self.rounds, "stopped": self.stopped,
            "pinned": [p.to_json() for p in self.pinned], "failures": self.failures,
            "outputs_before": self.outputs_before, "outputs_after": self.outputs_after, "tradeoff": self.tradeoff,
        }


@dataclasses.dataclass
class FixProblem:
    """What auto_fix works on: the fp32 graph, how to type it, and what its outputs must match."""

    fp32: onnx.ModelProto
    precision: str
    io_precision: str | None
    ranges: dict[str, float]
    feeds: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]
    tolerances: dict[str, Tolerance]
    op_library: Path | None = None
    keep_fp32: dict[str, str] = dataclasses.field(default_factory=dict)

    def typed(self, pinned: list[PinnedNode]) -> PrecisionResult:
        keep = {**self.keep_fp32, **{p.node: f"auto-fix: {p.reason}" for p in pinned}}
        return apply_precision(self.fp32, self.precision, self.io_precision, keep, self.ranges)

    def run(self, result: PrecisionResult) -> dict:
        return run_values(emulate(result.model), self.feeds, self.op_library)

    def check(self, values: dict) -> tuple[list[str], dict]:
        failures, metrics = [], {}
        for name, expected in self.expected.items():
            comparison = compare_output(name, expected, values[name].astype(np.float32), self.tolerances[name])
            failures += [f"output {name}: {reason}" for reason in comparison.failures]
            metrics[name] = {k: comparison.metrics.get(k) for k in _OUTPUT_METRICS}
        return failures, metrics


def auto_fix(problem: FixProblem, max_pinned: int = 16) -> FixResult:
    """Pin culprits to fp32 round by round until the outputs pass or ``max_pinned`` is reached."""
    tolerance = Tolerance.for_precision(problem.precision)
    reference = run_values(problem.fp32, problem.feeds, problem.op_library)
    pinnable = {node.name for node in problem.fp32.graph.node}
    pinned: list[PinnedNode] = []
    result = problem.typed(pinned)
    stopped, outputs_before = "no round ran", {}
    for round_index in range(max_pinned + 1):
        values = problem.run(result)
        failures, metrics = problem.check(values)
        graph = ir.serde.deserialize_graph(result.model.graph)
        diffs = compare_layers(graph, reference, values, tolerance)
        if round_index == 0:
            outputs_before = metrics
        _record_after(pinned, diffs)
        if not failures:
            stopped = "outputs pass"
            break
        culprits = [c for c in find_culprits(graph, diffs, pinnable) if c.node not in {p.node for p in pinned}]
        if not culprits:
            stopped = "no further node to pin: the remaining error is spread over many nodes"
            break
        if len(pinned) == max_pinned:
            stopped = f"the bound of {max_pinned} pinned nodes is reached"
            break
        pinned += [_pinned(c, diffs, round_index + 1) for c in culprits[: max_pinned - len(pinned)]]
        result = problem.typed(pinned)
    return FixResult(result, pinned, not failures, failures, round_index, stopped, outputs_before, metrics,
                     tradeoff(result, {k: v.shape for k, v in reference.items()}))


def _pinned(culprit: Culprit, diffs: list[LayerDiff], round_index: int) -> PinnedNode:
    own = next((d for d in diffs if d.node == culprit.node), None)
    return PinnedNode(culprit.node, culprit.op, culprit.reason, round_index, own.error() if own else {},
                      symptom=culprit.symptom.output, symptom_before=culprit.symptom.error())


def _record_after(pinned: list[PinnedNode], diffs: list[LayerDiff]) -> None:
    """Errors of each pinned node and of its symptom in the latest run."""
    by_output = {d.output: d for d in diffs}
    by_node: dict[str, LayerDiff] = {}
    by_source: dict[str, LayerDiff] = {}
    for diff in diffs:
        by_node.setdefault(diff.node, diff)
        by_source.setdefault(source_name(diff.output), diff)
    for pin in pinned:
        own = by_node.get(pin.node)
        symptom = by_output.get(pin.symptom) or by_source.get(source_name(pin.symptom))
        pin.error_after = own.error() if own else None
        pin.symptom_after = symptom.error() if symptom else None


# --- the speed/accuracy trade-off -------------------------------------------------------------


def tradeoff(result: PrecisionResult, shapes: dict[str, tuple]) -> dict:
    """fp32 share of nodes and of estimated multiply-adds: a proxy for the speed given up.

    ``shapes`` are the fp32 graph's tensor shapes in one run (names as in that graph).
    """
    graph = ir.serde.deserialize_graph(result.model.graph)
    work = {True: 0, False: 0}
    for node in graph:
        outputs = [v for v in node.outputs if v.dtype in _FLOAT_TYPES]
        if outputs and node.op_type != "Cast":
            work[outputs[0].dtype == FLOAT] += _multiply_adds(node, shapes)
    total = work[True] + work[False]
    return {
        "nodes": len(result.nodes),
        "fp32_nodes": len(result.fp32_nodes()),
        "fp32_share_of_multiply_adds": round(work[True] / total, 6) if total else 0.0,
        "estimated_multiply_adds": total,
    }


def _multiply_adds(node: ir.Node, shapes: dict[str, tuple]) -> int:
    out = shapes.get(source_name(node.outputs[0].name))
    if out is None:
        return 0
    elements = math.prod(out)
    if node.op_type not in _MATRIX_OPS or len(node.inputs) < 2 or node.inputs[1] is None:
        return elements
    first, weight = _shape(node.inputs[0], shapes), _shape(node.inputs[1], shapes)
    if node.op_type == "Conv" and weight:
        return elements * math.prod(weight[1:])
    if node.op_type == "ConvTranspose" and first and weight:
        return math.prod(first) * math.prod(weight[1:])
    if first:
        trans_a = node.attributes.get("transA")
        return elements * (first[0] if trans_a is not None and trans_a.as_int() else first[-1])
    return elements


def _shape(value: ir.Value, shapes: dict[str, tuple]) -> tuple[int, ...] | None:
    if value.const_value is not None:
        return tuple(value.const_value.shape.numpy())
    return shapes.get(source_name(value.name))


# --- convert's precision stage ----------------------------------------------------------------


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
    execution: str = ""
    fix: FixResult | None = None

    @classmethod
    def start(cls, optimized: onnx.ModelProto, precision: str, io_precision: str | None,
              calibration: dict) -> PrecisionStage:
        fp32 = name_nodes(optimized)
        values = run_values(fp32, calibration)
        ranges = {name: _max_abs(array) for name, array in values.items()}
        shapes = {name: array.shape for name, array in values.items()}
        result = apply_precision(fp32, precision, io_precision, ranges=ranges)
        return cls(fp32, precision, io_precision, ranges, shapes, result)

    @property
    def model(self) -> onnx.ModelProto:
        return self.result.model

    def candidates(self, op_library: Path | None) -> dict:
        """The emulation (the verdict: faithful per-node rounding) and, where ORT can, the typed graph."""
        label = f"deploykit graph {self.precision}"
        emulation = OnnxRuntimeRunner(emulate(self.model), op_library=op_library)
        candidates = {f"{label}, rounding emulated per node": emulation}
        direct, self.execution = typed_runner(self.model, self.precision, op_library)
        if direct is not None:
            candidates[f"{label}, onnxruntime-cpu kernels"] = direct
        return candidates

    def auto_fix(self, reference, feed_sets: list[dict], validation, tolerances: dict, op_library: Path | None,
                 max_pinned: int = 16) -> onnx.ModelProto:
        """Pin nodes on the first feed set that failed; the fixed typed graph."""
        index = next((i for i, run in enumerate(validation.runs) if not run.passed), 0)
        feeds = feed_sets[index]
        problem = FixProblem(self.fp32, self.precision, self.io_precision, self.ranges, feeds,
                             reference.run(feeds), tolerances, op_library)
        self.fix = auto_fix(problem, max_pinned)
        self.result = self.fix.result
        return self.model

    def to_json(self) -> dict:
        changes = self.result.stats.changes
        return {
            "precision": self.precision,
            "io_precision": self.io_precision,
            "reference_model": REFERENCE_MODEL,
            "calibration": "fp32 run of the graph on the export inputs (seeded random)",
            "nodes": {self.precision: changes[f"nodes_{self.precision}"], "fp32": changes["nodes_fp32"]},
            "casts": changes["casts"],
            "fp32_nodes": [n.to_json() for n in self.result.fp32_nodes()],
            "tradeoff": tradeoff(self.result, self.shapes),
            "execution": self.execution,
            "auto_fix": self.fix.to_json() if self.fix else None,
        }


#: The fp32 graph a reduced-precision bundle was typed from: the reference of ``deploykit debug``.
REFERENCE_MODEL = "model.fp32.onnx"


def typed_runner(model: onnx.ModelProto, precision: str, op_library: Path | None):
    """(runner or None, what ONNX Runtime's CPU provider does with the typed graph)."""
    missing = ort_cpu_missing_kernels(model, precision)
    listed = f"no {precision} CPU kernel for {', '.join(missing)}" if missing else ""
    try:
        runner = OnnxRuntimeRunner(float_io(model), op_library=op_library)
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
    wanted = {"fp16": "tensor(float16)", "bf16": "tensor(bfloat16)"}[precision]
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    have = {
        k.op_name for k in kernels
        if k.provider == "CPUExecutionProvider" and k.domain in ("", "ai.onnx")
        and k.version_range[0] <= opset <= k.version_range[1]
        and any(wanted in types for types in k.type_constraints.values())
    }
    graph = ir.serde.deserialize_graph(model.graph)
    reduced = {node.op_type for node in graph
               if node.domain in ("", "ai.onnx") and any(_is_low(v) for v in node.outputs)}
    return sorted(reduced - have)


# --- debugging a bundle -----------------------------------------------------------------------


@dataclasses.dataclass
class BundleGraphs:
    """What ``deploykit debug`` reads from a bundle."""

    path: Path
    manifest: dict
    model: onnx.ModelProto
    reference: onnx.ModelProto | None
    op_library: Path | None
    precision: str
    io_precision: str | None


def open_bundle(path: Path) -> BundleGraphs:
    manifest_path = Path(path) / "manifest.json"
    if not manifest_path.is_file():
        raise BadInputError(f"{path} is not a deploykit bundle (no manifest.json); pass the -o directory of convert")
    manifest = json.loads(manifest_path.read_text())
    reference_path = Path(path) / (manifest.get("reference_model") or REFERENCE_MODEL)
    libraries = [Path(path) / entry["file"] for entry in manifest.get("custom_op_libraries", [])]
    report_path = Path(path) / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    return BundleGraphs(
        Path(path), manifest, onnx.load(Path(path) / manifest.get("model", "model.onnx")),
        onnx.load(reference_path) if reference_path.is_file() else None,
        next((lib for lib in libraries if lib.is_file()), None),
        manifest.get("precision", "fp32"), report.get("precision", {}).get("io_precision"),
    )


def bundle_feeds(bundle: BundleGraphs, feeds_path: Path | None, seed: int, batch: int | None) -> dict:
    """The user's .npz, or seeded random inputs at ``batch`` (default: the largest validated)."""
    specs = []
    sizes = bundle.manifest.get("validation", {}).get("batch_sizes") or [1]
    for entry in bundle.manifest["inputs"]:
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in entry["shape"]]
        shape[0] = batch or max(sizes)
        kind = np.dtype(entry["dtype"]).kind if entry["dtype"] != "bfloat16" else "f"
        specs.append(InputSpec(entry["name"], tuple(shape), "float32" if kind == "f" else entry["dtype"]))
    if feeds_path is not None:
        feeds = load_feeds(feeds_path, specs)
        return {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in feeds.items()}
    return random_feeds(specs, seed)


def layerwise(bundle: BundleGraphs, feeds: dict, reference: onnx.ModelProto | None = None) -> list[LayerDiff]:
    """Node-by-node diffs of the bundle's graph against ``reference``.

    Reduced precision: the rounding emulation of model.onnx against the fp32 graph it came
    from. fp32: model.onnx as deployed (our op library, ONNX Runtime's rewrites) against
    ``reference``, by default model.onnx without either (the ONNX semantics).
    """
    graph = ir.serde.deserialize_graph(bundle.model.graph)
    if bundle.precision != "fp32":
        expected = run_values(reference or _need_reference(bundle), feeds, bundle.op_library)
        actual = run_values(emulate(bundle.model), feeds, bundle.op_library)
    else:
        expected = run_values(reference or bundle.model, feeds, None, optimize=False)
        actual = run_values(bundle.model, feeds, bundle.op_library)
    return compare_layers(graph, expected, actual, Tolerance.for_precision(bundle.precision))


def fix_bundle(bundle: BundleGraphs, feeds: dict, max_pinned: int = 16,
               reference: onnx.ModelProto | None = None) -> FixResult:
    """Auto-fix a reduced-precision bundle, starting from the fp32 nodes it already has."""
    fp32 = reference or _need_reference(bundle)
    expected = run_values(fp32, feeds, bundle.op_library)
    outputs = [o.name for o in fp32.graph.output]
    tolerances = {name: Tolerance.for_precision(bundle.precision) for name in outputs}
    problem = FixProblem(fp32, bundle.precision, bundle.io_precision, {}, feeds,
                         {name: expected[name] for name in outputs}, tolerances, bundle.op_library,
                         keep_fp32=dict.fromkeys(fp32_node_names(bundle.model), "fp32 in the bundle"))
    return auto_fix(problem, max_pinned)


def fp32_node_names(model: onnx.ModelProto) -> list[str]:
    """Nodes of a typed graph that compute in fp32 (Casts aside)."""
    graph = ir.serde.deserialize_graph(model.graph)
    return [node.name for node in graph
            if node.op_type != "Cast" and any(v.dtype == FLOAT for v in node.outputs)]


def _need_reference(bundle: BundleGraphs) -> onnx.ModelProto:
    if bundle.reference is None:
        raise BadInputError(f"{bundle.path} has no {REFERENCE_MODEL}: convert it again with this deploykit, "
                            "or give the fp32 graph with --reference")
    return bundle.reference
