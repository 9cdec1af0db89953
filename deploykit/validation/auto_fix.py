"""The auto-fix: pin the nodes that make a reduced-precision graph diverge to fp32, round by round.

From a layer-wise comparison (:mod:`deploykit.validation.layerwise`) a round names the first
diverging node and every node that creates Inf/NaN and pins them (single culprits). When no node
diverges on its own but the outputs still fail -- the error is spread over many roundings -- a
round tries groups of nodes instead (:mod:`deploykit.validation.groups`: the high-magnitude
path, the chains between fp32 nodes), cheapest first, and keeps the first that passes, or else
the one that brings the outputs closest to passing. :func:`tradeoff` says how much speed the
pins give up. Used by ``convert --auto-fix`` and ``deploykit debug``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from deploykit.passes.precision import (FLOAT, ORT_FP32_INSIDE, PrecisionResult, apply_precision, emulate, is_low,
                                        source_name)
from deploykit.validation.compare import Tolerance, compare_output, finite_max_abs, tolerance_excess
from deploykit.validation.cost import multiply_adds
from deploykit.validation.groups import Group, candidate_groups
from deploykit.validation.layerwise import FLOAT_TYPES, LayerDiff, compare_layers, run_values, values_runner

_OUTPUT_METRICS = ("max_abs", "max_rel", "cosine", "top1_agreement", "nan", "inf")
#: Groups are tried while the multiply-adds pinned by auto-fix stay within this share of the
#: graph's: beyond it, fp32 throughout is the simpler answer.
MAX_GROUP_SHARE = 0.5
#: Runs of the graph spent on trying groups, over all rounds (each is one run of the emulation).
MAX_GROUP_TRIALS = 48
#: A group ends the search when it passes within this fraction of the tolerance: it was chosen on
#: these inputs and the emulation's rounding, and other inputs and kernels round differently.
HEADROOM = 0.5
#: A group that does not pass is kept only if it lowers the error to this fraction or less.
_IMPROVEMENT = 0.9
#: Of the groups that lower the error about as much as the best (within this factor), the cheapest is kept.
_NEAR_BEST = 1.25


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
class FixRound:
    """One round: what it pinned and why, what that costs, and the outputs' error after it."""

    round: int
    kind: str  # "single culprits" or a group's kind
    why: str
    nodes: list[str]
    ops: list[str]
    multiply_adds: int  # of the nodes this round pinned
    share_of_multiply_adds: float  # ... of the graph's
    tried: list[dict] = dataclasses.field(default_factory=list)  # the groups tried, cheapest first
    error_after: float | None = None  # tolerance_excess of the worst output: <= 1 passes the numeric checks
    outputs_after: dict | None = None
    fp32_share_after: float | None = None  # of the multiply-adds, every fp32 node counted
    passed: bool | None = None

    def settle(self, passed: bool, metrics: dict, excess: float, share: float) -> None:
        self.passed, self.outputs_after, self.error_after, self.fp32_share_after = passed, metrics, excess, share

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
    round_log: list[FixRound] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "passed": self.passed, "rounds": self.rounds, "stopped": self.stopped,
            "round_log": [r.to_json() for r in self.round_log],
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
    #: the other validation inputs and their expected outputs: a fix must pass them too
    others: list[tuple[dict, dict]] = dataclasses.field(default_factory=list)
    #: ``run_values`` of ``fp32`` on ``feeds`` where the caller has it (else auto_fix runs it)
    fp32_values: dict | None = None

    def typed(self, pinned: list[PinnedNode]) -> PrecisionResult:
        keep = {**self.keep_fp32, **{p.node: f"auto-fix: {p.reason}" for p in pinned}}
        return apply_precision(self.fp32, self.precision, self.io_precision, keep, self.ranges, self.target)

    def run(self, result: PrecisionResult) -> list[dict]:
        """The emulation's values on the failing inputs, then on each of the others: one session."""
        values = values_runner(emulate(result.model), self.op_library)
        return [values(feeds) for feeds in [self.feeds, *(feeds for feeds, _ in self.others)]]

    def check(self, values: dict, expected: dict | None = None) -> tuple[list[str], dict]:
        failures, metrics = [], {}
        for name, wanted in (expected or self.expected).items():
            comparison = compare_output(name, wanted, values[name].astype(np.float32), self.tolerances[name])
            failures += [f"output {name}: {reason}" for reason in comparison.failures]
            metrics[name] = {k: comparison.metrics.get(k) for k in _OUTPUT_METRICS}
        return failures, metrics

    def verdict(self, runs: list[dict]) -> tuple[list[str], dict[str, float]]:
        """Failures and, per output, how far it is from passing (:func:`tolerance_excess`), on the
        failing inputs and on the others (``runs``: what :meth:`run` gave)."""
        failures, excess = [], dict.fromkeys(self.expected, 0.0)
        for run, expected in zip(runs, [self.expected, *(expected for _, expected in self.others)]):
            failures += self.check(run, expected)[0]
            for name, wanted in expected.items():
                off = tolerance_excess(wanted, run[name].astype(np.float32), self.tolerances[name])
                excess[name] = max(excess[name], off)
        return failures, excess


