"""Run two graphs with every intermediate tensor exposed and compare them node by node.

A reduced-precision graph that fails validation rarely says why: the error shows at the
outputs, many nodes after its cause. Here both graphs run with every intermediate tensor
exposed, tensors are matched by name (:func:`deploykit.passes.precision.source_name`), and
each node output gets its error against the reference's tensor: what ``deploykit debug
--layerwise`` prints and what :mod:`deploykit.validation.auto_fix` decides from.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import onnxruntime as ort

from deploykit.backends.onnxruntime import loader
from deploykit.validation.compare import Tolerance
from deploykit.passes.precision import LOW_DTYPES, source_name, type_custom_op_outputs

#: Tensors of these types are exposed and compared.
FLOAT_TYPES = (ir.DataType.FLOAT, *LOW_DTYPES)


# --- running with intermediates ---------------------------------------------------------------


def expose_values(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with every float tensor a node writes added to the graph outputs."""
    ir_model = ir.serde.deserialize_model(model)
    common_passes.ShapeInferencePass(strict_mode=False)(ir_model)
    type_custom_op_outputs(ir_model.graph)
    graph = ir_model.graph
    present = {value.name for value in graph.outputs}
    for node in graph:
        for value in node.outputs:
            if value.dtype in FLOAT_TYPES and value.name not in present and "~" not in value.name:
                graph.outputs.append(value)
                present.add(value.name)
    return ir.serde.serialize_model(ir_model)


def run_values(model: onnx.ModelProto, feeds: dict[str, np.ndarray], op_library: Path | None = None,
               optimize: bool = True) -> dict:
    """Every float tensor of one CPU run (inputs and node outputs), by name.

    ``optimize=False`` turns ONNX Runtime's graph rewrites off: the graph's own semantics.
    """
    return values_runner(model, op_library, optimize)(feeds)


def values_runner(model: onnx.ModelProto, op_library: Path | None = None, optimize: bool = True):
    """``run_values`` of ``model`` as a function of the feeds: one session for several feed sets."""
    options = loader.session_options(op_library=op_library, optimize=optimize)
    session = loader.create_session(expose_values(model), options, what="the graph")
    inputs = {i.name: i.type for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]

    def run(feeds: dict[str, np.ndarray]) -> dict:
        arrays = session.run(None, {name: _as_input(array, inputs[name]) for name, array in feeds.items()
                                    if name in inputs})
        return {**{k: v for k, v in feeds.items() if v.dtype.kind == "f"}, **dict(zip(names, arrays))}

    return run


def _as_input(array: np.ndarray, onnx_type: str):
    """fp32 data for an fp16 or bf16 input, converted as a caller would (bf16 via an OrtValue)."""
    if array.dtype.kind != "f" or onnx_type not in ("tensor(float16)", "tensor(bfloat16)"):
        return array
    if onnx_type == "tensor(float16)":
        return array.astype(np.float16)
    bits = array.astype(ml_dtypes.bfloat16).view(np.uint16)
    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, onnx.TensorProto.BFLOAT16)


# --- comparing layer by layer -----------------------------------------------------------------


@dataclasses.dataclass
class LayerDiff:
    """One node output of the candidate against the reference's tensor of the same name."""

    node: str
    op: str
    output: str
    dtype: str
    max_abs: float
    scale: float
    cosine: float
    new_nonfinite: int
    inputs_finite: bool
    diverged: bool

    def error(self) -> dict:
        return {"max_abs": self.max_abs, "max_ref": self.scale, "cosine": self.cosine,
                "new_inf_nan": self.new_nonfinite}

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def compare_layers(graph: ir.Graph, reference: dict, candidate: dict, tolerance: Tolerance) -> list[LayerDiff]:
    """Diffs of each node output of ``graph`` (topological order) present in both runs.

    An output diverges when it has Inf/NaN the reference lacks, or ``max |d| > atol + rtol *
    max |ref|`` (the tolerance scaled by the tensor's magnitude), or its cosine is below
    ``min_cosine``.
    """
    diffs = []
    for node in graph:
        inputs_finite = all(
            np.isfinite(candidate[v.name]).all() for v in node.inputs if v is not None and v.name in candidate
        )
        for value in node.outputs:
            ref, cand = reference.get(source_name(value.name)), candidate.get(value.name)
            if ref is None or cand is None or ref.shape != cand.shape:
                continue
            diffs.append(_diff(node, value, ref, cand, inputs_finite, tolerance))
    return diffs


def _diff(node: ir.Node, value: ir.Value, ref: np.ndarray, cand: np.ndarray, inputs_finite: bool,
          tol: Tolerance) -> LayerDiff:
    ref64, cand64 = ref.astype(np.float64).ravel(), cand.astype(np.float64).ravel()
    finite = np.isfinite(ref64) & np.isfinite(cand64)
    delta = np.abs(ref64[finite] - cand64[finite])
    max_abs, scale = float(delta.max(initial=0.0)), float(np.abs(ref64[finite]).max(initial=0.0))
    cosine = _cosine(ref64[finite], cand64[finite])
    new_nonfinite = int((np.isfinite(ref64) & ~np.isfinite(cand64)).sum())
    atol, rtol = tol.elementwise or (float("inf"), 0.0)
    diverged = new_nonfinite > 0 or max_abs > atol + rtol * scale or cosine < tol.min_cosine
    dtype = str(value.dtype.name).lower() if value.dtype is not None else "?"
    return LayerDiff(node.name, node.op_type, value.name, dtype, max_abs, scale, cosine, new_nonfinite,
                     inputs_finite, diverged)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    if norm == 0.0:
        return 1.0 if not a.any() and not b.any() else 0.0
    return float(np.dot(a, b) / norm)

