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
from deploykit.passes.ort_fusions import OrtFusions

#: Constant folding first exposes constant weights; fusions take what folding left.
PASSES: tuple[GraphPass, ...] = (FoldConstants(), FoldBatchNorm(), OrtFusions(), FuseBatchNorm(),
                                 FuseMatMulRelu(), RemoveDeadCode())


def run_passes(model: onnx.ModelProto, custom_ops: bool = True, ort_fusions: bool = True,
               quantizable: bool = False) -> tuple[onnx.ModelProto, list[PassStats]]:
    """Run :data:`PASSES`, without those writing deploykit's ops unless ``custom_ops``, without
    those writing ONNX Runtime's contrib ops unless ``ort_fusions``, and, for a graph to be
    quantized (``quantizable``), without those that hide a matrix product inside an op int8
    quantization leaves float."""
    ir_model = ir.serde.deserialize_model(model)
    # Folding into MatMul needs input ranks: infer shapes the exporter did not record.
    common_passes.ShapeInferencePass()(ir_model)
    chosen = [graph_pass for graph_pass in PASSES
              if (custom_ops or not graph_pass.emits_custom_ops) and (ort_fusions or not graph_pass.emits_contrib_ops)
              and not (quantizable and graph_pass.hides_quantizable_ops)]
    stats = [graph_pass(ir_model).stats for graph_pass in chosen]
    return ir.serde.serialize_model(ir_model), stats


__all__ = ["PASSES", "GraphPass", "PassStats", "op_histogram", "run_passes"]
