"""Graph passes over the exported ONNX model, in the order they run.

Each pass mutates an ``onnx_ir.Model`` in place and returns a :class:`PassStats`; the
model is converted from and back to a ``ModelProto`` once, around the whole list.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from deploykit.passes.base import PassStats, op_histogram
from deploykit.passes.cleanup import fold_constants, remove_dead_code
from deploykit.passes.fold_bn import fold_batch_norm
from deploykit.passes.fuse_batch_norm import fuse_batch_norm
from deploykit.passes.fuse_matmul_relu import fuse_matmul_relu

#: Constant folding first exposes constant weights; fusions take what folding left.
STANDARD_PASSES = (fold_constants, fold_batch_norm, remove_dead_code)
CUSTOM_OP_PASSES = (fold_constants, fold_batch_norm, fuse_batch_norm, fuse_matmul_relu, remove_dead_code)


def run_passes(model: onnx.ModelProto, custom_ops: bool = True) -> tuple[onnx.ModelProto, list[PassStats]]:
    ir_model = ir.serde.deserialize_model(model)
    # Folding into MatMul needs input ranks: infer shapes the exporter did not record.
    common_passes.ShapeInferencePass()(ir_model)
    stats = [run(ir_model) for run in (CUSTOM_OP_PASSES if custom_ops else STANDARD_PASSES)]
    return ir.serde.serialize_model(ir_model), stats


__all__ = ["CUSTOM_OP_PASSES", "STANDARD_PASSES", "PassStats", "op_histogram", "run_passes"]
