"""Open a serialized engine to run: deserialize it (host code allowed only where the caller says:
our embedded plugins are host code, see :mod:`deploykit.bundle.trust`) and make its execution
context, with TensorRT-RTX's runtime cache.

RTX compiles kernels when an engine first runs; the runtime cache keeps them across runs.
"""

from __future__ import annotations

from pathlib import Path

from deploykit.errors import EnvironmentProblem
from deploykit.backends.tensorrt import compat
from deploykit.backends.tensorrt.shim import Flavour, installed_tensorrt, local_gpus, logger


def deserialize(flavour: Flavour, engine: bytes, host_code: bool = True):
    """(runtime, engine): the runtime must outlive the engine, so both are returned.

    ``host_code``: whether the engine's embedded plugin library may run; a bundle's engine gets
    it from the trust decision, an engine this process just built always may.
    """
    runtime = flavour.module.Runtime(logger(flavour))
    runtime.engine_host_code_allowed = host_code
    deserialized = runtime.deserialize_cuda_engine(engine)
    if deserialized is None:
        errors, _ = logger(flavour).take()
        any_engine = {"flavour": flavour.name, "version": flavour.version}
        problem = compat.engine_problem(any_engine, installed_tensorrt(flavour.name), local_gpus())
        raise EnvironmentProblem(f"{flavour.label} cannot load the engine: {problem or '; '.join(errors)}")
    return runtime, deserialized


class RuntimeCache:
    """TensorRT-RTX's runtime cache in a file: read when a context is made, written by ``save``."""

    def __init__(self, path: Path):
        self.path, self.cache = Path(path), None

    def attach(self, runtime_config) -> None:
        self.cache = runtime_config.create_runtime_cache()
        if self.path.is_file():
            self.cache.deserialize(self.path.read_bytes())
        runtime_config.set_runtime_cache(self.cache)

    def save(self) -> None:
        if self.cache is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_bytes(bytes(self.cache.serialize()))


def execution_context(flavour: Flavour, engine, cache: RuntimeCache | None = None):
    """An execution context; on TensorRT-RTX with ``cache`` attached to its runtime config."""
    if not flavour.is_rtx:
        return engine.create_execution_context()
    runtime_config = engine.create_runtime_config()
    if cache is not None:
        cache.attach(runtime_config)
    return engine.create_execution_context(runtime_config)
