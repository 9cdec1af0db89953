"""Write a reduced precision (fp16 or bf16) into the graph, for strongly typed runtimes.

TensorRT 11 and TensorRT-RTX take each layer's precision from the ONNX types, so this pass
decides the precision node by node and makes it explicit:

* weights and activations in the requested type, except numerically sensitive nodes
  (:func:`policy`: normalisations, Softmax, exp/log/pow, long sums and means) and nodes whose
  fp32 run (``ranges``) shows values beyond the type's safe range, which stay fp32;
* cheap nodes (data movement, elementwise) go to whichever side of a boundary needs fewer
  casts, so Casts sit only where an fp32 island meets the reduced type: one Cast per value
  and type, never Cast -> Cast;
* graph inputs and outputs keep their declared types unless ``io_precision`` names one.

A value derived from ``v`` (a Cast, a converted weight copy) is named ``v__fp16``,
``v__bf16`` or ``v__fp32``; :func:`source_name` maps it back, so layer-wise comparison
matches every tensor of the typed graph with the fp32 graph's. :func:`emulate` gives the
typed graph's numerics in fp32 arithmetic (see docs/precision.md for why the CPU needs it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnx import version_converter

from deploykit import ops
from deploykit.errors import BadInputError
from deploykit.passes.base import GraphPass, PassStats
from deploykit.passes.ort_fusions import CONTRIB_DOMAIN

FLOAT = ir.DataType.FLOAT
LOW_TYPES = {"fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}
#: The reduced-precision tensor types: a tensor of one of these is fp16 or bf16.
LOW_DTYPES = tuple(LOW_TYPES.values())
_SUFFIX = {FLOAT: "__fp32", ir.DataType.FLOAT16: "__fp16", ir.DataType.BFLOAT16: "__bf16"}
#: Largest magnitude a calibration run may show in a reduced-precision tensor: a quarter of
#: the type's maximum, as headroom for deployment data larger than the calibration inputs.
SAFE_MAX = {"fp16": 65504.0 / 4, "bf16": float(ml_dtypes.finfo(ml_dtypes.bfloat16).max) / 4}
#: A sum or mean over at least this many elements (or an unknown count) stays fp32.
MANY_ELEMENTS = 256
#: Conv, pooling and others accept bfloat16 from opset 22 on.
BF16_OPSET = 22

_NORMALISATIONS = {"LayerNormalization", "BatchNormalization", "InstanceNormalization",
                   "GroupNormalization", "RMSNormalization", "LpNormalization", "MeanVarianceNormalization"}
_ALWAYS_FP32 = {
    **dict.fromkeys(_NORMALISATIONS, "normalisation"),
    **dict.fromkeys(("Softmax", "LogSoftmax"), "softmax"),
    **dict.fromkeys(("Exp", "Log", "Pow", "Sqrt", "Reciprocal", "Softplus"), "exp/log/pow"),
    **dict.fromkeys(("ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp",
                     "ReduceProd", "CumSum"), "reduction sensitive to rounding"),
}
_COUNTED_REDUCTIONS = {"ReduceSum", "ReduceMean", "GlobalAveragePool"}
#: Exact in any float type, or elementwise and cheap: these follow their neighbours.
_FLEXIBLE = {"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Concat", "Slice", "Gather",
             "GatherElements", "GatherND", "Split", "Identity", "Expand", "Tile", "Pad", "DepthToSpace",
             "SpaceToDepth", "Relu", "LeakyRelu", "Neg", "Abs", "Max", "Min", "Clip", "Where", "MaxPool",
             "Add", "Sub", "Mul", "Div", "Sign", "Floor", "Ceil", "Round", "Cast", "ConstantOfShape",
             "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"}
#: Ops that read only their input's shape: any type will do, no Cast needed.
_SHAPE_ONLY = {"Shape", "Size"}
#: Float inputs that are parameters of a fixed type, not data (Resize's roi and scales).
_FIXED_TYPE_INPUTS = {"Resize": {1, 2}, "Upsample": {1}}
#: Reduced types our kernels and plugins implement (docs/ops.md).
_CUSTOM_OP_TYPES = {"FusedBatchNorm": {"fp16"}, "MatMulRelu": {"fp16", "bf16"}}
#: ONNX Runtime's contrib ops that the ort_fusions pass writes, and the reduced types deploykit lets
#: them run in: those ONNX Runtime's CUDA provider has kernels for (docs/precision.md).
_CONTRIB_OP_TYPES = {
    **dict.fromkeys(("SkipLayerNormalization", "SkipSimplifiedLayerNormalization"), {"fp16", "bf16"}),
    **dict.fromkeys(("Attention", "MultiHeadAttention", "GroupQueryAttention", "RotaryEmbedding",
                     "BiasGelu", "FastGelu", "Gelu"), {"fp16"}),
}
#: Normalisations and attention whose ONNX Runtime kernels read and write the reduced type but
#: compute mean, variance and softmax sums in fp32: for ONNX Runtime they need no fp32 pin.
ORT_FP32_INSIDE = frozenset({"LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
                             "SkipSimplifiedLayerNormalization", "Attention", "MultiHeadAttention",
                             "GroupQueryAttention"})
#: Additive attention masks of ONNX Runtime's attention ops (input index): -3.4e38 there means "masked".
#: Clipped to the reduced type's largest finite magnitude they mask the same (softmax gives the
#: position 0), so a mask never keeps the attention in fp32.
_SATURATING_INPUTS = {"Attention": {5}, "MultiHeadAttention": {5}}
#: Which runtime a typed graph is planned for: ONNX Runtime's kernels or TensorRT's layers.
TARGETS = ("onnxruntime", "tensorrt")
#: ONNX's name of each reduced type, as schemas and kernel registries spell it.
ONNX_TYPE_NAMES = {"fp16": "tensor(float16)", "bf16": "tensor(bfloat16)"}


@dataclasses.dataclass(frozen=True)
class NodePrecision:
    """A node's precision (fp16/bf16/fp32 here; int8/float in conversion/quantize.py) and, where it
    stayed at full precision, why."""

    node: str
    op: str
    precision: str
    reason: str | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PrecisionResult:
    model: onnx.ModelProto
    stats: PassStats
    nodes: list[NodePrecision]

    def fp32_nodes(self) -> list[NodePrecision]:
        return [n for n in self.nodes if n.precision == "fp32"]


def check_precision(precision: str, io_precision: str | None, auto_fix: bool = False) -> None:
    if precision not in ("fp32", *LOW_TYPES):
        raise BadInputError(f"--precision {precision!r}: use fp32, fp16 or bf16")
    if io_precision not in (None, "fp32", *LOW_TYPES):
        raise BadInputError(f"--io-precision {io_precision!r}: use fp32, fp16 or bf16")
    if precision == "fp32" and (io_precision or auto_fix):
        raise BadInputError("--io-precision and --auto-fix apply to reduced precision: add --precision fp16 or bf16")


def is_low(value: ir.Value | None) -> bool:
    """An fp16 or bf16 tensor."""
    return value is not None and value.dtype in LOW_DTYPES


def source_name(name: str) -> str:
    """The fp32 graph's name for a value of the typed graph (strips ``__fp16`` and the like)."""
    for suffix in _SUFFIX.values():
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def name_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose nodes all have unique names: reports and pins refer to nodes by name."""
    named = onnx.ModelProto()
    named.CopyFrom(model)
    taken = {node.name for node in named.graph.node}
    seen: set[str] = set()
    for index, node in enumerate(named.graph.node):
        if not node.name or node.name in seen:
            name = f"{node.op_type}_{index}"
            while name in taken:
                name += "_"
            node.name = name
            taken.add(name)
        seen.add(node.name)
    return named


def apply_precision(
    model: onnx.ModelProto,
    precision: str,
    io_precision: str | None = None,
    keep_fp32: Mapping[str, str] | None = None,
    ranges: dict[str, float] | None = None,
    target: str = "onnxruntime",
) -> PrecisionResult:
    """The typed graph of ``model`` (left unchanged), planned for ``target``'s kernels.

    ``keep_fp32`` pins nodes to fp32 (node name -> why); ``ranges`` holds the largest
    magnitude of each tensor in an fp32 calibration run.
    """
    check_precision(precision, io_precision)
    ir_model = ir.serde.deserialize_model(_with_opset_for(model, precision))
    typing = _TypeGraph(precision, io_precision, keep_fp32 or {}, ranges or {}, target)
    stats = typing(ir_model).stats
    return PrecisionResult(ir.serde.serialize_model(ir_model), stats, typing.summary)


class _TypeGraph(GraphPass):
    """The pass itself: plans every node's precision, writes the types and the boundary Casts."""

    def __init__(self, precision: str, io_precision: str | None, keep_fp32: Mapping[str, str],
                 ranges: dict[str, float], target: str):
        self.name, self.precision, self.target = f"precision_{precision}", precision, target
        self.io_type = None if io_precision is None else {"fp32": FLOAT, **LOW_TYPES}[io_precision]
        self.keep_fp32, self.ranges = dict(keep_fp32), ranges
        self.summary: list[NodePrecision] = []

    def rewrite(self, model: ir.Model) -> dict[str, int]:
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
        common_passes.ShapeInferencePass(strict_mode=False)(model)
        type_custom_op_outputs(model.graph)
        planner = _Planner(model, self.precision, self.io_type, self.keep_fp32, self.ranges, self.target)
        low = planner.plan()
        self.summary = planner.summary()
        writer = _Writer(model.graph, LOW_TYPES[self.precision], self.io_type)
        writer.write(low)
        common_passes.RemoveUnusedNodesPass()(model)
        return {f"nodes_{self.precision}": sum(low.values()), "nodes_fp32": len(low) - sum(low.values()),
                "casts": writer.cast_count}


