"""A bundle's graph as an ONNX Runtime runner: its files verified against the manifest, the op
library it ships, and a warning when this ONNX Runtime is not the one that validated it.
"""

from __future__ import annotations

from pathlib import Path

from deploykit.bundle import trust
from deploykit.bundle.read import Bundle
from deploykit.errors import BadInputError, DeployKitError
from deploykit.backends.onnxruntime import loader
from deploykit.backends.onnxruntime.cuda_runs import CudaRuns
from deploykit.backends.onnxruntime.runner import OnnxRuntimeRunner


def load_onnxruntime(bundle: Bundle, device: str = "cpu", device_id: int = 0, *, op_library: bool = True,
                     verify: bool = True, model: Path | None = None, threads: int | None = None,
                     spin: bool | None = None, cuda_graph: bool | None = None, prefer_nhwc: bool = False,
                     stream: int | None = None, tf32: bool = False, profile_prefix: str | None = None,
                     notes: list[str] | None = None, allow_unvalidated: bool = False,
                     trust_native: bool = False) -> OnnxRuntimeRunner:
    """The bundle's graph on the CPU or the CUDA provider, with deploykit's op library registered.

    On the GPU (with torch there) the runner keeps a binding per input shape; ``cuda_graph``
    captures a CUDA graph per shape (None: wherever the graph can be captured, the default), which
    replays on the caller's current stream. The session itself runs on a stream of its own, ordered
    with the caller's by events (``stream`` gives it the caller's stream instead);
    ``prefer_nhwc`` asks for channels-last convolutions; ``spin=False``: thread pools stop spinning when a run returns.
    ``op_library=False`` runs the graph's ONNX function fallbacks instead of our kernels;
    ``model`` swaps in another graph with the same signature (bench's plain export);
    ``allow_unvalidated`` runs batches outside the validated range (the runner notes them); the
    bundle's library is registered only as :func:`deploykit.bundle.trust.op_library` allows
    (``trust_native``).
    """
    notes = list(notes or [])
    library = trust.op_library(bundle, verify, trust_native, notes) if op_library and bundle.op_library else None
    tf32_on = tf32 and device == "cuda"
    options = loader.session_options(op_library=library, threads=threads, spin=spin, profile_prefix=profile_prefix,
                                     tf32=tf32_on)
    if tf32_on:
        notes.append("TF32 on: fp32 convolutions and matrix products round their inputs to 10 mantissa bits, "
                     "which the bundle's fp32 validation did not cover")
    if op_library is False and bundle.op_library:
        notes.append("op library not loaded: deploykit ops run as their ONNX functions")
    model_path = Path(model) if model else bundle.file(bundle.manifest.get("model", "model.onnx"), verify)
    settings = {"tf32": tf32, "prefer_nhwc": prefer_nhwc}
    precision = None if model else bundle.precision  # another graph than the bundle's is read to learn it
    if device == "cuda":
        session, runs = _cuda_session(model_path, options, device_id, cuda_graph, stream, bundle.outputs, notes,
                                      settings, precision)
    else:
        session, runs = loader.create_session(model_path, options, loader.providers(device, device_id),
                                              precision=precision), None
    runner = OnnxRuntimeRunner(session, device, device_id, inputs=bundle.inputs, outputs=bundle.outputs,
                               model_path=model_path, library=library, notes=notes, bundle=bundle,
                               allow_unvalidated=allow_unvalidated, cuda_runs=runs)
    import onnxruntime as ort

    recorded = bundle.recorded_version("onnxruntime-gpu", "onnxruntime")
    if recorded and recorded != ort.__version__:
        runner.warn(f"validated with onnxruntime {recorded}, running {ort.__version__}: outputs may differ slightly")
    return runner


def _cuda_session(model_path: Path, options, device_id: int, cuda_graph: bool | None, stream: int | None,
                  outputs: list[dict], notes: list[str], settings: dict, precision: str | None):
    """The session on the CUDA provider and its per-shape plans (None without torch: then ONNX
    Runtime synchronises each run). A graph that cannot be captured (nodes left on the CPU
    provider) runs without CUDA graphs, with a note, unless ``cuda_graph=True`` asked for them."""
    torch = _torch_with_cuda()
    if torch is None:
        if cuda_graph:
            raise BadInputError("cuda_graph=True needs torch with CUDA in this process (its streams and memory): "
                                "install a CUDA build of torch, or leave cuda_graph unset")
        return loader.create_session(model_path, options, loader.providers("cuda", device_id, stream=stream,
                                                                           **settings), precision=precision), None
    own = torch.cuda.ExternalStream(stream) if stream is not None else torch.cuda.Stream(device_id)

    def session(graphs: bool):
        chosen = loader.providers("cuda", device_id, cuda_graph=graphs, stream=own.cuda_stream, **settings)
        return loader.create_session(model_path, options, chosen, precision=precision)

    graphs = cuda_graph is not False
    try:
        made = session(graphs)
    except DeployKitError as error:
        if not graphs or cuda_graph:
            raise
        notes.append(f"CUDA graphs off (ONNX Runtime cannot capture this graph): {str(error)[:200]}")
        graphs, made = False, session(False)
    return made, CudaRuns(made, outputs, device_id, own, graphs)


def _torch_with_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None
