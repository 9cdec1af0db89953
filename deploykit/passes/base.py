"""What every graph pass is and returns: an onnx-ir in-place pass whose result says which
rules changed the graph, how often, and how many nodes it had before and after."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

import onnx
import onnx_ir as ir
from onnxscript.rewriter import RewriteRule, RewriteRuleSet


@dataclasses.dataclass
class PassStats:
    name: str
    changes: dict[str, int]
    nodes_before: int
    nodes_after: int

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "changes": self.changes,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
        }


@dataclasses.dataclass
class StatsResult(ir.passes.PassResult):
    """onnx-ir's pass result, with the pass's :class:`PassStats` for the report."""

    stats: PassStats


@dataclasses.dataclass(frozen=True)
class GraphSize:
    """What a pass may add or remove, counted before and after it runs."""

    nodes: int
    initializers: int
    functions: int

    @classmethod
    def of(cls, model: ir.Model) -> GraphSize:
        return cls(count_nodes(model), len(model.graph.initializers), len(model.functions))


class GraphPass(ir.passes.InPlacePass):
    """A deploykit pass: ``rewrite`` changes the model in place and returns its changes per rule.

    Calling the pass counts the graph around ``rewrite``, so no pass counts nodes itself;
    a pass whose changes are removals reports them from the counts with ``removed``.
    """

    #: The pass's name in the report and the manifest.
    name: str
    #: Whether it writes deploykit's ops, which need the op library (convert --no-custom-ops skips it).
    emits_custom_ops = False
    #: Whether it writes ONNX Runtime's contrib ops, which only ONNX Runtime runs (convert --no-ort-fusions
    #: skips it; the TensorRT engine is built without it).
    emits_contrib_ops = False
    #: Whether it folds Conv/MatMul/Gemm into an op int8 quantization cannot quantize (convert
    #: --precision int8 skips it, so that those products run in int8: docs/precision.md).
    hides_quantizable_ops = False

    def rewrite(self, model: ir.Model) -> dict[str, int]:
        return {}

    def removed(self, before: GraphSize, after: GraphSize) -> dict[str, int]:
        """Changes read from the counts; none unless a pass says otherwise."""
        return {}

    def call(self, model: ir.Model) -> StatsResult:
        before = GraphSize.of(model)
        changes = self.rewrite(model)
        after = GraphSize.of(model)
        changes = {**changes, **self.removed(before, after)}
        stats = PassStats(self.name, changes, before.nodes, after.nodes)
        return StatsResult(model, modified=bool(changes) or before != after, stats=stats)


def apply_rules(model: ir.Model, rules: Iterable[RewriteRule], commute: bool = False) -> dict[str, int]:
    """Apply each rule in turn over the whole model: how often each one that matched did."""
    changes = {}
    for rule in rules:
        if count := RewriteRuleSet([rule], commute=commute).apply_to_model(model):
            changes[rule.name] = count
    return changes


def count_nodes(model: ir.Model) -> int:
    return sum(1 for _ in model.graph.all_nodes())


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    """Node count per op type (``domain::Op`` outside the default domain), for reports."""
    counts = collections.Counter(
        node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        for node in model.graph.node
    )
    return dict(sorted(counts.items()))