def _with_opset_for(model: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """bf16 needs opset 22; the converter drops local functions, so ours are re-attached."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), BF16_OPSET)
    if precision != "bf16" or opset >= BF16_OPSET:
        return model
    converted = version_converter.convert_version(model, BF16_OPSET)
    for function in model.functions:
        copy = converted.functions.add()
        copy.CopyFrom(function)
        for entry in copy.opset_import:
            if entry.domain in ("", "ai.onnx"):
                entry.version = BF16_OPSET
    return converted


def type_custom_op_outputs(graph: ir.Graph) -> None:
    """Our ops return their first input's type; ONNX shape inference does not know them."""
    for node in graph:
        if node.domain == ops.DOMAIN and node.inputs and node.inputs[0] is not None:
            for value in node.outputs:
                if value.dtype is None:
                    value.dtype = node.inputs[0].dtype


# --- deciding ---------------------------------------------------------------------------------


def policy(node: ir.Node, precision: str, opset: int, target: str = "onnxruntime") -> str | None:
    """Why ``node`` must compute in fp32 on ``target`` whatever its values, or None."""
    if node.domain == ops.DOMAIN:
        supported = _CUSTOM_OP_TYPES.get(node.op_type, set())
        return None if precision in supported else f"deploykit::{node.op_type} has no {precision} kernel"
    if node.domain == CONTRIB_DOMAIN:
        supported = _CONTRIB_OP_TYPES.get(node.op_type, set())
        return None if precision in supported else f"{CONTRIB_DOMAIN}::{node.op_type}: no {precision} kernel known"
    if target == "onnxruntime" and node.op_type in ORT_FP32_INSIDE:
        return None
    if node.domain not in ("", "ai.onnx"):
        return f"op of domain {node.domain}: numerics unknown"
    if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
        return "control flow (subgraphs keep their types)"
    if "dtype" in node.attributes:
        return "op with a dtype attribute"
    if node.op_type in _ALWAYS_FP32:
        return _ALWAYS_FP32[node.op_type]
    if node.op_type in _COUNTED_REDUCTIONS:
        count = _reduced_elements(node)
        if count is None or count >= MANY_ELEMENTS:
            return f"sum/mean over {count or 'an unknown number of'} elements"
    return _schema_reason(node, precision, opset)


def _schema_reason(node: ir.Node, precision: str, opset: int) -> str | None:
    """Why ONNX's schema of the node does not allow the reduced type, or None."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return None
    wanted = ONNX_TYPE_NAMES[precision]
    for constraint in schema.type_constraints:
        allowed = set(constraint.allowed_type_strs)
        if "tensor(float)" in allowed and wanted not in allowed:
            return f"ONNX {node.op_type}-{schema.since_version} has no {precision} type"
    return None


def _reduced_elements(node: ir.Node) -> int | None:
    """How many elements feed one output element, when the shapes tell."""
    data = node.inputs[0] if node.inputs else None
    if data is None or data.shape is None:
        return None
    dims = list(data.shape)
    global_pool = node.op_type == "GlobalAveragePool"
    axes = list(range(2, len(dims))) if global_pool else _reduce_axes(node, len(dims))
    if axes is None or not all(isinstance(dims[a], int) for a in axes):
        return None
    return math.prod(dims[a] for a in axes)


def _reduce_axes(node: ir.Node, rank: int) -> list[int] | None:
    axes_input = node.inputs[1] if len(node.inputs) > 1 else None
    if axes_input is not None:
        if axes_input.const_value is None:
            return None
        axes = [int(a) for a in axes_input.const_value.numpy().ravel()]
    else:
        axes = list(node.attributes["axes"].as_ints()) if "axes" in node.attributes else []
    if not axes:
        noop = node.attributes.get("noop_with_empty_axes")
        return [] if noop is not None and noop.as_int() else list(range(rank))
    return [a % rank for a in axes]


def _weight_ranges(graph: ir.Graph) -> dict[str, float]:
    """Largest magnitude of each float weight: one beyond the reduced range keeps its readers fp32."""
    return {
        name: float(np.abs(value.const_value.numpy()).max(initial=0.0))
        for name, value in graph.initializers.items()
        if _is_float(value) and value.const_value is not None
    }


def _is_float(value: ir.Value | None) -> bool:
    return value is not None and value.dtype == FLOAT


def _data_inputs(node: ir.Node) -> list[tuple[int, ir.Value]]:
    """(index, value) of the float inputs whose type follows the node's precision."""
    if node.op_type in _SHAPE_ONLY:
        return []
    fixed = _FIXED_TYPE_INPUTS.get(node.op_type, set()) if node.domain in ("", "ai.onnx") else set()
    return [(i, v) for i, v in enumerate(node.inputs) if i not in fixed and _is_float(v)]


def _saturating(node: ir.Node) -> set[int]:
    """Inputs of ``node`` whose values may be clipped to the reduced type's range (attention masks)."""
    return _SATURATING_INPUTS.get(node.op_type, set()) if node.domain == CONTRIB_DOMAIN else set()


def _takes_part(node: ir.Node) -> bool:
    return bool(_data_inputs(node)) or any(_is_float(v) for v in node.outputs)


class _Planner:
    """Chooses fp32 or the reduced type for every node that handles float tensors."""

    def __init__(self, model: ir.Model, precision: str, io_type, keep_fp32: dict[str, str], ranges: dict,
                 target: str):
        self.precision, self.ranges = precision, {**_weight_ranges(model.graph), **ranges}
        self.io_low = io_type is not None and io_type != FLOAT
        self.safe = SAFE_MAX[precision]
        opset = model.opset_imports.get("", BF16_OPSET)
        self.nodes = [node for node in model.graph if _takes_part(node)]
        self.low: dict[ir.Node, bool] = {}
        self.reasons: dict[ir.Node, str] = {}
        for node in self.nodes:
            reason = keep_fp32.get(node.name) or policy(node, precision, opset, target)
            self._set(node, reason or self._range_reason(node))
        self._keep_large_values_out()

    def _set(self, node: ir.Node, reason: str | None) -> None:
        self.low[node] = reason is None
        if reason is not None:
            self.reasons[node] = reason

    def _flexible(self, node: ir.Node) -> bool:
        return node not in self.reasons and node.domain in ("", "ai.onnx") and node.op_type in _FLEXIBLE

    def _range_reason(self, node: ir.Node) -> str | None:
        largest = max((self.ranges.get(v.name, 0.0) for v in node.outputs if _is_float(v)), default=0.0)
        if largest > self.safe:
            return (f"values up to {largest:.3g} in the fp32 calibration run "
                    f"(safe {self.precision} limit {self.safe:g})")
        return None

    def _keep_large_values_out(self) -> None:
        """A value too large for the reduced type is never cast to it: its readers stay fp32."""
        for node in self.nodes:
            large = [v.name for i, v in _data_inputs(node)
                     if i not in _saturating(node) and self.ranges.get(v.name, 0.0) > self.safe]
            if large and self.low[node]:
                size = self.ranges[large[0]]
                self._set(node, f"reads {large[0]} (values up to {size:.3g}), "
                                f"beyond the safe {self.precision} range")

    def plan(self) -> dict[ir.Node, bool]:
        """Flexible nodes take the side of a boundary that needs fewer casts (fp32 on ties)."""
        flexible = [node for node in self.nodes if self._flexible(node)]
        for _ in range(len(flexible) + 2):
            changed = False
            for node in (*flexible, *reversed(flexible)):
                want_low = self._casts_needed(node, True) < self._casts_needed(node, False)
                changed |= want_low != self.low[node]
                self.low[node] = want_low
            if not changed:
                break
        return self.low

    def summary(self) -> list[NodePrecision]:
        side = "on the fp32 side of a boundary (fewer casts)"
        return [
            NodePrecision(node.name, node.op_type, self.precision, None) if self.low[node]
            else NodePrecision(node.name, node.op_type, "fp32", self.reasons.get(node, side))
            for node in self.nodes
        ]

    def _arrives_low(self, value: ir.Value) -> bool | None:
        """Whether a value arrives in the reduced type; None for a weight (stored as needed)."""
        producer = value.producer()
        if producer is not None:
            return self.low.get(producer, False)
        return None if value.const_value is not None else self.io_low

    def _casts_needed(self, node: ir.Node, low: bool) -> int:
        count = sum(1 for _, v in _data_inputs(node) if self._arrives_low(v) not in (None, low))
        for value in node.outputs:
            if _is_float(value):
                readers = [c for c in value.consumers() if any(v is value for _, v in _data_inputs(c))]
                wanted = {self.low[c] for c in readers}
                if value.is_graph_output():
                    wanted.add(self.io_low)
                count += sum(1 for want in wanted if want != low)
        return count


# --- writing the types ------------------------------------------------------------------------


class _Writer:
    """Sets every value's type from the plan and inserts the boundary Casts."""

    def __init__(self, graph: ir.Graph, low_type: ir.DataType, io_type: ir.DataType | None):
        self.graph, self.low_type, self.io_type = graph, low_type, io_type
        self.derived: dict[tuple[str, ir.DataType], ir.Value] = {}
        self.cast_count = 0
        self.inputs: dict[ir.Node, list[int]] = {}
        self.outputs: dict[ir.Node, list[ir.Value]] = {}

    def write(self, low: dict[ir.Node, bool]) -> None:
        # Which inputs and outputs are float, read before any type changes.
        self.inputs = {node: [i for i, _ in _data_inputs(node)] for node in low}
        self.outputs = {node: [v for v in node.outputs if _is_float(v)] for node in low}
        declared = {v.name: self._declared(v) for v in self.graph.outputs}
        self._convert_weights(low)
        if self.io_type is not None:
            for value in self.graph.inputs:
                if _is_float(value):
                    value.dtype = self.io_type
        for node in list(self.graph):
            if node in low:
                self._retype(node, self.low_type if low[node] else FLOAT)
        self._cast_outputs(declared)

    def _declared(self, value: ir.Value) -> ir.DataType | None:
        return self.io_type if self.io_type is not None and _is_float(value) else value.dtype

    def _convert_weights(self, low: dict[ir.Node, bool]) -> None:
        """Weights only reduced-precision nodes read (as data) are converted in place, names kept."""
        for value in list(self.graph.initializers.values()):
            uses = list(value.uses())
            if (uses and _is_float(value) and not value.is_graph_input()
                    and all(index in self.inputs.get(node, ()) and low[node] for node, index in uses)):
                array = value.const_value.numpy().astype(self.low_type.numpy())
                value.const_value = ir.tensor(array, name=value.name)
                value.dtype = self.low_type

    def _retype(self, node: ir.Node, dtype: ir.DataType) -> None:
        for index in self.inputs[node]:
            value = node.inputs[index]
            if value.dtype != dtype:
                if dtype == self.low_type and index in _saturating(node):
                    value = self._clipped(value, node)
                node.replace_input_with(index, self._in_type(value, dtype, node))
        for value in self.outputs[node]:
            value.dtype = dtype
        if node.op_type == "Cast" and node.attributes["to"].as_int() == FLOAT:
            node.attributes["to"] = ir.AttrInt64("to", dtype)
        if node.op_type == "ConstantOfShape" and "value" in node.attributes:
            array = node.attributes["value"].as_tensor().numpy()
            if array.dtype == np.float32:
                node.attributes["value"] = ir.AttrTensor("value", ir.tensor(array.astype(dtype.numpy())))

    def _in_type(self, value: ir.Value, dtype: ir.DataType, user: ir.Node) -> ir.Value:
        """``value`` as ``dtype``: a weight copy or a Cast, made once and shared."""
        key = (value.name, dtype)
        if key in self.derived:
            return self.derived[key]
        name = value.name + _SUFFIX[dtype]
        if value.const_value is not None and value.producer() is None:
            array = value.const_value.numpy().astype(dtype.numpy())
            derived = ir.Value(name=name, type=ir.TensorType(dtype), shape=value.shape,
                               const_value=ir.tensor(array, name=name))
            self.graph.register_initializer(derived)
        else:
            derived = self._cast(value, dtype, name)
            producer = value.producer()
            if producer is not None:
                self.graph.insert_after(producer, derived.producer())
            else:
                self.graph.insert_before(user, derived.producer())
        self.derived[key] = derived
        return derived

    def _clipped(self, value: ir.Value, user: ir.Node) -> ir.Value:
        """``value`` clipped to the reduced type's finite range (in fp32), made once and shared."""
        key = (value.name, "clipped")
        if key not in self.derived:
            limit = float(ml_dtypes.finfo(self.low_type.numpy()).max)
            bounds = [ir.Value(name=f"{value.name}__limit{sign}", type=ir.TensorType(FLOAT), shape=ir.Shape([]),
                               const_value=ir.tensor(np.array(sign * limit, np.float32))) for sign in (-1, 1)]
            for bound in bounds:
                self.graph.register_initializer(bound)
            clipped = ir.Value(name=f"{value.name}__clipped", type=ir.TensorType(FLOAT), shape=value.shape)
            node = ir.node("Clip", [value, *bounds], outputs=[clipped], name=f"clip_{value.name}")
            self.graph.insert_before(user, node)
            self.derived[key] = clipped
        return self.derived[key]

    def _cast(self, value: ir.Value, dtype: ir.DataType, name: str) -> ir.Value:
        out = ir.Value(name=name, type=ir.TensorType(dtype), shape=value.shape)
        ir.node("Cast", [value], {"to": dtype}, outputs=[out], name=f"cast_{name}")
        self.cast_count += 1
        return out

    def _cast_outputs(self, declared: dict[str, ir.DataType | None]) -> None:
        """Outputs keep their declared type: a Cast where the producer's type differs."""
        for index, value in enumerate(list(self.graph.outputs)):
            wanted = declared.get(value.name)
            if wanted is None or value.dtype == wanted or wanted not in _SUFFIX:
                continue
            outer_name = value.name
            value.name = outer_name + _SUFFIX[value.dtype]
            outer = self._cast(value, wanted, outer_name)
            outer.producer().name = f"cast_{outer_name}{_SUFFIX[wanted]}"
            self.graph.append(outer.producer())
            self.graph.outputs[index] = outer


# --- emulation --------------------------------------------------------------------------------


def emulate(model: onnx.ModelProto) -> onnx.ModelProto:
    """The typed graph in fp32 arithmetic, each reduced-precision tensor rounded to its type.

    Every node computes in fp32 on inputs exactly representable in their type and its output
    is rounded once -- what fp16/bf16 GPU kernels with fp32 accumulation do. Inputs and
    outputs become fp32 (inputs rounded inside the graph), so plain fp32 data feeds it.
    Rounded tensors keep their typed graph names, for layer-wise comparison.
    """
    ir_model = ir.serde.deserialize_model(model)
    graph = ir_model.graph
    for value in graph.initializers.values():
        if value.dtype in LOW_DTYPES:
            value.const_value = ir.tensor(value.const_value.numpy().astype(np.float32), name=value.name)
            value.dtype = FLOAT
    for value in graph.inputs:
        if value.dtype in LOW_DTYPES:
            _round_input(graph, value)
    for node in list(graph):
        _widen_constant(node)
        for value in node.outputs:
            if value.dtype in LOW_DTYPES:
                _round_output(graph, node, value)
    return ir.serde.serialize_model(ir_model)


def _widen_constant(node: ir.Node) -> None:
    """Constant / ConstantOfShape values in fp16 or bf16 become fp32 (exactly)."""
    if node.op_type in ("Constant", "ConstantOfShape") and "value" in node.attributes:
        array = node.attributes["value"].as_tensor().numpy()
        if array.dtype in (np.float16, ml_dtypes.bfloat16):
            node.attributes["value"] = ir.AttrTensor("value", ir.tensor(array.astype(np.float32)))


def _rounding(value: ir.Value, low_type: ir.DataType, name: str) -> list[ir.Node]:
    """Cast(low) -> Cast(fp32): ``value`` rounded to ``low_type``, as fp32 named ``name``."""
    low = ir.Value(name=name + "~low", type=ir.TensorType(low_type), shape=value.shape)
    rounded = ir.Value(name=name, type=ir.TensorType(FLOAT), shape=value.shape)
    return [ir.node("Cast", [value], {"to": low_type}, outputs=[low], name=f"round_{name}"),
            ir.node("Cast", [low], {"to": FLOAT}, outputs=[rounded], name=f"widen_{name}")]


def _redirect(graph: ir.Graph, uses, old: ir.Value, new: ir.Value) -> None:
    for user, index in uses:
        user.replace_input_with(index, new)
    for index, output in enumerate(graph.outputs):
        if output is old:
            graph.outputs[index] = new


def _round_input(graph: ir.Graph, value: ir.Value) -> None:
    low_type, uses = value.dtype, list(value.uses())
    value.dtype = FLOAT
    nodes = _rounding(value, low_type, value.name + "~rounded")
    graph.insert_before(next(iter(graph)), nodes)
    _redirect(graph, uses, value, nodes[-1].outputs[0])


def _round_output(graph: ir.Graph, node: ir.Node, value: ir.Value) -> None:
    low_type, uses, name = value.dtype, list(value.uses()), value.name
    if node.op_type == "Cast":  # already rounds: only widen
        value.name = name + "~low"
        widened = ir.Value(name=name, type=ir.TensorType(FLOAT), shape=value.shape)
        nodes = [ir.node("Cast", [value], {"to": FLOAT}, outputs=[widened], name=f"widen_{name}")]
    else:
        value.name, value.dtype = name + "~exact", FLOAT
        nodes = _rounding(value, low_type, name)
    graph.insert_after(node, nodes)
    _redirect(graph, uses, value, nodes[-1].outputs[0])


def float_io(model: onnx.ModelProto) -> onnx.ModelProto:
    """The typed graph with fp32 inputs and outputs: Casts at the boundary, as a caller would
    convert its data (fp16/bf16 -> fp32 is exact). Lets numpy feed and read bf16 graphs."""
    ir_model = ir.serde.deserialize_model(model)
    graph = ir_model.graph
    for index, value in enumerate(list(graph.inputs)):
        if value.dtype in LOW_DTYPES:
            outer = _fp32_outside(value)
            graph.insert_before(next(iter(graph)), ir.node("Cast", [outer], {"to": value.dtype}, outputs=[value]))
            graph.inputs[index] = outer
    for index, value in enumerate(list(graph.outputs)):
        if value.dtype in LOW_DTYPES:
            outer = _fp32_outside(value)
            graph.append(ir.node("Cast", [value], {"to": FLOAT}, outputs=[outer]))
            graph.outputs[index] = outer
    return ir.serde.serialize_model(ir_model)


def _fp32_outside(value: ir.Value) -> ir.Value:
    """A new fp32 value that takes over ``value``'s name; ``value`` gets its type's suffix."""
    outer = ir.Value(name=value.name, type=ir.TensorType(FLOAT), shape=value.shape)
    value.name += _SUFFIX[value.dtype]
    return outer
