"""Generic clean-up passes from onnxscript / onnx-ir: constant folding and dead-node removal."""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import onnxscript.optimizer

from deploykit.passes.base import GraphPass, GraphSize


class FoldConstants(GraphPass):
    """Evaluate subgraphs whose inputs are all constant (shape arithmetic, weight transposes)."""

    name = "fold_constants"

    def rewrite(self, model: ir.Model) -> dict[str, int]:
        onnxscript.optimizer.fold_constants(model)
        common_passes.RemoveUnusedNodesPass()(model)
        return {}

    def removed(self, before: GraphSize, after: GraphSize) -> dict[str, int]:
        return {"nodes_folded": before.nodes - after.nodes}


class RemoveDeadCode(GraphPass):
    """Drop Identity nodes, and nodes, initializers and functions no output depends on."""

    name = "remove_dead_code"

    def rewrite(self, model: ir.Model) -> dict[str, int]:
        common_passes.IdentityEliminationPass()(model)
        common_passes.RemoveUnusedNodesPass()(model)
        common_passes.RemoveUnusedFunctionsPass()(model)
        common_passes.RemoveUnusedOpsetsPass()(model)
        return {}

    def removed(self, before: GraphSize, after: GraphSize) -> dict[str, int]:
        return {
            "nodes_removed": before.nodes - after.nodes,
            "initializers_removed": before.initializers - after.initializers,
            "functions_removed": before.functions - after.functions,
        }
