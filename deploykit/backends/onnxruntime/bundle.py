"""A bundle's graph as an ONNX Runtime runner: its files verified against the manifest, the op
library it ships, and a warning when this ONNX Runtime is not the one that validated it.
"""

from __future__ import annotations

from pathlib import Path

from deploykit.bundle import trust
from deploykit.bundle.read import Bundle
from deploykit.backends.onnxruntime import loader
from deploykit.backends.onnxruntime.runner import OnnxRuntimeRunner


def load_onnxruntime(bundle: Bundle, device: str = "cpu", device_id: int = 0, *, op_library: bool = True,
                     verify: bool = True, model: Path | None = None, threads: int | None = None,
                     cuda_graph: bool = False, stream: int | None = None, tf32: bool = False,
                     profile_prefix: str | None = None, notes: list[str] | None = None,
                     allow_unvalidated: bool = False, trust_native: bool = False) -> OnnxRuntimeRunner:
    """The bundle's graph on the CPU or the CUDA provider, with deploykit's op library registered.

    ``op_library=False`` runs the graph's ONNX function fallbacks instead of our kernels;
    ``model`` swaps in another graph with the same signature (bench's plain export);
    ``allow_unvalidated`` runs batches outside the validated range (the runner notes them); the
    bundle's library is registered only as :func:`deploykit.bundle.trust.op_library` allows
    (``trust_native``).
    """
    notes = list(notes or [])
    library = trust.op_library(bundle, verify, trust_native, notes) if op_library and bundle.op_library else None
    tf32_on = tf32 and device == "cuda"
    options = loader.session_options(op_library=library, threads=threads, profile_prefix=profile_prefix, tf32=tf32_on)
    if tf32_on:
        notes.append("TF32 on: fp32 convolutions and matrix products round their inputs to 10 mantissa bits, "
                     "which the bundle's fp32 validation did not cover")
    if op_library is False and bundle.op_library:
        notes.append("op library not loaded: deploykit ops run as their ONNX functions")
    model_path = Path(model) if model else bundle.file(bundle.manifest.get("model", "model.onnx"), verify)
    chosen = loader.providers(device, device_id, tf32=tf32, cuda_graph=cuda_graph, stream=stream)
    session = loader.create_session(model_path, options, chosen)
    runner = OnnxRuntimeRunner(session, device, device_id, inputs=bundle.inputs, outputs=bundle.outputs,
                               model_path=model_path, library=library, notes=notes, bundle=bundle,
                               allow_unvalidated=allow_unvalidated)
    import onnxruntime as ort

    recorded = bundle.recorded_version("onnxruntime-gpu", "onnxruntime")
    if recorded and recorded != ort.__version__:
        runner.warn(f"validated with onnxruntime {recorded}, running {ort.__version__}: outputs may differ slightly")
    return runner
