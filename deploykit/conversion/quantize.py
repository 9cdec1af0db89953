"""Convert's quantized-graph stage: ``convert --precision int8``, and ``--precision fp8 --backend
tensorrt``, through ONNX Runtime's static quantization.

It runs on the optimized fp32 graph, after deploykit's passes: BatchNorm is already folded into
the convolutions, so each folded weight is quantized once, per output channel, as it will run.
The graph it writes is QDQ (QuantizeLinear/DequantizeLinear around every quantized node), which
any ONNX runtime reads and ONNX Runtime's CPU provider fuses into int8 kernels.

Only the standard ONNX op types of :data:`QUANTIZED_OPS` are quantized. Everything else stays
float and reads the DequantizeLinear output of a quantized producer: deploykit's own ops (our
kernels are float), ONNX Runtime's contrib ops, normalisations, Softmax. docs/precision.md says
why, and what the measurements chose (uint8 activations, int8 weights). fp8 for TensorRT puts float8
e4m3 Q/DQ around the matrix products only (:data:`FP8_OPS`), per tensor, for TensorRT's fp8 kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import tempfile
from pathlib import Path

import numpy as np
import onnx

from deploykit.bundle.format import REFERENCE_MODEL
from deploykit.conversion.export import declare_oldest_ir_version
from deploykit.conversion.quantize_fix import FIXABLE_OPS, QuantizationFix
from deploykit.conversion.options import ConvertOptions
from deploykit.errors import BadInputError
from deploykit.passes.precision import NodePrecision, name_nodes
from deploykit.specs import InputSpec
from deploykit.validation.inputs import load_feeds, random_feeds

CALIBRATION_METHODS = ("minmax", "entropy", "percentile")
#: fp8's scales: ONNX Runtime's quantizer fits float8 scales with its distribution calibration only
#: (from each tensor's spread, so that rare outliers saturate at 448 rather than coarsen every value)
FP8_CALIBRATION_METHOD = "distribution"
#: The backends int8 is written for. TensorRT takes only symmetric int8 (zero points 0), so for it the
#: activations are int8 around zero; ONNX Runtime's CPU kernels are fastest with uint8 activations.
TARGETS = ("onnxruntime", "tensorrt")
FORMATS = {("int8", "onnxruntime"): "QDQ: int8 weights per output channel, uint8 activations per tensor",
           ("int8", "tensorrt"): "QDQ: int8 weights per output channel, int8 activations per tensor, symmetric "
                                 "(zero points 0)",
           ("fp8", "tensorrt"): "QDQ: float8 e4m3 weights and activations of the matrix products (MatMul, Gemm), "
                                "per tensor; the rest fp32"}
#: Standard ONNX ops that run in int8. The matrix products are the speed; the elementwise and data
#: movement ops between them keep the tensors int8 so that no DequantizeLinear/QuantizeLinear pair
#: sits between two quantized products (ONNX Runtime folds Relu and Clip into the QuantizeLinear).
QUANTIZED_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm", "Add", "Mul", "Relu", "Clip", "MaxPool",
                 "AveragePool", "GlobalAveragePool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze",
                 "Concat", "Resize", "Pad", "Slice", "Split")
#: What fp8 quantizes: the products, where TensorRT's fp8 kernels are the speed (as fp8's AOTInductor
#: route computes only the Linear layers in fp8)
FP8_OPS = ("MatMul", "Gemm")
#: Random calibration inputs when no --calibration is given: as many as a quick calibration uses.
RANDOM_SAMPLES = 32
#: Added to --seed for the random calibration inputs: disjoint from the validation inputs.
RANDOM_SEED_OFFSET = 10_007
_STANDARD_DOMAINS = ("", "ai.onnx")
_QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
AUTO_FIX_REASON = ("kept in float by --auto-fix: its quantization added the most error to the outputs, or it "
                   "quantizes the input of a node that did")


def random_data_note(precision: str) -> str:
    """What scales fitted to random inputs mean, said in the report, the console and the manifest."""
    return (f"the {precision} scales were calibrated on random inputs (no --calibration): they fit random data, so "
            "this result proves nothing for real inputs; convert with --calibration data.npz (several hundred real "
            "samples, named like the model's inputs)")


def check_options(options: ConvertOptions) -> None:
    """Refuse what int8 does not do yet, and the int8 options without --precision int8."""
    if options.precision == "fp8":
        return  # fp8.check_options
    if options.precision != "int8":
        if options.calibration_path is not None or options.calibration_method != "minmax":
            raise BadInputError("--calibration and --calibration-method apply to int8 and fp8: add --precision int8 "
                                "(or fp8 with --backend aoti)")
        return
    refused = {
        "--io-precision": options.io_precision is not None,
        f"--backend {options.backend}": options.backend not in (*TARGETS, "openvino"),
    }
    for flag, given in refused.items():
        if given:
            raise BadInputError(f"{flag} is not supported with --precision int8 yet (int8 is written for ONNX Runtime, "
                                f"TensorRT and OpenVINO); drop {flag.split()[0]}, or convert with --precision fp16")
    if options.calibration_method not in CALIBRATION_METHODS:
        raise BadInputError(f"--calibration-method {options.calibration_method!r}: use "
                            f"{', '.join(CALIBRATION_METHODS)}")


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What the scales were fitted on: the batches fed to the calibrator, and where they came from."""

    batches: list[dict[str, np.ndarray]]
    source: str  # the .npz path, or "random"
    samples: int

    @property
    def random(self) -> bool:
        return self.source == "random"

    @classmethod
    def read(cls, options: ConvertOptions, specs: list[InputSpec]) -> Calibration:
        """The --calibration samples in batches the graph takes, else seeded random ones."""
        if options.calibration_path is None:
            samples = {spec.name: array for spec, array in zip(specs, random_feeds(
                [spec.with_batch(RANDOM_SAMPLES) for spec in specs], options.seed + RANDOM_SEED_OFFSET).values())}
            source = "random"
        else:
            samples = load_feeds(options.calibration_path, specs, option="--calibration")
            _check_sample_counts(samples, options.calibration_path)
            source = str(options.calibration_path)
        size = next(iter(samples.values())).shape[0]
        step = specs[0].shape[0]  # the declared batch (OPT of a dynamic range): the graph takes it
        if options.batch is None and size < step:
            raise BadInputError(f"--calibration {source}: {size} samples, fewer than the model's fixed batch {step}; "
                                f"give at least {step}")
        stop = size if options.batch is not None else size - size % step
        batches = [{name: array[start:start + step] for name, array in samples.items()}
                   for start in range(0, stop, step)]
        return cls(batches, source, stop)

    def to_json(self, precision: str) -> dict:
        """Where the samples came from, and what random ones mean for the ``precision`` they calibrated."""
        entry = {"source": self.source, "samples": self.samples, "batches": len(self.batches)}
        return {**entry, "note": random_data_note(precision)} if self.random else entry


