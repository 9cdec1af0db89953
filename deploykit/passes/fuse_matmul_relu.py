"""Replace ``Relu(MatMul(A, B) [+ b])`` and ``Relu(Gemm(A, B, C))`` by deploykit::MatMulRelu.

B must be a constant matrix (a Linear layer's weight) and the bias must vary along the
last axis only, which is what the kernels' ReLU+bias epilogue computes. Gemm's
``alpha``, ``beta`` and ``transB`` are folded into the constants.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase

from deploykit import ops
from deploykit.ops import matmul_relu
from deploykit.passes.base import GraphPass, apply_rules
from deploykit.passes.fold_bn import constant_array


def _row_bias(bias: np.ndarray | None, width: int, rank: int) -> np.ndarray | None:
    """``bias`` as shape (width,) if it adds the same row to every output row, else None."""
    if bias is None:
        return np.zeros(width)
    if bias.ndim > rank or any(d != 1 for d in bias.shape[:-1]) or bias.size not in (1, width):
        return None
    return np.broadcast_to(bias.reshape(-1), (width,))


def _emit(op, a, weight: np.ndarray, bias: np.ndarray, name: str):
    return op.op(
        matmul_relu.OP_TYPE, a,
        op.initializer(ir.tensor(np.ascontiguousarray(weight)), name=f"{name}_weight"),
        op.initializer(ir.tensor(bias.astype(weight.dtype)), name=f"{name}_bias"),
        _domain=ops.DOMAIN,
    )


class _FuseMatMulRelu(RewriteRuleClassBase):
    def __init__(self, with_bias: bool):
        super().__init__("matmul_add_relu" if with_bias else "matmul_relu")
        self.with_bias = with_bias

    def pattern(self, op, a, weight, bias):
        out = op.MatMul(a, weight, _outputs=["product"])
        return op.Relu(op.Add(out, bias) if self.with_bias else out, _outputs=["relu_out"])

    def check(self, context, a, weight, product, relu_out, bias=None) -> MatchResult:
        result = MatchResult()
        w = constant_array(weight)
        if w is None or w.ndim != 2:
            return result.fail("B is not a constant matrix")
        if a.shape is None or len(a.shape) < 2:
            return result.fail("A is not known to have rank >= 2")
        b = constant_array(bias) if bias is not None else None
        if bias is not None and (b is None or _row_bias(b, w.shape[1], len(a.shape)) is None):
            return result.fail("the added term is not a constant per-column bias")
        return result

    def rewrite(self, op, a, weight, product, relu_out, bias=None):
        w = constant_array(weight)
        b = _row_bias(constant_array(bias) if bias is not None else None, w.shape[1], len(a.shape))
        return _emit(op, a, w, b, relu_out.name)


class _FuseGemmRelu(RewriteRuleClassBase):
    def __init__(self, with_bias: bool):
        super().__init__("gemm_bias_relu" if with_bias else "gemm_relu")
        self.with_bias = with_bias

    def pattern(self, op, a, weight, bias):
        inputs = (a, weight, bias) if self.with_bias else (a, weight)
        return op.Relu(op.Gemm(*inputs, _outputs=["gemm_out"]), _outputs=["relu_out"])

    def check(self, context, a, weight, gemm_out, relu_out, bias=None) -> MatchResult:
        result = MatchResult()
        gemm = gemm_out.producer()
        w = constant_array(weight)
        if w is None or gemm.attributes.get_int("transA", 0):
            return result.fail("B is not constant, or A is transposed")
        width = w.shape[0] if gemm.attributes.get_int("transB", 0) else w.shape[1]
        b = constant_array(bias) if bias is not None else None
        if bias is not None and (b is None or _row_bias(b, width, 2) is None):
            return result.fail("C is not a constant per-column bias")
        return result

    def rewrite(self, op, a, weight, gemm_out, relu_out, bias=None):
        gemm = gemm_out.producer()
        w = constant_array(weight)
        w = (w.T if gemm.attributes.get_int("transB", 0) else w) * gemm.attributes.get_float("alpha", 1.0)
        b = _row_bias(constant_array(bias) if bias is not None else None, w.shape[1], 2)
        return _emit(op, a, w.astype(constant_array(weight).dtype), b * gemm.attributes.get_float("beta", 1.0), relu_out.name)


class FuseMatMulRelu(GraphPass):
    """``Relu(MatMul [+ bias])`` and ``Relu(Gemm)`` with a constant weight -> MatMulRelu."""

    name = "fuse_matmul_relu"
    emits_custom_ops = True
    hides_quantizable_ops = True

    def rewrite(self, model: ir.Model) -> dict[str, int]:
        rules = [_FuseGemmRelu.rule(True), _FuseGemmRelu.rule(False), _FuseMatMulRelu.rule(True),
                 _FuseMatMulRelu.rule(False)]
        changes = apply_rules(model, rules, commute=True)
        if changes:
            ops.ensure_function(model, matmul_relu.function(model.opset_imports.get("", 18)))
        return changes
