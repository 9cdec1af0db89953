"""ONNX Runtime sessions, made in one place: session options (log level, threads, profiling,
TF32), deploykit's op library, the execution providers, and the InferenceSession itself.

onnxruntime (and onnx) are imported when a session is made: ``deploykit.runtime`` and the CLI
import this module, and doctor must run where ONNX Runtime is missing.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

from deploykit.native import build as native
from deploykit.errors import DeployKitError, EnvironmentProblem
from deploykit.bundle.read import version_tuple

MIN_ORT_FOR_OP_LIBRARY = (1, 21)  # the op library asks ONNX Runtime for API version 21
CUDA_EP = "CUDAExecutionProvider"


@dataclasses.dataclass(frozen=True)
class OpLibrary:
    """deploykit's custom-op library for ONNX Runtime, or why it is not available."""

    path: Path | None
    note: str


def find_op_library() -> OpLibrary:
    """Build (once, cached) or find the library; without it, models run their ONNX functions."""
    try:
        path = native.find_ort_library()
    except EnvironmentProblem as problem:
        return OpLibrary(None, f"op library unavailable ({problem}); validated the ONNX function fallback")
    return OpLibrary(path, f"validated with {path.name} (our kernels) and with the ONNX function fallback")


def session_options(*, op_library: Path | None = None, threads: int | None = None, spin: bool | None = None,
                    profile_prefix: str | None = None, tf32: bool = False, optimize: bool = True):
    """Options with errors-only logging (warnings would flood the progress display).

    ``tf32`` lets our MatMulRelu kernel use TF32 (the CUDA provider's own switch is in
    ``providers``); ``optimize=False`` turns ONNX Runtime's graph rewrites off. ``spin=False``
    stops the thread pools' spinning as soon as a run returns (by default they keep spinning a
    while, waiting for the next): a server whose own threads parse requests on the same cores gets
    them back between runs, while within a run the pools still spin.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    if spin is False:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    if profile_prefix:
        options.enable_profiling, options.profile_file_prefix = True, profile_prefix
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if tf32:
        options.add_session_config_entry("deploykit.allow_tf32", "1")
    if op_library is not None:
        register_op_library(options, Path(op_library))
    return options


def register_op_library(options, path: Path) -> None:
    """Register our kernels in SessionOptions, or say plainly why this ONNX Runtime cannot take them."""
    import onnxruntime as ort

    if version_tuple(ort.__version__) < MIN_ORT_FOR_OP_LIBRARY:
        raise EnvironmentProblem(f"{path.name} needs onnxruntime >= 1.21 and this is {ort.__version__}: "
                                 "pip install -U onnxruntime, or load(..., op_library=False) for the ONNX functions")
    try:
        options.register_custom_ops_library(str(path))
    except Exception as error:  # noqa: BLE001 - ORT raises its own Fail type
        raise EnvironmentProblem(
            f"onnxruntime {ort.__version__} cannot load {path.name} ({str(error).splitlines()[0][:200]}): it was "
            "built for another platform or ORT; re-run deploykit convert here, or pass op_library=False "
            "(--no-op-library) to run the ONNX function fallbacks") from None


def providers(device: str = "cpu", device_id: int = 0, *, tf32: bool = False, cuda_graph: bool = False,
              stream: int | None = None, prefer_nhwc: bool = False) -> list:
    """The CPU provider, behind the CUDA provider (with its options) when ``device`` is cuda.

    ``prefer_nhwc`` lets the CUDA provider run convolutions channels-last (faster for fp16 CNNs
    on tensor cores, sometimes slower in fp32: tune measures it)."""
    chosen: list = ["CPUExecutionProvider"]
    if device != "cuda":
        return chosen
    import onnxruntime as ort

    # ORT's CUDA EP rounds fp32 Conv/MatMul to TF32 unless told not to; validation was fp32
    cuda_options = {"device_id": str(device_id), "use_tf32": "1" if tf32 else "0"}
    if cuda_graph:
        cuda_options["enable_cuda_graph"] = "1"
    if prefer_nhwc:
        cuda_options["prefer_nhwc"] = "1"
    if stream is not None:  # run on the caller's stream (a cudaStream_t as an integer)
        cuda_options["user_compute_stream"] = str(stream)
    if hasattr(ort, "preload_dlls"):  # cuDNN/cuBLAS from the NVIDIA wheels
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ort.preload_dlls()
    return [(CUDA_EP, cuda_options), *chosen]


def create_session(model, options=None, chosen_providers: list | None = None, *, what: str = "the converted model",
                   precision: str | None = None):
    """An InferenceSession over a file (Path: external data works) or an in-memory model
    (ModelProto or bytes; ``what`` names it in errors). The CUDA provider must be the one that
    started when it was asked for. ``precision``: the bundle's, where known (the graph is then not read
    to find which of ONNX Runtime's rewrites to leave out)."""
    import onnx
    import onnxruntime as ort

    options = options or session_options()
    chosen_providers = chosen_providers or providers()
    skipped = _broken_rewrites(model, _provider_name(chosen_providers[0]) == "CPUExecutionProvider", precision)
    if isinstance(model, onnx.ModelProto):
        model = model.SerializeToString()
    try:
        session = ort.InferenceSession(model if isinstance(model, bytes) else str(model), options,
                                       providers=chosen_providers, disabled_optimizers=skipped)
    except Exception as error:  # noqa: BLE001
        first_line = str(error).splitlines()[0]
        if isinstance(model, bytes):
            raise DeployKitError(f"ONNX Runtime {ort.__version__} cannot load {what}: {first_line}") from error
        raise DeployKitError(f"onnxruntime {ort.__version__} cannot load {Path(model).name}: {first_line[:300]}") from None
    if _provider_name(chosen_providers[0]) == CUDA_EP and session.get_providers()[0] != CUDA_EP:
        raise EnvironmentProblem(f"onnxruntime's {CUDA_EP} did not start (missing CUDA/cuDNN libraries or GPU); "
                                 "run deploykit doctor")
    return session


