"""``convert --precision int8 --auto-fix``: the quantized matrix products that make the outputs
diverge are kept in float, and the graph is quantized again.

The nodes are ranked once, on the validation inputs that failed: both graphs run with every
tensor exposed (``layerwise.run_values``), and each quantized Conv, ConvTranspose, Gemm or MatMul
is charged the relative error it adds -- that of its output against the fp32 graph's, less that
of its input, which its producers caused. Rounds then keep the worst 1, 2, 4 ... of them in float
(``quantize_static``'s ``nodes_to_exclude``, same calibration samples and method; the quantized ops
feeding a kept node stay float with it), each validated like the first quantization, until one
passes or ``MAX_FLOAT`` products are reached; where none passes the fully quantized graph ships.
Each round's graph is timed on this CPU beside the fully quantized one, so the report says what the
float nodes cost. Unlike fp16's auto-fix, a round does not look for a first diverging node: int8's
error is spread over every quantized tensor, so the ranking of what each node adds is the signal
(on resnet50 a weak one: BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from pathlib import Path

import numpy as np
import onnx

from deploykit.validation.layerwise import run_values

#: Quantized ops that auto-fix may keep in float: the matrix products, where int8's error is made
#: (the data movement and elementwise ops between them follow their producers).
FIXABLE_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
#: The most matrix products auto-fix keeps in float (as fp16's auto-fix pins at most 16 nodes).
MAX_FLOAT = 16
#: Timing runs per graph (after two warm-up runs), within this many seconds; the median is reported.
TIMING_RUNS, TIMING_SECONDS = 15, 20.0


@dataclasses.dataclass
class Ranked:
    node: str
    op: str
    added_error: float | None  # relative error of its output less that of its input; None: not measurable


@dataclasses.dataclass
class FixRound:
    kept_float: list[str]
    passed: bool
    latency_ms: float | None


INT8_METHOD = ("rank the quantized matrix products by the relative error each adds; keep the worst 1, 2, 4 ... in "
               "float until the outputs pass")


@dataclasses.dataclass
class QuantizationFix:
    """What auto-fix did (int8, and fp8's in conversion/fp8.py): the ranking, each round, and the latency
    of the fully quantized graph or packages."""

    ranking: list[Ranked]
    rounds: list[FixRound] = dataclasses.field(default_factory=list)
    quantized_ms: float | None = None
    stopped: str = ""
    method: str = INT8_METHOD

    @property
    def kept_float(self) -> list[str]:
        """What the shipped graph keeps in float: the passing round's nodes (none when no round passed)."""
        return self.rounds[-1].kept_float if self.rounds and self.rounds[-1].passed else []

    def to_json(self) -> dict:
        added = {r.node: r for r in self.ranking}
        return {
            "method": self.method,
            "quantized_ms": self.quantized_ms,
            "rounds": [{"kept_float": r.kept_float, "passed": r.passed, "latency_ms": r.latency_ms,
                        "cost": _ratio(r.latency_ms, self.quantized_ms)} for r in self.rounds],
            "kept_float": [{"node": name, "op": added[name].op, "added_error": added[name].added_error}
                           if name in added else {"node": name, "feeds": "a node kept in float"}
                           for name in self.kept_float],
            "stopped": self.stopped,
        }


def rank_nodes(fp32: onnx.ModelProto, quantized: onnx.ModelProto, feeds: dict[str, np.ndarray],
               candidates: set[str], op_library: Path | None = None) -> list[Ranked]:
    """``candidates`` (quantized matrix products of ``fp32``), worst first by the relative error each adds."""
    exact, approximate = run_values(fp32, feeds, op_library), run_values(quantized, feeds, op_library)
    ranked = []
    for node in fp32.graph.node:
        if node.name not in candidates:
            continue
        output = _relative_error(approximate.get(node.output[0]), exact.get(node.output[0]))
        upstream = _relative_error(approximate.get(node.input[0]), exact.get(node.input[0]))
        ranked.append(Ranked(node.name, node.op_type, None if output is None else output - (upstream or 0.0)))
    # a product whose output the quantized graph renamed (a Relu folded into its QuantizeLinear takes the
    # Relu's name) cannot be measured: it comes last, still a candidate
    return sorted(ranked, key=lambda r: -math.inf if r.added_error is None else r.added_error, reverse=True)


def with_feeding_ops(fp32: onnx.ModelProto, nodes: list[str], quantized_ops: tuple[str, ...]) -> list[str]:
    """``nodes`` and the quantized ops between each and the matrix products or inputs that feed it
    (a Relu, a pooling, a reshape): those quantize the tensor the node reads (a Relu folds into its
    QuantizeLinear), so keeping the node float means keeping them float too."""
    producers = {output: node for node in fp32.graph.node for output in node.output}
    kept, waiting = list(nodes), list(nodes)
    by_name = {node.name: node for node in fp32.graph.node}
    while waiting:
        for name in by_name[waiting.pop()].input:
            producer = producers.get(name)
            if (producer is not None and producer.op_type in quantized_ops and producer.op_type not in FIXABLE_OPS
                    and producer.name not in kept):
                kept.append(producer.name)
                waiting.append(producer.name)
    return kept


def round_sizes(candidates: int, max_float: int) -> list[int]:
    """How many of the ranked nodes each round keeps in float: 1, 2, 4 ... up to the bound."""
    bound = min(candidates, max_float)
    sizes, size = [], 1
    while size < bound:
        sizes.append(size)
        size *= 2
    return sizes + [bound] if bound else []


def latency_ms(model: onnx.ModelProto, feeds: dict[str, np.ndarray], op_library: Path | None = None) -> float:
    """Median wall time of one ONNX Runtime CPU run of ``model`` on ``feeds`` (``tuning.timing``'s host clock)."""
    from deploykit.backends.onnxruntime.runner import OnnxRuntimeRunner

    return median_ms(functools.partial(OnnxRuntimeRunner.from_model(model, op_library).run, feeds))


def median_ms(step) -> float:
    """Median wall time of ``step()`` (numpy out, so a GPU run is finished) after two warm-up calls."""
    from deploykit.tuning.timing import call_timer, time_calls, warm_up

    warm_up(step, 2)
    return statistics.median(time_calls(step, TIMING_RUNS, TIMING_SECONDS, call_timer("cpu"))) * 1e3


def _relative_error(approximate, exact) -> float | None:
    if approximate is None or exact is None or np.shape(approximate) != np.shape(exact):
        return None
    exact = np.asarray(exact, np.float64)
    scale = float(np.linalg.norm(exact))
    return float(np.linalg.norm(np.asarray(approximate, np.float64) - exact)) / scale if scale else None


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None