def _check_sample_counts(samples: dict[str, np.ndarray], path: Path) -> None:
    counts = {name: array.shape[0] for name, array in samples.items()}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{name} {count}" for name, count in counts.items())
        raise BadInputError(f"--calibration {path}: the arrays hold different numbers of samples ({listed}); "
                            "axis 0 counts samples and must be the same for every input")


@dataclasses.dataclass
class QuantizationStage:
    """``convert --precision int8`` (and fp8 for TensorRT): the fp32 graph, its QDQ quantization and what it
    quantized."""

    fp32: onnx.ModelProto
    model: onnx.ModelProto
    method: str
    calibration: Calibration
    nodes: list[NodePrecision]
    target: str = "onnxruntime"  # TARGETS: the backend whose format the graph has
    precision: str = "int8"  # or fp8 (for TensorRT)
    fix: QuantizationFix | None = None  # --auto-fix: what it kept in float, round by round

    @classmethod
    def start(cls, optimized: onnx.ModelProto, calibration: Calibration, method: str,
              target: str = "onnxruntime", precision: str = "int8") -> QuantizationStage:
        fp32 = name_nodes(optimized)  # the report names every node, quantized or float
        try:
            model = quantize(fp32, calibration.batches, method, target=target, precision=precision)
        except Exception as error:
            if calibration.random or not type(error).__module__.startswith("onnxruntime"):
                raise  # our own random samples always run: a failure there is a bug
            reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            raise BadInputError(f"--calibration {calibration.source}: the model does not run on these samples "
                                f"({reason}); check their values (token ids within the vocabulary, indices "
                                "in range)") from None
        return cls(fp32, model, method, calibration, node_precisions(fp32, model, precision=precision), target,
                   precision)

    def requantize(self, kept_float: list[str]) -> None:
        """Quantize the fp32 graph again (same samples and method) with ``kept_float`` left in float."""
        self.model = quantize(self.fp32, self.calibration.batches, self.method, kept_float, self.target,
                              self.precision)
        self.nodes = node_precisions(self.fp32, self.model, set(kept_float), self.precision)

    def fixable_nodes(self) -> set[str]:
        """The quantized nodes auto-fix may keep in float."""
        return {n.node for n in self.nodes if n.precision == self.precision and n.op in FIXABLE_OPS}

    def inconclusive_reasons(self, output_names: list[str]) -> dict[str, str]:
        """Every output, where the scales were fitted to random data: passing proves nothing for real inputs."""
        return dict.fromkeys(output_names, random_data_note(self.precision)) if self.calibration.random else {}

    def to_json(self) -> dict:
        quantized = [n for n in self.nodes if n.precision == self.precision]
        return {
            "precision": self.precision,
            "io_precision": None,
            "target": self.target,
            "reference_model": REFERENCE_MODEL,
            "format": FORMATS[self.precision, self.target],
            "calibration_method": self.method,
            "calibration": self.calibration.to_json(self.precision),
            "nodes": {self.precision: len(quantized), "float": len(self.nodes) - len(quantized)},
            "quantized_nodes": [n.node for n in quantized],
            "float_nodes": [n.to_json() for n in self.nodes if n.precision != self.precision],
            "auto_fix": self.fix.to_json() if self.fix else None,
        }