def _broken_rewrites(model, cpu: bool, precision: str | None = None) -> list[str]:
    """ONNX Runtime rewrites to leave out. On the CPU provider, ONNX Runtime 1.32's NCHWc layout rewrite
    crashed (segfault at session creation) on fp16 ViT graphs whose layer norms run in fp16; it re-lays
    fp32 Convs only, so a graph typed to fp16/bf16 loses little without it. On any provider, its
    Relu-into-QuantizeLinear rewrite drops a Relu before a float8 QuantizeLinear as if float8 could not
    hold negative values (1.32: an fp8 MLP's cosine against PyTorch fell from 0.999 to 0.979). A bundle's
    ``precision`` says both without reading the graph, but fp8's (fp16 for AOTInductor, Q/DQ for TensorRT)."""
    if precision in ("fp32", "int8", "fp16", "bf16"):
        return ["NchwcTransformer"] if cpu and precision in ("fp16", "bf16") else []
    import onnx

    if not isinstance(model, onnx.ModelProto):
        model = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(str(model),
                                                                                       load_external_data=False)
    graph, reduced = model.graph, (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    values = [*graph.input, *graph.value_info, *graph.output]
    typed = (any(t.data_type in reduced for t in graph.initializer)
             or any(v.type.tensor_type.elem_type in reduced for v in values))
    float8 = {onnx.TensorProto.FLOAT8E4M3FN, onnx.TensorProto.FLOAT8E4M3FNUZ, onnx.TensorProto.FLOAT8E5M2,
              onnx.TensorProto.FLOAT8E5M2FNUZ}
    return ((["NchwcTransformer"] if cpu and typed else [])
            + (["ReluQuantRewrite"] if any(t.data_type in float8 for t in graph.initializer) else []))


def _provider_name(provider) -> str:
    return provider[0] if isinstance(provider, tuple) else provider
