"""ONNX Runtime's transformer fusions (onnxscript's ``ort_fusions``): attention, skip layer
normalisation, Gelu forms, rotary embeddings and RMS normalisation become ``com.microsoft`` ops.

Those contrib ops exist only in ONNX Runtime: TensorRT and other ONNX runtimes cannot parse
them, so convert builds the TensorRT engine from a graph without this pass (docs/passes.md).
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
from onnxscript.rewriter.ort_fusions._core import fuse_xformers

from deploykit.passes.base import GraphPass

#: ONNX Runtime's contrib-op domain, where every fused op lives.
CONTRIB_DOMAIN = "com.microsoft"


class OrtFusions(GraphPass):
    """onnxscript's transformer fusions, without the rest of ``optimize_for_ort``.

    ``optimize_for_ort`` also writes GroupNorm (no CPU kernel in ONNX Runtime, so the CPU
    validation could not run it) and FusedMatMul (fp32-only on the CPU); the transformer
    fusions alone are what buys time on transformers. Runs before deploykit's own fusions:
    onnxscript's optimizer inlines model functions, which would undo our ops' fallbacks.
    """

    name = "ort_fusions"
    emits_contrib_ops = True
    hides_quantizable_ops = True  # Attention holds the projections' MatMuls

    def rewrite(self, model: ir.Model) -> dict[str, int]:
        _, counts = fuse_xformers(model)
        return {rule: count for rule, count in counts.items() if count}


#: Written by the RMS normalisation fusion in ONNX's domain, but an op of ONNX Runtime's alone.
ORT_DEFAULT_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization"})


def ort_only_ops(model: onnx.ModelProto) -> list[str]:
    """The ops of ``model`` that only ONNX Runtime runs (``com.microsoft::Attention`` ...), sorted."""
    return sorted({f"{node.domain}::{node.op_type}" if node.domain else node.op_type for node in model.graph.node
                   if node.domain == CONTRIB_DOMAIN
                   or (node.domain in ("", "ai.onnx") and node.op_type in ORT_DEFAULT_DOMAIN_OPS)})
