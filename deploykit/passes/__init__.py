"""Graph passes over the exported ONNX model, in the order they run.

Each pass is an onnx-ir in-place pass (:class:`GraphPass`) whose result carries a
:class:`PassStats`; the model is converted from and back to a ``ModelProto`` once, around
the whole list.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from deploykit.passes.base import GraphPass, PassStats, op_histogram
from deploykit.passes.cleanup import FoldConstants, RemoveDeadCode
from deploykit.passes.fold_bn import FoldBatchNorm
from deploykit.passes.fuse_batch_norm import FuseBatchNorm
from deploykit.passes.fuse_matmul_relu import FuseMatMulRelu

#: Constant folding first exposes constant weights; fusions take what folding left.
PASSES: tuple[GraphPass, ...] = (FoldConstants(), FoldBatchNorm(), FuseBatchNorm(), FuseMatMulRelu(),
                                 RemoveDeadCode())


def run_passes(model: onnx.ModelProto, custom_ops: bool = True) -> tuple[onnx.ModelProto, list[PassStats]]:
    """Run :data:`PASSES` (without those writing deploykit's ops unless ``custom_ops``)."""
    ir_model = ir.serde.deserialize_model(model)
    # Folding into MatMul needs input ranks: infer shapes the exporter did not record.
    common_passes.ShapeInferencePass()(ir_model)
    stats = [graph_pass(ir_model).stats for graph_pass in PASSES if custom_ops or not graph_pass.emits_custom_ops]
    return ir.serde.serialize_model(ir_model), stats


__all__ = ["PASSES", "GraphPass", "PassStats", "op_histogram", "run_passes"]
