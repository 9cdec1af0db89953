"""What every graph pass returns: which rules changed the graph, and how often."""

from __future__ import annotations

import collections
import dataclasses

import onnx
import onnx_ir as ir


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


def count_nodes(model: ir.Model) -> int:
    return sum(1 for _ in model.graph.all_nodes())


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    """Node count per op type (``domain::Op`` outside the default domain), for reports."""
    counts = collections.Counter(
        node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        for node in model.graph.node
    )
    return dict(sorted(counts.items()))
