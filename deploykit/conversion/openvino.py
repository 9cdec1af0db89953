"""The OpenVINO stage of a conversion (``--backend openvino``): the fp32 graph converted to an OpenVINO
model for the CPU and, with ``--precision int8``, quantized by NNCF on the same calibration batches as
ONNX Runtime's int8 graph. Validation compares its runner with PyTorch like every other candidate.

Why a second CPU route: on x86 CPUs OpenVINO's int8 kernels keep attention, GELU and LayerNorm fused around
the int8 products, where ONNX Runtime's QDQ graph runs them as float ops between Q/DQ pairs; BERT-base ran
1.8-2.1x faster than ONNX Runtime's int8 at the same accuracy (BENCHMARKS.md). The bundle still ships
model.onnx, so it runs wherever OpenVINO is not installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import re
import tempfile
from pathlib import Path

import onnx

from deploykit.backends.openvino.loader import EXTRA, compile_model, import_openvino, installed_version
from deploykit.backends.openvino.runner import OpenVinoRunner
from deploykit.conversion.options import ConvertOptions
from deploykit.conversion.quantize import Calibration, quiet
from deploykit.errors import BadInputError, DeployKitError, EnvironmentProblem, error_summary
from deploykit.ops import custom_op_types

#: What an OpenVINO model of a bundle computes in: fp32 as validated, or NNCF's int8.
PRECISIONS = ("fp32", "int8")
#: The model's two files in the bundle (a bundle is flat: no folders).
FILE = "model.{precision}.openvino.xml"


def check_options(options: ConvertOptions) -> None:
    """Before any work: ``--backend openvino`` takes fp32 and int8, and needs OpenVINO (and NNCF for int8)."""
    if options.backend != "openvino":
        return
    if options.precision not in PRECISIONS:
        raise BadInputError(f"--backend openvino builds fp32 or int8 models, not {options.precision}: use "
                            "--precision int8 (NNCF) or fp32, or --backend onnxruntime for "
                            f"{options.precision}")
    import_openvino()
    if options.precision == "int8":
        import_nncf()


def import_nncf():
    """The ``nncf`` module, or EnvironmentProblem naming the extra."""
    try:
        import nncf
    except ImportError as error:
        raise EnvironmentProblem(f"NNCF is not installed ({error}): pip install '{EXTRA}'") from None
    return nncf


def source_note(graph: onnx.ModelProto) -> str:
    """Which fp32 graph the model is converted from, for the report."""
    return ("the fp32 graph without deploykit's ops (OpenVINO cannot read them)" if custom_op_types(graph)
            else "the fp32 graph the ONNX graph was made from")


@dataclasses.dataclass
class OpenVinoStage:
    """The OpenVINO model written to a temporary folder until the bundle is, its manifest entry, and the
    runner validation compares with PyTorch."""

    entry: dict  # the manifest's entry; ``validated`` is set once validation has run
    folder: tempfile.TemporaryDirectory
    runner: OpenVinoRunner
    # what it was built from, for auto-fix's rounds to build it again with other nodes kept in float
    source: onnx.ModelProto
    io: tuple[list[dict], list[dict]]
    calibration: Calibration | None

    @property
    def label(self) -> str:
        """The validation candidate that runs the model."""
        return f"OpenVINO model {self.entry['precision']}" + (" (NNCF)" if self.entry["precision"] == "int8" else "")

    @property
    def files(self) -> list[Path]:
        return [Path(self.folder.name) / self.entry[key] for key in ("file", "weights")]

    @classmethod
    def build(cls, source: onnx.ModelProto, io: tuple[list[dict], list[dict]], note: str, precision: str,
              calibration: Calibration | None, kept_float: list[str] = ()) -> OpenVinoStage:
        """``source`` (an fp32 graph of standard ONNX ops, and ONNX Runtime ops OpenVINO reads; ``io`` its input
        and output specs) converted; int8: quantized by NNCF on ``calibration``'s batches, ``kept_float`` nodes
        left out."""
        ov = import_openvino()
        folder = tempfile.TemporaryDirectory(prefix="deploykit-openvino-")
        work = Path(folder.name)
        onnx.save_model(source, work / "source.onnx")
        entry = {"file": FILE.format(precision=precision), "precision": precision, "openvino": installed_version(),
                 "inference_precision": "f32", "source": note}
        xml = work / entry["file"]
        with _refused_by_openvino(entry["openvino"]):
            model = ov.convert_model(work / "source.onnx")
            if precision == "int8":
                model = _quantized(model, calibration, kept_float)
                entry |= {"nncf": importlib.metadata.version("nncf"), "kept_float": list(kept_float),
                          "fake_quantize": sum(op.get_type_name() == "FakeQuantize" for op in model.get_ops())}
            ov.save_model(model, xml, compress_to_fp16=False)
            compiled = compile_model(xml, xml.with_suffix(".bin"))
        entry["weights"] = xml.with_suffix(".bin").name
        return cls(entry, folder, OpenVinoRunner(compiled, inputs=io[0], outputs=io[1], label=entry["file"]),
                   source, io, calibration)

    def rebuilt(self, kept_float: list[str]) -> OpenVinoStage:
        """The same model built again from the same graph, ``kept_float`` nodes left out of NNCF's int8."""
        return self.build(self.source, self.io, self.entry["source"], self.entry["precision"], self.calibration,
                          kept_float)

    def validated_entry(self, validations) -> dict:
        """The manifest's entry: validated when every batch it ran passed."""
        runs = next((v.runs for v in validations if v.label == self.label), [])
        self.entry["validated"] = bool(runs) and all(run.passed for run in runs)
        return self.entry


@contextlib.contextmanager
def _refused_by_openvino(version: str):
    """OpenVINO or NNCF failing on a graph ONNX Runtime runs: a backend that cannot build the model (exit 3), not
    a bug of ours nor bad input."""
    try:
        yield
    except (DeployKitError, KeyboardInterrupt):
        raise
    except Exception as error:  # noqa: BLE001 - whatever the converter raises
        reason = error_summary(error)[:300] if str(error).strip() else type(error).__name__
        raise EnvironmentProblem(f"OpenVINO {version} cannot build this model ({reason}): convert without "
                                 "--backend openvino (ONNX Runtime runs the bundle)") from error


def _quantized(model, calibration: Calibration, kept_float: list[str]):
    """NNCF's post-training int8 of ``model`` on every calibration batch (its defaults: per-channel weights,
    per-tensor activations, fast bias correction), ``kept_float`` nodes ignored where the model has them.

    OpenVINO names the ops it makes of an ONNX node after the node, or after the node and a part ("node_linear"
    and "node_linear/WithoutBiases" for a Gemm): a kept node's pattern matches both."""
    nncf = import_nncf()
    patterns = [f"^{re.escape(name)}(/.*)?$" for name in kept_float]
    ignored = nncf.IgnoredScope(patterns=patterns, validate=False) if kept_float else None
    with quiet():
        return nncf.quantize(model, nncf.Dataset(calibration.batches), subset_size=len(calibration.batches),
                             ignored_scope=ignored)
