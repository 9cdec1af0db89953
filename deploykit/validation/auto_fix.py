"""The auto-fix: pin the nodes that make a reduced-precision graph diverge to fp32, round by round.

From a layer-wise comparison (:mod:`deploykit.validation.layerwise`) it names the first diverging node
and every node that creates Inf/NaN, pins them to fp32 and tries again, until the outputs
pass or a bound on pinned nodes is reached; :func:`tradeoff` says how much speed the pins
give up. Used by ``convert --auto-fix`` and ``deploykit debug``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from deploykit.validation.compare import Tolerance, compare_output
from deploykit.validation.layerwise import FLOAT_TYPES, LayerDiff, compare_layers, run_values
from deploykit.passes.precision import (FLOAT, LOW_DTYPES, ORT_FP32_INSIDE, PrecisionResult, apply_precision,
                                        emulate, source_name)

#: Multiply-adds per output element are counted for these ops; others count one per element.
_MATRIX_OPS = {"Conv", "ConvTranspose", "MatMul", "Gemm", "MatMulRelu"}
_OUTPUT_METRICS = ("max_abs", "max_rel", "cosine", "top1_agreement", "nan", "inf")


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


def is_low(value: ir.Value | None) -> bool:
    """An fp16 or bf16 tensor."""
    return value is not None and value.dtype in LOW_DTYPES


def _responsible(node: ir.Node, diff: LayerDiff, why: str):
    """(node, reason) pairs whose fp32 computation would remove the symptom at ``node``."""
    if node.op_type == "Cast" and any(is_low(v) for v in node.outputs):
        for reader in node.outputs[0].consumers():
            yield reader, f"reads {source_name(diff.output)}, which {why} when cast to {diff.dtype}"
        return
    if any(is_low(v) for v in node.outputs):
        if node.op_type in ORT_FP32_INSIDE:
            # It computes in fp32 inside: the cause is the rounding of what it reads. Its inputs stay
            # rounded unless both it and the nodes computing them go fp32.
            for source in _reduced_sources(node):
                yield source, (f"computes an input that {node.name} ({node.op_type}, fp32 inside) reads "
                               f"rounded to {diff.dtype}; {node.name} {why}")
        yield node, f"its output {source_name(diff.output)} {why}"
        return
    for value in node.inputs:  # an fp32 node: its reduced-precision inputs are the cause
        producer = value.producer() if value is not None else None
        if producer is not None and producer.op_type == "Cast" and is_low(producer.inputs[0]):
            source = producer.inputs[0].producer()
            if source is not None:
                yield source, (f"computes {source_name(value.name)}, which fp32 node {diff.node} ({diff.op}) "
                               f"reads rounded to {producer.inputs[0].dtype.name.lower()}; {diff.node} {why}")


def _reduced_sources(node: ir.Node) -> list[ir.Node]:
    """The nodes (other than Casts) that compute ``node``'s reduced-precision inputs."""
    producers = [value.producer() for value in node.inputs if is_low(value)]
    return [p for p in producers if p is not None and p.op_type != "Cast"]


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
    target: str = "onnxruntime"  # the runtime the graph is typed for (passes.precision.TARGETS)

    def typed(self, pinned: list[PinnedNode]) -> PrecisionResult:
        keep = {**self.keep_fp32, **{p.node: f"auto-fix: {p.reason}" for p in pinned}}
        return apply_precision(self.fp32, self.precision, self.io_precision, keep, self.ranges, self.target)

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
        outputs = [v for v in node.outputs if v.dtype in FLOAT_TYPES]
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

