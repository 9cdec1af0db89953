"""FusedBatchNorm(X, scale, bias; activation): ``act(X * scale[c] + bias[c])`` on channel axis 1.

The activation selects the function body; a model carries the body of the one
activation its FusedBatchNorm nodes use (see deploykit/passes/fuse_batch_norm.py).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from deploykit.ops import DOMAIN, function_from_proto

OP_TYPE = "FusedBatchNorm"
ACTIVATIONS = ("none", "relu")


def _constant(name: str, values) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64)))


def function(activation: str, opset: int):
    """Standard-ONNX body for any input rank >= 2: scale/bias reshaped to (-1, 1, ..., 1)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, not {activation!r}")
    affine_out = "Y" if activation == "none" else "affine"
    nodes = [
        helper.make_node("Shape", ["X"], ["x_shape"]),
        helper.make_node("Size", ["x_shape"], ["rank"]),
        _constant("two", 2),
        helper.make_node("Sub", ["rank", "two"], ["trailing"]),
        _constant("one_dim", [1]),
        helper.make_node("Reshape", ["trailing", "one_dim"], ["trailing_1d"]),
        helper.make_node("ConstantOfShape", ["trailing_1d"], ["ones"],
                         value=numpy_helper.from_array(np.array([1], np.int64))),
        _constant("minus_one", [-1]),
        helper.make_node("Concat", ["minus_one", "ones"], ["channel_shape"], axis=0),
        helper.make_node("Reshape", ["scale", "channel_shape"], ["scale_b"]),
        helper.make_node("Reshape", ["bias", "channel_shape"], ["bias_b"]),
        helper.make_node("Mul", ["X", "scale_b"], ["scaled"]),
        helper.make_node("Add", ["scaled", "bias_b"], [affine_out]),
    ]
    if activation == "relu":
        nodes.append(helper.make_node("Relu", ["affine"], ["Y"]))
    proto = helper.make_function(
        DOMAIN, OP_TYPE, ["X", "scale", "bias"], ["Y"], nodes,
        [helper.make_opsetid("", opset)], attributes=["activation"],
    )
    return function_from_proto(proto)
