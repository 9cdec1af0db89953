"""Estimated multiply-adds of a node: the cost of keeping it in fp32.

Auto-fix orders the node groups it may pin by this, and its trade-off reports the fp32 share of
it: a proxy for the speed given up, not a latency measurement.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from deploykit.passes.precision import source_name

#: Multiply-adds per output element are counted for these ops; others count one per element.
MATRIX_OPS = {"Conv", "ConvTranspose", "MatMul", "Gemm", "MatMulRelu"}


def is_matrix(node: ir.Node) -> bool:
    """A node whose work grows with a reduction length (a matrix product or convolution)."""
    return node.op_type in MATRIX_OPS


def multiply_adds(node: ir.Node, shapes: dict[str, tuple]) -> int:
    """Multiply-adds of ``node``; ``shapes`` are the fp32 graph's tensor shapes in one run."""
    out = shapes.get(source_name(node.outputs[0].name))
    if out is None:
        return 0
    elements = math.prod(out)
    if not is_matrix(node) or len(node.inputs) < 2 or node.inputs[1] is None:
        return elements
    first, weight = _shape(node.inputs[0], shapes), _shape(node.inputs[1], shapes)
    if node.op_type == "Conv" and weight:
        return elements * math.prod(weight[1:])
    if node.op_type == "ConvTranspose" and first and weight:
        return math.prod(first) * math.prod(weight[1:])
    if first:
        trans_a = node.attributes.get("transA")
        return elements * (first[0] if trans_a is not None and trans_a.as_int() else first[-1])
    return elements


def _shape(value: ir.Value, shapes: dict[str, tuple]) -> tuple[int, ...] | None:
    if value.const_value is not None:
        return tuple(value.const_value.shape.numpy())
    return shapes.get(source_name(value.name))