def auto_fix(problem: FixProblem, max_pinned: int = 16) -> FixResult:
    """Pin nodes to fp32 round by round until the outputs pass or no pin helps.

    ``max_pinned`` bounds the nodes pinned as single culprits; groups are bounded by their cost
    (``MAX_GROUP_SHARE``) and by ``MAX_GROUP_TRIALS``.
    """
    return _Search(problem, max_pinned).run()


@dataclasses.dataclass
class _Trial:
    """A typed graph tried, with its run and verdict."""

    result: PrecisionResult
    values: dict
    failures: list[str]
    excess: dict[str, float]  # per output

    @property
    def worst(self) -> float:
        return max(self.excess.values(), default=0.0)

    @property
    def comfortable(self) -> bool:
        """Passes with ``HEADROOM``."""
        return not self.failures and self.worst <= HEADROOM


class _Search:
    """The state of one auto-fix: the fp32 run, what is pinned, the rounds so far."""

    def __init__(self, problem: FixProblem, max_pinned: int):
        self.problem, self.max_pinned = problem, max_pinned
        self.tolerance = Tolerance.for_precision(problem.precision)
        self.reference = problem.fp32_values or run_values(problem.fp32, problem.feeds, problem.op_library)
        self.shapes = {name: array.shape for name, array in self.reference.items()}
        self.magnitudes = {name: finite_max_abs(array) for name, array in self.reference.items()}
        graph = ir.serde.deserialize_graph(problem.fp32.graph)
        self.pinnable = {node.name for node in graph}
        self.total = sum(multiply_adds(node, self.shapes) for node in graph) or 1
        self.pinned: list[PinnedNode] = []
        self.log: list[FixRound] = []
        self.singles, self.trials_left = 0, MAX_GROUP_TRIALS

    def run(self) -> FixResult:
        trial = self._try([])
        outputs_before, stopped = None, "no round ran"
        while True:
            graph = ir.serde.deserialize_graph(trial.result.model.graph)
            diffs = compare_layers(graph, self.reference, trial.values, self.tolerance)
            _, metrics = self.problem.check(trial.values)
            outputs_before = metrics if outputs_before is None else outputs_before
            _record_after(self.pinned, diffs)
            if self.log:
                share = tradeoff(trial.result, self.shapes)["fp32_share_of_multiply_adds"]
                self.log[-1].settle(not trial.failures, metrics, trial.worst, share)
            if not trial.failures:
                stopped = "outputs pass"
                break
            step = self._pin_culprits(graph, diffs) or self._pin_group(graph, diffs, trial)
            if isinstance(step, str):
                stopped = step
                break
            trial = step
        return FixResult(trial.result, self.pinned, not trial.failures, trial.failures, len(self.log), stopped,
                         outputs_before, metrics, tradeoff(trial.result, self.shapes), self.log)

    def _try(self, pins: list[PinnedNode]) -> _Trial:
        result = self.problem.typed(pins)
        runs = self.problem.run(result)
        return _Trial(result, runs[0], *self.problem.verdict(runs))

    def _pin_culprits(self, graph: ir.Graph, diffs: list[LayerDiff]) -> _Trial | str | None:
        """A round of single culprits; None when there is none."""
        done = {p.node for p in self.pinned}
        culprits = [c for c in find_culprits(graph, diffs, self.pinnable) if c.node not in done]
        if not culprits:
            return None
        if self.singles >= self.max_pinned:
            return f"the bound of {self.max_pinned} pinned nodes is reached"
        new = [_pinned(c, diffs, len(self.log) + 1) for c in culprits[: self.max_pinned - self.singles]]
        self.singles += len(new)
        why = "; ".join(f"{p.node}: {p.reason}" for p in new)
        self._log("single culprits", why, new, graph)
        self.pinned += new
        return self._try(self.pinned)

    def _pin_group(self, graph: ir.Graph, diffs: list[LayerDiff], current: _Trial) -> _Trial | str:
        """A round of groups: the cheapest that passes, else the one that lowers the error most."""
        done = {p.node for p in self.pinned}
        budget = MAX_GROUP_SHARE * self.total - self._pinned_cost(graph)
        groups = candidate_groups(graph, self._retyped, self.magnitudes, self.shapes, self.pinnable - done,
                                  self.problem.precision, budget)
        tried: list[tuple[Group, _Trial]] = []
        for group in groups:
            if not self.trials_left:
                break
            self.trials_left -= 1
            tried.append((group, self._try(self.pinned + self._pins(group, diffs, current))))
            if tried[-1][1].comfortable:
                break
        chosen = _choose(tried, current.worst)
        if chosen is None:
            return self._why_stopped(len(tried))
        group, trial = chosen
        pins = self._pins(group, diffs, current)
        self._log(group.kind, group.why, pins, graph,
                  [{**g.summary(), "error_after": t.worst, "passed": not t.failures} for g, t in tried])
        self.pinned += pins
        return trial

    def _pins(self, group: Group, diffs: list[LayerDiff], current: _Trial) -> list[PinnedNode]:
        """The group's nodes as pins; the symptom they address is the output furthest from passing."""
        worst = max(current.excess.items(), key=lambda item: item[1])[0]
        symptom = next((d for d in diffs if source_name(d.output) == worst), None)
        own = {d.node: d for d in reversed(diffs)}
        return [PinnedNode(name, op, reason, len(self.log) + 1, own[name].error() if name in own else {},
                           symptom=worst, symptom_before=symptom.error() if symptom else None)
                for (name, reason), op in zip(group.nodes.items(), group.ops)]

    def _retyped(self, names: list[str]) -> ir.Graph:
        """The typed graph with ``names`` pinned as well (for the chains a group would leave)."""
        extra = [PinnedNode(name, "", "tried", 0, {}) for name in names]
        return ir.serde.deserialize_graph(self.problem.typed(self.pinned + extra).model.graph)

    def _pinned_cost(self, graph: ir.Graph) -> int:
        pinned = {p.node for p in self.pinned}
        return sum(multiply_adds(node, self.shapes) for node in graph if node.name in pinned)

    def _log(self, kind: str, why: str, pins: list[PinnedNode], graph: ir.Graph, tried: list | None = None) -> None:
        names = {p.node for p in pins}
        cost = sum(multiply_adds(node, self.shapes) for node in graph if node.name in names)
        self.log.append(FixRound(len(self.log) + 1, kind, why, [p.node for p in pins], [p.op for p in pins],
                                 cost, round(cost / self.total, 6), tried or []))

    def _why_stopped(self, tried: int) -> str:
        if not self.trials_left:
            return f"the bound of {MAX_GROUP_TRIALS} runs trying groups of nodes is reached"
        share = f"{MAX_GROUP_SHARE:.0%} of the multiply-adds"
        groups = (f"no group of nodes brings the outputs closer to passing ({tried} tried: the high-magnitude "
                  f"path, the chains between fp32 nodes, none over {share})" if tried
                  else f"every group of nodes left would pin over {share}")
        return (f"no further node to pin: no single node diverges, and {groups}; the remaining error is spread "
                f"over the {self.problem.precision} nodes: keep --precision fp32, or loosen --tolerance")


def _choose(tried: list[tuple[Group, _Trial]], current: float):
    """The (group, trial) to keep, cheapest first: one that passes with headroom, else one that
    passes, else one of those that lower the error about as much as the best; None when none
    lowers it enough."""
    for accept in (lambda t: t.comfortable, lambda t: not t.failures):
        chosen = next(((g, t) for g, t in tried if accept(t)), None)
        if chosen:
            return chosen
    best = min((t.worst for _, t in tried), default=math.inf)
    if not best <= _IMPROVEMENT * current:
        return None
    return next((g, t) for g, t in tried if t.worst <= _NEAR_BEST * best)


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
            work[outputs[0].dtype == FLOAT] += multiply_adds(node, shapes)
    total = work[True] + work[False]
    return {
        "nodes": len(result.nodes),
        "fp32_nodes": len(result.fp32_nodes()),
        "fp32_share_of_multiply_adds": round(work[True] / total, 6) if total else 0.0,
        "estimated_multiply_adds": total,
    }
