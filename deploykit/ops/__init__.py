"""deploykit's custom ops (domain ``deploykit``, version 1): specs live in docs/ops.md.

Each op module gives the ONNX local function that expresses the op in standard ONNX (so a
model runs on any runtime without our libraries) and a numpy reference.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

DOMAIN = "deploykit"
VERSION = 1


def function_from_proto(proto: onnx.FunctionProto) -> ir.Function:
    return ir.serde.deserialize_function(proto)


def ensure_function(model: ir.Model, function: ir.Function) -> None:
    """Attach ``function`` (once) and import our domain, so custom nodes resolve anywhere."""
    model.functions.setdefault(function.identifier(), function)
    model.opset_imports[DOMAIN] = VERSION
    model.graph.opset_imports[DOMAIN] = VERSION


def custom_op_types(model: onnx.ModelProto) -> list[str]:
    """Our op types a model uses, sorted: what a runtime needs our library (or functions) for."""
    return sorted({node.op_type for node in model.graph.node if node.domain == DOMAIN})