def quantize(model: onnx.ModelProto, batches: list[dict[str, np.ndarray]], method: str,
             kept_float: list[str] = (), target: str = "onnxruntime", precision: str = "int8") -> onnx.ModelProto:
    """``model`` quantized by ONNX Runtime's ``quantize_static`` (QDQ), calibrated on ``batches``;
    ``kept_float``: nodes auto-fix keeps in float; ``target`` (TARGETS) "tensorrt": activations with
    zero points 0 and float biases, the only int8 TensorRT builds. ``precision`` "fp8": float8 e4m3
    weights and activations of the products, per tensor (the ``method`` is FP8_CALIBRATION_METHOD)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    fp8 = precision == "fp8"
    symmetric = fp8 or target == "tensorrt"
    activations = QuantType.QFLOAT8E4M3FN if fp8 else QuantType.QInt8 if symmetric else QuantType.QUInt8
    methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
               "percentile": CalibrationMethod.Percentile, FP8_CALIBRATION_METHOD: CalibrationMethod.Distribution}
    with tempfile.TemporaryDirectory(prefix="deploykit-quantize-") as work, quiet():
        source, written = Path(work) / "fp32.onnx", Path(work) / "quantized.onnx"
        onnx.save_model(model, source)
        quantize_static(
            source, written, _Batches(batches), quant_format=QuantFormat.QDQ, per_channel=not fp8,
            activation_type=activations, weight_type=QuantType.QFLOAT8E4M3FN if fp8 else QuantType.QInt8,
            calibrate_method=methods[method], op_types_to_quantize=list(quantized_ops(precision)),
            nodes_to_exclude=_foreign_nodes(model) + list(kept_float),
            # TensorRT dequantizes 8-bit only: its biases stay float (ONNX Runtime's CPU kernels take int32 ones)
            extra_options={"ActivationSymmetric": symmetric, "WeightSymmetric": True, "QuantizeBias": not symmetric,
                           # fp8's products read fp8 and write float: no rounding between a product and what follows
                           "OpTypesToExcludeOutputQuantization": list(FP8_OPS) if fp8 else []},
        )
        quantized = onnx.load_model(written)
    if kept_float:
        _read_float_inputs(quantized, set(kept_float))
    declare_oldest_ir_version(quantized)
    return quantized


def quantized_ops(precision: str) -> tuple[str, ...]:
    """The op types ``precision`` quantizes."""
    return FP8_OPS if precision == "fp8" else QUANTIZED_OPS


def _read_float_inputs(model: onnx.ModelProto, nodes: set[str]) -> None:
    """``nodes`` read the float tensors themselves, not their QuantizeLinear/DequantizeLinear round trip.

    Excluding a node from ``quantize_static`` keeps its weights float, but its activation input is
    still quantized where the producer is (a quantized Gemm's output, a Relu folded into its
    QuantizeLinear): the rounding auto-fix is removing would stay. Q/DQ pairs left unread go too."""
    producers = {output: node for node in model.graph.node for output in node.output}
    for node in model.graph.node:
        if node.name not in nodes:
            continue
        for index, name in enumerate(node.input):
            dequantize = producers.get(name)
            if dequantize is None or dequantize.op_type != "DequantizeLinear":
                continue
            quantize_node = producers.get(dequantize.input[0])
            if quantize_node is not None and quantize_node.op_type == "QuantizeLinear":
                node.input[index] = quantize_node.input[0]
    _remove_unread_qdq(model)


def _remove_unread_qdq(model: onnx.ModelProto) -> None:
    graph = model.graph
    while True:
        read = {name for node in graph.node for name in node.input} | {output.name for output in graph.output}
        unread = [node for node in graph.node if node.op_type in _QDQ_OPS and not read & set(node.output)]
        if not unread:
            return
        for node in unread:
            graph.node.remove(node)


class _Batches:
    """ONNX Runtime's calibration data reader protocol over a list of feed dicts."""

    def __init__(self, batches: list[dict[str, np.ndarray]]):
        self.batches, self.position = batches, 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.position == len(self.batches):
            return None
        self.position += 1
        return self.batches[self.position - 1]

    def rewind(self) -> None:
        self.position = 0


