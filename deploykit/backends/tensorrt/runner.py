"""The TensorRT runner: one class for conversion-time validation (an EngineBuild, numpy in and
out) and ``deploykit.load`` (a bundle's engine; numpy, torch or CUDA arrays, fed by pointer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

from deploykit.errors import DeployKitError, EnvironmentProblem
from deploykit.backends.base.feeds import DeviceArray, check_batch_range, collect_feeds, output_kind
from deploykit.backends.base.memory import device_memory
from deploykit.backends.base.runner import Runner
from deploykit.backends.tensorrt import compat
from deploykit.backends.tensorrt.loader import RuntimeCache, deserialize, execution_context
from deploykit.backends.tensorrt.shim import load_tensorrt, logger


class TensorRTRunner(Runner):
    """A serialized engine (plugins embedded) on this GPU.

    ``requirements`` is what the engine needs ("flavour", "version", "targets": a bundle's
    engine entry or ``EngineBuild.requirements()``); ``what`` names the engine in errors.
    ``runtime_cache`` (TensorRT-RTX) keeps the kernels RTX compiles on first run across runs.
    Specs default to the engine's own; a bundle loader passes the manifest's, whose batch
    range each run is checked against. ``cast_inputs`` casts host feeds to the engine's input
    types first (conversion feeds the declared types; the engine takes the I/O precision).
    """

    backend = "tensorrt"

    def __init__(self, engine: bytes, requirements: Mapping, device_id: int = 0, *, what: str = "the engine",
                 runtime_cache: Path | None = None, inputs: list[dict] | None = None,
                 outputs: list[dict] | None = None, cast_inputs: bool = False, notes: list[str] | None = None,
                 name: str | None = None, bundle=None, host_code: bool = True):
        problem = compat.engine_problem_here(requirements)
        if problem:
            raise EnvironmentProblem(f"cannot run {what} here: {problem}")
        self.what, self.cast_inputs = what, cast_inputs
        self.flavour = load_tensorrt(requirements["flavour"])
        self.memory = device_memory(device_id)
        self._runtime, self.engine = deserialize(self.flavour, engine, host_code)
        self.cache = RuntimeCache(runtime_cache) if runtime_cache and self.flavour.is_rtx else None
        self.context = execution_context(self.flavour, self.engine, self.cache)
        engine_inputs, engine_outputs = self._engine_specs()
        super().__init__("cuda", inputs or engine_inputs, outputs or engine_outputs, notes=notes, name=name,
                         bundle=bundle)

    @classmethod
    def from_build(cls, build) -> TensorRTRunner:
        """Conversion-time validation: a fresh EngineBuild, fed the declared (fp32) inputs."""
        return cls(build.engine, build.requirements(), cast_inputs=True, name=build.flavour)

    def _engine_specs(self) -> tuple[list[dict], list[dict]]:
        """(inputs, outputs) of the engine: name, dtype name, shape (-1 for dynamic sizes)."""
        trt, engine = self.flavour.module, self.engine
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        specs = {name: {"name": name, "dtype": self._dtype(name).name, "shape": list(engine.get_tensor_shape(name))}
                 for name in names}
        is_input = {name: engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT for name in names}
        return [specs[n] for n in names if is_input[n]], [specs[n] for n in names if not is_input[n]]

    def describe(self) -> dict:
        return {**super().describe(), "engine": self.what, "tensorrt": self.flavour.label,
                "memory": self.memory.name}

    def _dtype(self, name: str) -> np.dtype:
        trt = self.flavour.module
        dtype = self.engine.get_tensor_dtype(name)
        if dtype == trt.bfloat16:  # numpy knows bfloat16 only through ml_dtypes
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(trt.nptype(dtype))

    def run(self, feeds=None, /, **named) -> dict:
        if self.cast_inputs:
            feeds = {spec["name"]: np.asarray(feeds[spec["name"]]).astype(self._dtype(spec["name"]), copy=False)
                     for spec in self.inputs}
        given = collect_feeds(feeds, named, self.inputs)
        for spec in self.inputs:
            check_batch_range(given[spec["name"]], spec)
        kind, device = output_kind(given)
        keep = []  # device copies of host inputs live until the engine has run
        for name, feed in given.items():
            buffer = feed.value if feed.on_device else self.memory.to_device(feed.host())
            keep.append(buffer)
            self.context.set_input_shape(name, feed.shape)
            self.context.set_tensor_address(name, feed.pointer if feed.on_device else _pointer(buffer))
        outputs = {}
        for name in self.output_names:
            outputs[name] = self.memory.empty(tuple(self.context.get_tensor_shape(name)), self._dtype(name))
            self.context.set_tensor_address(name, _pointer(outputs[name]))
        if not self.context.execute_async_v3(self.memory.stream()):
            errors, _ = logger(self.flavour).take()
            raise DeployKitError(f"{self.flavour.label} failed to run {self.what}: {'; '.join(errors)}")
        if kind != "torch":
            self.memory.synchronize()
        return {name: self.memory.deliver(buffer, kind, device) for name, buffer in outputs.items()}

    def close(self) -> None:
        """Write the runtime cache back (RTX), so the next run skips kernel compilation."""
        if self.cache is not None:
            self.cache.save()


def _pointer(buffer) -> int:
    return buffer.pointer if isinstance(buffer, DeviceArray) else buffer.data_ptr()
