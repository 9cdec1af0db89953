"""Fold inference-mode BatchNormalization into a neighbouring weight, where that is exact.

A BatchNormalization computes ``y = x * s + t`` per channel (axis 1), with
``s = gamma / sqrt(var + eps)`` and ``t = beta - mean * s``. Folding rewrites the weight
of the node before it (Conv, ConvTranspose, Gemm, MatMul(+Add) on 2-D input) or after it
(a Conv without padding: every output then sees only BN-transformed inputs, never a padded
zero, so ``W(s x + t) + b = (W s) x + (b + W t)`` holds exactly). Everything else is left alone.

The rules use onnxscript's pattern rewriter, which only matches when the intermediate value
has no other consumer.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRule, RewriteRuleClassBase

from deploykit.passes.base import GraphPass, apply_rules


def constant_array(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None or value.is_graph_input():
        return None
    return value.const_value.numpy()


def batch_norm_affine(bn_out: ir.Value) -> tuple[np.ndarray, np.ndarray] | None:
    """Per-channel ``(s, t)`` in float64, or None if the BN is not a constant inference BN."""
    node = bn_out.producer()
    if len(node.outputs) != 1 or node.attributes.get_int("training_mode", 0):
        return None
    params = [constant_array(v) for v in node.inputs[1:5]]
    if any(p is None for p in params):
        return None
    gamma, beta, mean, var = (p.astype(np.float64) for p in params)
    scale = gamma / np.sqrt(var + node.attributes.get_float("epsilon", 1e-5))
    return scale, beta - mean * scale


def _folded(op, like: np.ndarray, weight: np.ndarray, bias: np.ndarray, prefix: str) -> tuple[ir.Value, ...]:
    """The folded weight and bias as initializers ``<prefix>_weight`` and ``<prefix>_bias``,
    in the dtype of the weight they replace (``like``)."""
    return (op.initializer(ir.tensor(weight.astype(like.dtype)), name=f"{prefix}_weight"),
            op.initializer(ir.tensor(bias.astype(like.dtype)), name=f"{prefix}_bias"))


class _FoldRule(RewriteRuleClassBase):
    """One rule in two variants, with or without the weight's node taking a bias input; the
    shared check: the BN and the neighbouring weight (and bias) are constants."""

    def __init__(self, name: str, with_bias: bool):
        super().__init__(name)
        self.with_bias = with_bias

    def operands(self, x, weight, bias) -> tuple:
        """The inputs of the node holding the weight, in this variant."""
        return (x, weight, bias) if self.with_bias else (x, weight)

    def check(self, context, bn_out, weight, bias=None, **_) -> MatchResult:
        result = MatchResult()
        if batch_norm_affine(bn_out) is None:
            return result.fail("BatchNormalization is not constant and in inference mode")
        if constant_array(weight) is None:
            return result.fail("weight is not a constant")
        if bias is not None and constant_array(bias) is None:
            return result.fail("bias is not a constant")
        return result


class FoldIntoConv(_FoldRule):
    """``BN(Conv(x, W, b))`` -> ``Conv(x, W*s, b*s + t)``; also ConvTranspose."""

    def __init__(self, op_type: str, with_bias: bool):
        super().__init__(f"fold_bn_into_{op_type.lower()}" + ("_bias" * with_bias), with_bias)
        self.op_type = op_type

    def pattern(self, op, x, weight, bias):
        conv = getattr(op, self.op_type)(*self.operands(x, weight, bias), _outputs=["conv_out"])
        return op.BatchNormalization(conv, _allow_other_inputs=True, _outputs=["bn_out"])

    def check(self, context, x, weight, conv_out, bn_out, bias=None) -> MatchResult:
        result = super().check(context, bn_out, weight, bias)
        if result and batch_norm_affine(bn_out)[0].size != self._out_channels(conv_out, weight):
            return result.fail("BatchNormalization does not match the output channels")
        return result

    def _out_channels(self, conv_out, weight) -> int:
        shape = constant_array(weight).shape
        if self.op_type == "Conv":
            return shape[0]
        return shape[1] * conv_out.producer().attributes.get_int("group", 1)

    def _output_channel_view(self, w: np.ndarray, group: int, scale: np.ndarray) -> np.ndarray:
        """``scale`` shaped to broadcast over ``w``'s output-channel positions."""
        if self.op_type == "Conv":
            return scale.reshape(-1, *([1] * (w.ndim - 1)))
        # ConvTranspose weight: (C_in, C_out/group, k...); C_in splits into groups.
        per_group = scale.reshape(group, 1, w.shape[1], *([1] * (w.ndim - 2)))
        return per_group

    def rewrite(self, op, x, weight, conv_out, bn_out, bias=None):
        scale, shift = batch_norm_affine(bn_out)
        conv = conv_out.producer()
        w = constant_array(weight)
        group = conv.attributes.get_int("group", 1)
        factor = self._output_channel_view(w, group, scale)
        if self.op_type == "Conv":
            new_w = w * factor
        else:
            grouped = w.reshape(group, w.shape[0] // group, *w.shape[1:])
            new_w = (grouped * factor).reshape(w.shape)
        b = constant_array(bias) if bias is not None else np.zeros_like(scale)
        new_b = b * scale + shift
        return op.op(self.op_type, x, *_folded(op, w, new_w, new_b, f"{bn_out.name}_folded"), **conv.attributes)


class FoldIntoGemm(_FoldRule):
    """``BN(Gemm(a, B, C))`` -> ``Gemm(a, B*s, beta*C*s + t)`` (scaling B's output columns)."""

    def __init__(self, with_bias: bool):
        super().__init__("fold_bn_into_gemm" + ("_bias" * with_bias), with_bias)

    def pattern(self, op, x, weight, bias):
        gemm = op.Gemm(*self.operands(x, weight, bias), _outputs=["gemm_out"])
        return op.BatchNormalization(gemm, _allow_other_inputs=True, _outputs=["bn_out"])

    def check(self, context, x, weight, gemm_out, bn_out, bias=None) -> MatchResult:
        result = super().check(context, bn_out, weight, bias)
        if result:
            trans_b = gemm_out.producer().attributes.get_int("transB", 0)
            columns = constant_array(weight).shape[0 if trans_b else 1]
            if batch_norm_affine(bn_out)[0].size != columns:
                return result.fail("BatchNormalization does not match Gemm's output width")
        return result

    def rewrite(self, op, x, weight, gemm_out, bn_out, bias=None):
        scale, shift = batch_norm_affine(bn_out)
        gemm = gemm_out.producer()
        w = constant_array(weight)
        trans_b = gemm.attributes.get_int("transB", 0)
        new_w = w * (scale[:, None] if trans_b else scale[None, :])
        beta = gemm.attributes.get_float("beta", 1.0)
        c = constant_array(bias) if bias is not None else np.zeros(1, dtype=w.dtype)
        new_c = beta * c.astype(np.float64) * scale + shift
        attributes = {k: v for k, v in gemm.attributes.items() if k != "beta"}
        return op.Gemm(x, *_folded(op, w, new_w, new_c, f"{bn_out.name}_folded"), **attributes)


class FoldIntoMatMul(_FoldRule):
    """``BN(MatMul(a, W) [+ b])`` with 2-D ``a`` -> ``MatMul(a, W*s) + (b*s + t)``.

    Only for 2-D ``a``: BatchNormalization normalises axis 1, which is MatMul's output
    feature axis only when the output is 2-D (e.g. Linear -> BatchNorm1d).
    """

    def __init__(self, with_bias: bool):
        super().__init__("fold_bn_into_matmul" + ("_add" * with_bias), with_bias)

    def pattern(self, op, x, weight, bias):
        out = op.MatMul(x, weight, _outputs=["matmul_out"])
        if self.with_bias:
            out = op.Add(out, bias)
        return op.BatchNormalization(out, _allow_other_inputs=True, _outputs=["bn_out"])

    def check(self, context, x, weight, matmul_out, bn_out, bias=None) -> MatchResult:
        result = super().check(context, bn_out, weight, bias)
        if not result:
            return result
        if x.shape is None or len(x.shape) != 2:
            return result.fail("MatMul input is not known to be 2-D")
        w = constant_array(weight)
        width = batch_norm_affine(bn_out)[0].size
        if w.ndim != 2 or w.shape[1] != width:
            return result.fail("MatMul weight is not 2-D with BatchNormalization's width")
        if bias is not None and constant_array(bias).size not in (1, width):
            return result.fail("Add's constant does not broadcast over the feature axis only")
        return result

    def rewrite(self, op, x, weight, matmul_out, bn_out, bias=None):
        scale, shift = batch_norm_affine(bn_out)
        w = constant_array(weight)
        b = constant_array(bias).reshape(-1) if bias is not None else np.zeros(1, dtype=w.dtype)
        new_w, new_b = _folded(op, w, w * scale[None, :], b * scale + shift, f"{bn_out.name}_folded")
        return op.Add(op.MatMul(x, new_w), new_b)


class FoldIntoFollowingConv(_FoldRule):
    """``Conv(BN(x), W, b)`` without padding -> ``Conv(x, W*s[c_in], b + sum(W*t[c_in]))``."""

    def __init__(self, with_bias: bool):
        super().__init__("fold_bn_into_next_conv" + ("_bias" * with_bias), with_bias)

    def pattern(self, op, x, weight, bias):
        bn = op.BatchNormalization(x, _allow_other_inputs=True, _outputs=["bn_out"])
        return op.Conv(*self.operands(bn, weight, bias), _outputs=["conv_out"])

    def check(self, context, x, weight, bn_out, conv_out, bias=None) -> MatchResult:
        result = super().check(context, bn_out, weight, bias)
        if not result:
            return result
        conv = conv_out.producer()
        pads = conv.attributes.get_ints("pads", [0])
        auto_pad = conv.attributes.get_string("auto_pad", "NOTSET")
        if any(pads) or auto_pad not in ("NOTSET", "VALID"):
            return result.fail("Conv pads its input: padded zeros would bypass the BatchNorm")
        if constant_array(weight).shape[1] * conv.attributes.get_int("group", 1) != batch_norm_affine(bn_out)[0].size:
            return result.fail("BatchNormalization does not match Conv's input channels")
        return result

    def rewrite(self, op, x, weight, bn_out, conv_out, bias=None):
        scale, shift = batch_norm_affine(bn_out)
        conv = conv_out.producer()
        w = constant_array(weight)
        group = conv.attributes.get_int("group", 1)
        out_per_group, in_per_group = w.shape[0] // group, w.shape[1]
        # Input channel of w[o, i] is (o // out_per_group) * in_per_group + i.
        channel = (np.arange(w.shape[0])[:, None] // out_per_group) * in_per_group + np.arange(in_per_group)
        spatial = (1,) * (w.ndim - 2)
        new_w = w * scale[channel].reshape(*channel.shape, *spatial)
        b = constant_array(bias) if bias is not None else np.zeros(w.shape[0], dtype=w.dtype)
        new_b = b + (w * shift[channel].reshape(*channel.shape, *spatial)).sum(axis=tuple(range(1, w.ndim)))
        return op.Conv(x, *_folded(op, w, new_w, new_b, f"{conv_out.name}_bnfolded"), **conv.attributes)


def _rules() -> list[RewriteRule]:
    rules: list[RewriteRule] = []
    for with_bias in (True, False):
        rules += [
            FoldIntoConv.rule("Conv", with_bias),
            FoldIntoConv.rule("ConvTranspose", with_bias),
            FoldIntoGemm.rule(with_bias),
            FoldIntoMatMul.rule(with_bias),
            FoldIntoFollowingConv.rule(with_bias),
        ]
    return rules


class FoldBatchNorm(GraphPass):
    """Sweep the folding rules over the model until a sweep changes nothing; count folds per rule.

    Repeating matters for chains such as BN -> Conv -> BN, where folding one side
    exposes the other.
    """

    name = "fold_batch_norm"

    def rewrite(self, model: ir.Model) -> dict[str, int]:
        rules = _rules()
        changes: collections.Counter[str] = collections.Counter()
        while sweep := apply_rules(model, rules, commute=True):
            changes.update(sweep)
        return dict(changes)