@contextlib.contextmanager
def quiet():
    """quantize_static logs advice on the root logger and prints histogram progress to stdout,
    which carries convert --json's report: neither reaches the user."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(previous)


def _foreign_nodes(model: onnx.ModelProto) -> list[str]:
    """Nodes outside ONNX's domain (deploykit's, ONNX Runtime's): never quantized, whatever their op type."""
    return [node.name for node in model.graph.node if node.domain not in _STANDARD_DOMAINS]


def node_precisions(fp32: onnx.ModelProto, quantized: onnx.ModelProto,
                    kept_float: set[str] = frozenset(), precision: str = "int8") -> list[NodePrecision]:
    """Each node of the fp32 graph: ``precision`` where it is an op type that precision quantizes and the
    quantized graph feeds it dequantized tensors (a Relu or Clip folded into its QuantizeLinear is gone:
    int8), else float with the reason (``kept_float``: by auto-fix); a float node may read a DequantizeLinear too."""
    producers = {output: node.op_type for node in quantized.graph.node for output in node.output}
    kept = {node.name: node for node in quantized.graph.node if node.op_type not in _QDQ_OPS}
    ops = quantized_ops(precision)
    result = []
    for node in fp32.graph.node:
        after = kept.get(node.name)
        reads_quantized = after is None or any(producers.get(name) == "DequantizeLinear" for name in after.input)
        if node.name in kept_float:
            result.append(NodePrecision(node.name, _label(node), "float", AUTO_FIX_REASON))
        elif node.domain in _STANDARD_DOMAINS and node.op_type in ops and reads_quantized:
            result.append(NodePrecision(node.name, _label(node), precision))
        else:
            result.append(NodePrecision(node.name, _label(node), "float", _float_reason(node, precision)))
    return result


def _float_reason(node: onnx.NodeProto, precision: str) -> str:
    if node.domain == "deploykit":
        return "deploykit op: our kernels are float; it reads and writes float between DequantizeLinear and QuantizeLinear"
    if node.domain not in _STANDARD_DOMAINS:
        return f"{node.domain} op: left float"
    if node.op_type not in quantized_ops(precision):
        if precision == "fp8":
            return f"fp8 quantizes the matrix products only ({', '.join(FP8_OPS)})"
        return "not an op type deploykit quantizes (normalisations, Softmax, exp/log and the like stay float)"
    return ("it reads float tensors only (from a float node or a constant): ONNX Runtime's quantizer quantizes "
            "pooling and data movement only where their input already is int8")


def _label(node: onnx.NodeProto) -> str:
    return node.op_type if node.domain in _STANDARD_DOMAINS else f"{node.domain}::{node.op_type}"
