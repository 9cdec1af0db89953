"""MatMulRelu(A, B, bias): ``relu(A @ B + bias)`` with a constant B of shape (K, N).

deploykit's passes always give the bias (zeros when the pattern had none): the function
body then has one form, and the kernels' ReLU+bias epilogue costs the same as ReLU alone.
"""

from __future__ import annotations

from onnx import helper

from deploykit.ops import DOMAIN, function_from_proto

OP_TYPE = "MatMulRelu"


def function(opset: int):
    nodes = [
        helper.make_node("MatMul", ["A", "B"], ["product"]),
        helper.make_node("Add", ["product", "bias"], ["shifted"]),
        helper.make_node("Relu", ["shifted"], ["Y"]),
    ]
    proto = helper.make_function(DOMAIN, OP_TYPE, ["A", "B", "bias"], ["Y"], nodes, [helper.make_opsetid("", opset)])
    return function_from_proto(proto)
