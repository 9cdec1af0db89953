"""The schema of manifest.json, checked on every open: a bundle from anyone is read only when
each field has the type ``bundle/manifest.py`` writes and every file it names stays in the bundle.

Keys this schema does not know are kept (newer writers add them); required keys, types, sizes
and file names are enforced, so a damaged or hostile manifest is one clear line, never a crash.
"""

from __future__ import annotations

import reprlib
from typing import Annotated, Any, Literal

import onnx
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, ValidationError, model_validator

#: Largest size a tensor dimension may declare (TensorRT's int32 dimensions).
MAX_DIM = 2**31 - 1
#: The numpy names of ONNX's tensor types: what ``dtype`` holds.
DTYPES = frozenset(onnx.helper.tensor_dtype_to_np_dtype(t).name for t in onnx.TensorProto.DataType.values()
                   if t not in (onnx.TensorProto.UNDEFINED, onnx.TensorProto.STRING))


def plain_name(name: str) -> str:
    """A file of the bundle is named by a bare file name: no folder, no way out of the bundle."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError("not a plain file name inside the bundle (no folders, '..' or absolute paths)")
    return name


def dimension(value: Any) -> int | str:
    """A size 0..MAX_DIM (0: unknown) or a symbolic name such as "batch"."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_DIM:
        return value
    raise ValueError(f"a dimension is a size from 0 to {MAX_DIM} or a name like 'batch'")


def dtype_name(value: str) -> str:
    if value not in DTYPES:
        raise ValueError("unknown dtype; deploykit writes numpy names such as float32, float16, bfloat16, int64")
    return value


FileName = Annotated[str, AfterValidator(plain_name)]
Size = Annotated[int, Field(ge=1, le=MAX_DIM)]
Count = Annotated[int, Field(ge=0)]


class Part(BaseModel):
    """Every object of the manifest: strict types (no "1" for 1), unknown keys kept."""

    model_config = ConfigDict(extra="allow", strict=True)


class BatchRange(Part):
    min: Size
    opt: Size
    max: Size

    @model_validator(mode="after")
    def ordered(self) -> BatchRange:
        if not self.min <= self.opt <= self.max:
            raise ValueError("a batch range needs min <= opt <= max")
        return self


class Tensor(Part):
    name: str
    dtype: Annotated[str, AfterValidator(dtype_name)]
    shape: list[Annotated[int | str, PlainValidator(dimension)]]
    dynamic: dict[str, BatchRange] = {}


class PassStats(Part):
    name: str
    changes: dict[str, Count]


class SkippedTarget(Part):
    """A compute capability the engine was not built for: TensorRT refused ``layer`` there."""

    target: str
    reason: str
    layer: str | None = None
    architecture: str | None = None


class Engine(Part):
    file: FileName
    flavour: Literal["tensorrt", "tensorrt-rtx"]
    version: str
    targets: list[str]
    skipped_targets: list[SkippedTarget] = []  # absent from manifests written before deploykit recorded them
    validated: bool = False


class AotiPackage(Part):
    """An AOTInductor package (a zip holding a compiled .so): it loads only on the torch that
    compiled it, on a GPU of its compute capability (cuda) or a CPU with its vector ISA (cpu)."""

    file: FileName
    device: Literal["cpu", "cuda"]
    torch: str
    cuda_arch: str | None = None
    gpu: str | None = None
    cpu_isa: str | None = None
    batch: BatchRange
    precision: Literal["fp32", "fp16", "bf16", "fp8"]
    cuda_graph: bool = False
    inductor_configs: dict[str, bool | int | float | str] = {}  # what aoti_compile_and_package was given
    validated: bool = False


class OpenVinoModel(Part):
    """An OpenVINO model (graph .xml, weights .bin) for the CPU: fp32, or int8 quantized by NNCF from the
    fp32 graph. A graph, not native code: it loads without consent."""

    file: FileName
    weights: FileName
    precision: Literal["fp32", "int8"]
    openvino: str
    nncf: str | None = None
    inference_precision: str = "f32"
    source: str = ""  # which fp32 graph it was converted from
    fake_quantize: Count = 0  # int8: NNCF's FakeQuantize ops
    kept_float: list[str] = []  # int8: nodes auto-fix kept out of NNCF's quantization
    validated: bool = False


class OpLibrary(Part):
    file: FileName
    runtime: str
    register_: str = Field(alias="register")
    ops: list[str]


class Validation(Part):
    passed: bool
    batch_sizes: list[Size] = []
    max_abs: dict[str, float | None] = {}
    #: outputs that do not depend on the input -> why (matching them proved nothing)
    inconclusive: dict[str, str] = {}
    #: the conversion's --tolerance texts ([OUTPUT:]KEY=VALUE,...); none: the precision's defaults
    tolerances: list[str] = []


class TunedChoice(Part):
    """The fastest candidate that passed at one batch size, and every candidate timed there."""

    batch: Size
    backend: Literal["onnxruntime", "tensorrt", "aoti", "openvino"]
    options: dict = {}
    p50_ms: float
    candidates: list[dict] = []


class Tuning(Part):
    """Written by ``deploykit tune`` / ``convert --tune``: what ``load(backend="auto")`` runs on a
    machine with this device, GPU and compute capability (docs/tuning.md)."""

    device: Literal["cpu", "cuda"]
    gpu: str | None
    cuda_arch: str | None
    created: str
    versions: dict[str, str]
    reference: str = ""
    notes: list[str] = []
    choices: list[TunedChoice]
    unchosen: list[dict] = []  # batch sizes where no candidate passed, with their candidates


class FileEntry(Part):
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    bytes: Count


class Header(Part):
    """What is read before the rest: a newer format may change everything else."""

    format: str
    format_version: Size


class Quantization(Part):
    """int8 or fp8 (``convert --precision int8|fp8``): the calibration (``note`` says when it was random data, which
    proves nothing for real inputs), the nodes quantized, the nodes kept float and why."""

    format: str
    calibration_method: Literal["minmax", "entropy", "percentile", "distribution"]
    calibration: dict[str, str | int]
    quantized_nodes: list[str] = []
    float_nodes: list[dict[str, str | None]] = []


class Manifest(Header):
    created: str = ""
    source: str = ""
    model: FileName = "model.onnx"
    precision: Literal["fp32", "fp16", "bf16", "int8", "fp8"] = "fp32"
    io_precision: Literal["fp32", "fp16", "bf16"] | None = None
    reference_model: FileName | None = None
    quantization: Quantization | None = None
    opset: Count = 0
    ir_version: Count = 0
    exporter: str = ""
    inputs: list[Tensor]
    outputs: list[Tensor]
    passes: list[PassStats] = []
    engines: list[Engine] = []
    aoti: list[AotiPackage] = []
    openvino: list[OpenVinoModel] = []
    custom_op_libraries: list[OpLibrary] = []
    versions: dict[str, str] = {}
    validation: Validation = Validation(passed=False)
    tuning: Tuning | None = None
    files: dict[FileName, FileEntry]


def first_problem(error: ValidationError) -> str:
    """Pydantic's first error as "field.path: what is wrong (got VALUE)"."""
    problem = error.errors(include_url=False)[0]
    where = ".".join(map(str, problem["loc"])) or "the top level"
    got = "" if problem["type"] == "missing" else f" (got {reprlib.repr(problem['input'])})"
    more = f" (and {error.error_count() - 1} more problems)" if error.error_count() > 1 else ""
    return f"{where}: {problem['msg'].removeprefix('Value error, ')}{got}{more}"

