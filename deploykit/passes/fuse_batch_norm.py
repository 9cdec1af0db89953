"""Replace the BatchNorms no weight could absorb by deploykit::FusedBatchNorm.

Runs after ``fold_batch_norm``: what is left follows an Add, a Concat or a pooling
(DenseNet, pre-activation ResNets). ``Relu(BN(x))`` becomes one node with
``activation="relu"``, so the whole pattern is one read and one write of the tensor.

A model holds one FusedBatchNorm function, so all its FusedBatchNorm nodes share one
activation: TensorRT's parser looks functions up by name alone (it ignores ONNX function
overloads), so a second body for the other activation would be inlined wrongly. When a
model has both kinds, the BatchNorms without a Relu stay standard BatchNormalization.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase

from deploykit import ops
from deploykit.ops import fused_batch_norm
from deploykit.passes.base import GraphPass, apply_rules
from deploykit.passes.fold_bn import batch_norm_affine, constant_array


class _FuseBatchNorm(RewriteRuleClassBase):
    def __init__(self, activation: str):
        super().__init__(f"fused_batch_norm_{activation}")
        self.activation = activation

    def pattern(self, op, x):
        bn = op.BatchNormalization(x, _allow_other_inputs=True, _outputs=["bn_out"])
        return op.Relu(bn) if self.activation == "relu" else bn

    def check(self, context, x, bn_out) -> MatchResult:
        result = MatchResult()
        if batch_norm_affine(bn_out) is None:
            return result.fail("BatchNormalization is not constant and in inference mode")
        return result

    def rewrite(self, op, x, bn_out):
        scale, shift = batch_norm_affine(bn_out)
        dtype = constant_array(bn_out.producer().inputs[1]).dtype
        fused = op.op(
            fused_batch_norm.OP_TYPE, x,
            op.initializer(ir.tensor(scale.astype(dtype)), name=f"{bn_out.name}_fused_scale"),
            op.initializer(ir.tensor(shift.astype(dtype)), name=f"{bn_out.name}_fused_bias"),
            _domain=ops.DOMAIN, activation=self.activation,
        )
        return fused


class FuseBatchNorm(GraphPass):
    """BatchNorm (with its Relu, where one follows) -> FusedBatchNorm, one activation per model."""

    name = "fuse_batch_norm"
    emits_custom_ops = True

    def rewrite(self, model: ir.Model) -> dict[str, int]:
        for activation in ("relu", "none"):  # relu first: a lone BN must not take its Relu's match
            if changes := apply_rules(model, [_FuseBatchNorm.rule(activation)]):
                function = fused_batch_norm.function(activation, model.opset_imports.get("", 18))
                ops.ensure_function(model, function)
                return changes  # one activation per model; see the module docstring
        return {}
