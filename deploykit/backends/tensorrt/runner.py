"""The TensorRT runner, and whether a bundle's engine can run here at all: engines run only
on the TensorRT version and GPUs they were built for.
"""

from __future__ import annotations

import numpy as np

from deploykit.errors import DeployKitError, EnvironmentProblem
from deploykit.bundle.read import Bundle
from deploykit.backends.base.feeds import DeviceArray, check_batch_range, collect_feeds, output_kind
from deploykit.backends.base.memory import device_memory
from deploykit.backends.base.runner import Runner

TRT_PIP = {"tensorrt": "tensorrt=={v}", "tensorrt-rtx": "tensorrt-rtx-cu13-libs=={v} tensorrt-rtx-cu13-bindings=={v}"}


class TensorRTBundleRunner(Runner):
    """The bundle's TensorRT engine (plugins embedded) on this GPU, fed by device pointer."""

    backend = "tensorrt"

    def __init__(self, bundle: Bundle, entry: dict, device_id: int = 0, *, verify: bool = True,
                 notes: list[str] | None = None):
        from deploykit.backends.tensorrt import builder as tensorrt

        super().__init__(bundle, "cuda", list(notes or []))
        problem = engine_problem(entry, installed_tensorrt(entry["flavour"]), tensorrt.local_gpus())
        if problem:
            raise EnvironmentProblem(f"cannot run {entry['file']} here: {problem}")
        if not entry.get("validated"):
            self._warn(f"{entry['file']} was not run at conversion time ({entry.get('note', '')}); "
                              "its outputs were validated only through ONNX Runtime")
        self.entry, self.flavour = entry, tensorrt.load_tensorrt(entry["flavour"])
        self.memory = device_memory(device_id)
        path = bundle.file(entry["file"], verify)
        self._runtime, self.engine = tensorrt._deserialize(self.flavour, path.read_bytes())
        self._cache, self._cache_path = None, None
        self.context = self._create_context(tensorrt, entry)

    def _create_context(self, tensorrt, entry: dict):
        if not self.flavour.is_rtx:
            return self.engine.create_execution_context()
        from deploykit.native import build as native  # RTX compiles kernels on first run: keep them across runs

        config = self.engine.create_runtime_config()
        self._cache_path = native.cache_dir() / "runtime-cache" / f"{self.bundle.manifest['files'][entry['file']]['sha256'][:16]}.bin"
        self._cache = config.create_runtime_cache()
        if self._cache_path.is_file():
            self._cache.deserialize(self._cache_path.read_bytes())
        config.set_runtime_cache(self._cache)
        return self.engine.create_execution_context(config)

    def describe(self) -> dict:
        return {**super().describe(), "engine": self.entry["file"], "tensorrt": self.flavour.label,
                "memory": self.memory.name}

    def _dtype(self, name: str) -> np.dtype:
        return np.dtype(self.flavour.module.nptype(self.engine.get_tensor_dtype(name)))

    def run(self, feeds=None, /, **named) -> dict:
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
            from deploykit.backends.tensorrt import builder as tensorrt

            errors, _ = tensorrt._logger(self.flavour).take()
            raise DeployKitError(f"{self.flavour.label} failed to run {self.entry['file']}: {'; '.join(errors)}")
        if kind != "torch":
            self.memory.synchronize()
        return {name: self.memory.deliver(buffer, kind, device) for name, buffer in outputs.items()}

    def close(self) -> None:
        if self._cache is not None:
            self._cache_path.parent.mkdir(parents=True, exist_ok=True)
            self._cache_path.write_bytes(bytes(self._cache.serialize()))


def _pointer(buffer) -> int:
    return buffer.pointer if isinstance(buffer, DeviceArray) else buffer.data_ptr()


def installed_tensorrt(flavour: str) -> tuple[str | None, tuple[str, ...] | None]:
    """(version, RTX's supported compute capabilities or None) of an installed flavour; (None, None) if absent."""
    from deploykit.backends.tensorrt import builder as tensorrt

    try:
        module = tensorrt.load_tensorrt(flavour)
    except EnvironmentProblem:
        return None, None
    return module.version, tensorrt.rtx_targets(module) if module.is_rtx else None


def engine_problem(entry: dict, installed: tuple[str | None, tuple[str, ...] | None], gpus) -> str | None:
    """Why this machine cannot run a bundle's engine (None: it can). Pure, for doctor and tests.

    ``installed`` is ``installed_tensorrt(flavour)``; ``gpus`` is ``tensorrt.local_gpus()``:
    ((name, "major.minor"), ...) or the reason there is no GPU.
    """
    flavour, built = entry["flavour"], entry["version"]
    label = "TensorRT-RTX" if flavour == "tensorrt-rtx" else "TensorRT"
    version, rtx_targets = installed
    install = TRT_PIP[flavour].format(v=built)
    if version is None:
        return f"{label} is not installed: pip install {install}"
    if version != built:
        return (f"it was built with {label} {built} and this machine has {version}; engines run on the version "
                f"that built them: pip install {install}, or re-run deploykit convert --backend tensorrt here")
    if isinstance(gpus, str) or not gpus:
        return f"{label} engines need an NVIDIA GPU and {gpus or 'there is none'}"
    name, capability = gpus[0]
    if rtx_targets is not None and capability not in rtx_targets:
        return (f"{label} does not run on compute capability {capability} ({name}); it supports "
                f"{', '.join(rtx_targets)}: install full TensorRT (pip install tensorrt) and convert with it here")
    if capability not in entry.get("targets", []):
        return (f"the engine was built for compute capability {', '.join(entry.get('targets', []))} and this "
                f"{name} is {capability}: convert with --trt-targets {capability}")
    return None
