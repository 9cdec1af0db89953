"""A bundle's TensorRT engine as a runner: the engine file verified against the manifest, RTX's
runtime cache kept per engine, and a warning when the engine was not run at conversion time.
"""

from __future__ import annotations

from deploykit.bundle import trust
from deploykit.bundle.read import Bundle
from deploykit.native.build import cache_dir
from deploykit.backends.tensorrt.runner import TensorRTRunner


def load_tensorrt_engine(bundle: Bundle, entry: dict, device_id: int = 0, *, verify: bool = True,
                         notes: list[str] | None = None, trust_native: bool = False) -> TensorRTRunner:
    """The bundle's engine ``entry`` (one of ``bundle.engines``) on GPU ``device_id``; embedded plugin
    code runs only as :func:`deploykit.bundle.trust.engine_host_code_allowed` allows."""
    digest = bundle.manifest["files"][entry["file"]]["sha256"][:16]
    engine = bundle.file(entry["file"], verify).read_bytes()
    host_code = trust.engine_host_code_allowed(bundle, entry, trust_native)
    runner = TensorRTRunner(engine, entry, device_id, what=entry["file"], host_code=host_code,
                            runtime_cache=cache_dir() / "runtime-cache" / f"{digest}.bin", inputs=bundle.inputs,
                            outputs=bundle.outputs, notes=notes, bundle=bundle)
    if not entry.get("validated"):
        runner.warn(f"{entry['file']} was not run at conversion time ({entry.get('note', '')}); "
                    "its outputs were validated only through ONNX Runtime")
    return runner
