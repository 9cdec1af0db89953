"""Generic clean-up passes from onnxscript / onnx-ir: constant folding and dead-node removal."""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import onnxscript.optimizer

from deploykit.passes.base import PassStats, count_nodes


def fold_constants(model: ir.Model) -> PassStats:
    """Evaluate subgraphs whose inputs are all constant (shape arithmetic, weight transposes)."""
    nodes_before = count_nodes(model)
    onnxscript.optimizer.fold_constants(model)
    common_passes.RemoveUnusedNodesPass()(model)
    nodes_after = count_nodes(model)
    return PassStats("fold_constants", {"nodes_folded": nodes_before - nodes_after}, nodes_before, nodes_after)


def remove_dead_code(model: ir.Model) -> PassStats:
    """Drop Identity nodes, and nodes, initializers and functions no output depends on."""
    nodes_before = count_nodes(model)
    initializers_before = len(model.graph.initializers)
    functions_before = len(model.functions)
    common_passes.IdentityEliminationPass()(model)
    common_passes.RemoveUnusedNodesPass()(model)
    common_passes.RemoveUnusedFunctionsPass()(model)
    common_passes.RemoveUnusedOpsetsPass()(model)
    nodes_after = count_nodes(model)
    changes = {
        "nodes_removed": nodes_before - nodes_after,
        "initializers_removed": initializers_before - len(model.graph.initializers),
        "functions_removed": functions_before - len(model.functions),
    }
    return PassStats("remove_dead_code", changes, nodes_before, nodes_after)
