"""TensorRT and TensorRT-RTX: build engines from deploykit's ONNX, inspect and run them.

One shim over two Python APIs that share most of their surface:

- ``tensorrt`` (TensorRT >= 10, ``pip install tensorrt``): builds for the GPU it runs on, so it
  needs one. A plugin library travels inside the engine only in version-compatible engines, so
  ``VERSION_COMPATIBLE`` is set when one is given (and the runtime must allow host code).
- TensorRT-RTX (``tensorrt_rtx``, or ``tensorrt_rtx_bindings`` when only the
  ``tensorrt-rtx-cu13-libs`` + ``-bindings`` wheels are installed): builds ahead of time, also
  on a machine without a GPU, for the compute capabilities it is told (``ComputeCapability``:
  Turing, Ampere, Ada, Blackwell RTX; not Hopper 9.0 nor 10.x), and compiles kernels when the
  engine first runs (kept across runs by a runtime cache, not a timing cache). It always embeds
  ``plugins_to_serialize``.

Both are strongly typed here: precision comes from the ONNX model, never from builder flags
(TensorRT 11 and RTX have no FP16/INT8 flags at all).
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from deploykit.errors import BadInputError, DeployKitError, EnvironmentProblem
from deploykit.native.stderr import captured_stderr

INSTALL_HINT = (
    "pip install tensorrt (TensorRT >= 10, needs an NVIDIA GPU) or "
    "pip install tensorrt-rtx-cu13-libs tensorrt-rtx-cu13-bindings (TensorRT-RTX, builds without a GPU)"
)
PLUGIN_OPS = ("FusedBatchNorm", "MatMulRelu")


@dataclass(frozen=True)
class Flavour:
    """An imported TensorRT Python module and what kind it is."""

    module: object
    name: str  # "tensorrt" | "tensorrt-rtx"
    version: str

    @property
    def is_rtx(self) -> bool:
        return self.name == "tensorrt-rtx"

    @property
    def label(self) -> str:
        return f"{'TensorRT-RTX' if self.is_rtx else 'TensorRT'} {self.version}"


@dataclass(frozen=True)
class EngineBuild:
    """A serialized engine and how it was made.

    ``layers`` lists the network the parser made (name, type; plugin layers also plugin,
    version and config): what the engine was built from, readable without a GPU.
    """

    engine: bytes
    flavour: str
    version: str
    targets: tuple[str, ...]
    layers: tuple[dict, ...] = ()
    plugin_library: str | None = None
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def plugin_layers(self) -> tuple[dict, ...]:
        return tuple(layer for layer in self.layers if "plugin" in layer)


_CANDIDATES = (("tensorrt", "tensorrt"), ("tensorrt_rtx", "tensorrt-rtx"), ("tensorrt_rtx_bindings", "tensorrt-rtx"))


@lru_cache(maxsize=None)
def load_tensorrt(flavour: str | None = None) -> Flavour:
    """The first usable module: plain TensorRT first (users' GPU machines), then TensorRT-RTX."""
    problems = []
    for module_name, name in _CANDIDATES:
        if flavour not in (None, name) or importlib.util.find_spec(module_name) is None:
            continue
        try:
            module = importlib.import_module(module_name)
            version = str(module.__version__)
            module.Builder  # the PyPI stubs of TensorRT import but have no API
        except Exception as error:  # noqa: BLE001 - broken installs raise anything
            problems.append(f"{module_name}: {str(error).splitlines()[0] if str(error) else type(error).__name__}")
            continue
        if name == "tensorrt" and int(version.split(".")[0]) < 10:
            problems.append(f"tensorrt {version} is older than 10")
            continue
        return Flavour(module, name, version)
    found = f" ({'; '.join(problems)})" if problems else ""
    wanted = f"{flavour} " if flavour else ""
    raise EnvironmentProblem(f"no usable {wanted}TensorRT for Python{found}: {INSTALL_HINT}")


def ensure_rtx_library_link() -> Path | None:
    """Create ``libtensorrt_rtx.so`` beside ``libtensorrt_rtx.so.1`` in the RTX libs wheel.

    The wheel ships only the versioned name, but RTX's ONNX parser dlopens the unversioned one
    when it meets a plugin node, and aborts the process when that fails.
    """
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec is None or not spec.submodule_search_locations:
        return None  # not the wheel (a tarball or system install has its own links)
    directory = Path(next(iter(spec.submodule_search_locations)))
    link, target = directory / "libtensorrt_rtx.so", directory / "libtensorrt_rtx.so.1"
    if not target.exists() or link.exists():
        return link if link.exists() else None
    try:
        if link.is_symlink():  # dangling
            link.unlink()
        link.symlink_to(target.name)
    except FileExistsError:
        pass
    except OSError as error:
        raise EnvironmentProblem(
            f"TensorRT-RTX's parser needs {link} to load plugins and it cannot be created "
            f"({error.strerror}): run `ln -s {target.name} {link}` as the owner of that folder"
        ) from error
    return link


# --- logging -------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _logger(flavour: Flavour):
    """One logger per module (TensorRT warns when builder and runtime get different ones)."""
    trt = flavour.module

    class CollectingLogger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.messages: list[tuple[int, str]] = []

        def log(self, severity, message):
            if int(severity) <= int(trt.ILogger.Severity.WARNING):
                self.messages.append((int(severity), message))

        def take(self) -> tuple[list[str], list[str]]:
            errors = [m for s, m in self.messages if s <= int(trt.ILogger.Severity.ERROR)]
            warnings = [m for s, m in self.messages if s > int(trt.ILogger.Severity.ERROR)]
            self.messages.clear()
            return errors, warnings

    return CollectingLogger()


def local_gpus() -> tuple[tuple[str, str], ...] | str:
    """(name, "major.minor") of each visible GPU, from the driver; or why there are none."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver here (libcuda.so.1 not found)"
    if cuda.cuInit(0) != 0:
        return "the NVIDIA driver sees no usable GPU (cuInit failed)"
    count = ctypes.c_int()
    cuda.cuDeviceGetCount(ctypes.byref(count))
    gpus = []
    for ordinal in range(count.value):
        device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        name = ctypes.create_string_buffer(256)
        cuda.cuDeviceGet(ctypes.byref(device), ordinal)
        cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device)  # COMPUTE_CAPABILITY_MAJOR
        cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device)  # COMPUTE_CAPABILITY_MINOR
        cuda.cuDeviceGetName(name, 256, device)
        gpus.append((name.value.decode(), f"{major.value}.{minor.value}"))
    return tuple(gpus) if gpus else "the NVIDIA driver sees no GPU"


def rtx_targets(flavour: Flavour) -> tuple[str, ...]:
    """Compute capabilities this TensorRT-RTX can build for, e.g. ("7.5", ..., "12.0")."""
    names = [n for n in flavour.module.ComputeCapability.__members__ if n.startswith("SM")]
    return tuple(f"{n[2:-1]}.{n[-1]}" for n in names)


def _set_targets(flavour: Flavour, config, targets: Sequence[str] | None) -> tuple[str, ...]:
    gpus = local_gpus()
    if not flavour.is_rtx:
        local = gpus[0][1]  # build_engine checked there is a GPU
        if targets and set(targets) != {local}:
            raise BadInputError(f"{flavour.label} builds for this GPU only (compute capability {local}); "
                                f"targets {list(targets)} need TensorRT-RTX")
        return (local,)
    supported = rtx_targets(flavour)
    if not targets:  # the local GPU where there is one, else every target RTX knows
        targets = [gpus[0][1]] if not isinstance(gpus, str) and gpus[0][1] in supported else supported
    unknown = [t for t in targets if t not in supported]
    if unknown:
        raise BadInputError(f"{flavour.label} cannot build for compute capability {', '.join(unknown)}; "
                            f"it supports {', '.join(supported)}")
    config.num_compute_capabilities = len(targets)
    for index, target in enumerate(targets):
        capability = getattr(flavour.module.ComputeCapability, "SM" + target.replace(".", ""))
        config.set_compute_capability(capability, index)
    return tuple(targets)


# --- building ------------------------------------------------------------------------------


def load_plugin_library(path: str | os.PathLike, flavour: str | None = None) -> str:
    """Register our plugin creators with TensorRT's global registry (once per path); the
    resolved path. The parser finds them there by op type, name space "" and version "1"."""
    library = str(Path(path).resolve())
    if not Path(library).is_file():
        raise EnvironmentProblem(f"TensorRT plugin library {library} does not exist: build it first")
    _register(load_tensorrt(flavour), library)
    return library


@lru_cache(maxsize=None)
def _register(flavour: Flavour, library: str):
    handle = flavour.module.get_plugin_registry().load_library(library)
    if handle is None:
        errors, _ = _logger(flavour).take()
        raise EnvironmentProblem(f"{flavour.label} cannot load {library}: {'; '.join(errors) or 'no reason given'}")
    return handle


def _parser_error_text(parser, plugin_lines: list[str]) -> str:
    errors = []
    for index in range(parser.num_errors):
        error = parser.get_error(index)
        name = error.node_name() or f"#{error.node()}"
        errors.append(f"node {name} ({error.node_operator()}): {error.desc()}")
    ours = [line for line in plugin_lines if line.startswith("deploykit plugin:")]
    return "; ".join(errors + ours) or "no reason given"


def _profile_shapes(network, batch, input_shapes: Mapping[str, Sequence[int]]):
    """(name, min, opt, max) for each input; None when every input is static."""
    shapes, dynamic = [], False
    for index in range(network.num_inputs):
        tensor = network.get_input(index)
        dims = list(input_shapes.get(tensor.name, tensor.shape))
        ranges = [[d, d, d] for d in dims]
        if dims and tensor.shape[0] == -1 and batch:
            ranges[0] = list(batch)
        if any(r[0] < 0 for r in ranges):
            raise BadInputError(f"input {tensor.name} has dynamic dimensions {list(tensor.shape)}: "
                                "give a batch range and the other dimensions in input_shapes")
        dynamic |= any(d < 0 for d in tensor.shape)
        shapes.append((tensor.name, *(tuple(r[i] for r in ranges) for i in range(3))))
    return shapes if dynamic else None


def _network_layers(flavour: Flavour, network) -> tuple[dict, ...]:
    """Each layer's name and type; plugin layers add plugin name, version and config text."""
    trt, layers = flavour.module, []
    for index in range(network.num_layers):
        layer = network.get_layer(index)
        entry = {"name": layer.name, "type": layer.type.name}
        if layer.type == trt.LayerType.PLUGIN_V3:
            layer.__class__ = trt.IPluginV3Layer  # the bindings hand out the ILayer base
            core = layer.plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
            build = layer.plugin.get_capability_interface(trt.PluginCapabilityType.BUILD)
            entry.update(plugin=core.plugin_name, version=core.plugin_version,
                         config=getattr(build, "metadata_string", None))
        layers.append(entry)
    return tuple(layers)


def build_engine(
    model: str | os.PathLike | bytes,
    *,
    plugin_library: str | os.PathLike | None = None,
    batch: tuple[int, int, int] | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    targets: Sequence[str] | None = None,
    workspace_bytes: int | None = None,
    timing_cache: str | os.PathLike | None = None,
    flavour: str | None = None,
) -> EngineBuild:
    """Build a serialized engine from an ONNX file (path, so external data works) or bytes.

    With ``plugin_library`` our plugins replace deploykit nodes (ENABLE_PLUGIN_OVERRIDE beats
    the ONNX local functions) and the library is embedded so the engine file stands alone;
    without it the parser inlines the functions. ``batch`` = (min, opt, max) of axis 0 of
    every input whose axis 0 is dynamic; ``input_shapes`` fixes other dynamic dimensions.
    ``targets`` = compute capabilities ("8.6", "12.0") for TensorRT-RTX; plain TensorRT builds
    for the local GPU.
    """
    flv = load_tensorrt(flavour)
    trt, logger = flv.module, _logger(flv)
    logger.take()
    if not flv.is_rtx and isinstance(local_gpus(), str):
        raise EnvironmentProblem(f"{flv.label} builds for the local GPU and {local_gpus()}; TensorRT-RTX "
                                 "builds without one: pip install tensorrt-rtx-cu13-libs tensorrt-rtx-cu13-bindings")
    builder = trt.Builder(logger)
    library = load_plugin_library(plugin_library, flv.name) if plugin_library else None
    creation = trt.NetworkDefinitionCreationFlag
    flags = 1 << int(creation.STRONGLY_TYPED) if "STRONGLY_TYPED" in creation.__members__ else 0
    network = builder.create_network(flags)
    if flv.is_rtx:
        ensure_rtx_library_link()
    parser = trt.OnnxParser(network, logger)
    if library:
        parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
    native: list[str] = []
    with captured_stderr(native):
        if isinstance(model, (bytes, bytearray, memoryview)):
            parsed = parser.parse(bytes(model))
        else:
            parsed = parser.parse_from_file(str(model))
    if not parsed:
        raise DeployKitError(f"{flv.label} cannot parse the model: {_parser_error_text(parser, native)}")

    config = builder.create_builder_config()
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED  # layer details for inspect_engine
    if workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    shapes = _profile_shapes(network, batch, input_shapes or {})
    if shapes:
        profile = builder.create_optimization_profile()
        for name, low, opt, high in shapes:
            profile.set_shape(name, low, opt, high)
        config.add_optimization_profile(profile)
    built_targets = _set_targets(flv, config, targets)
    if library:
        config.plugins_to_serialize = [library]
        if not flv.is_rtx:
            config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    cache = None
    if timing_cache is not None and hasattr(config, "create_timing_cache"):
        cache_path = Path(timing_cache)
        cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
        config.set_timing_cache(cache, ignore_mismatch=True)

    with captured_stderr(native):
        serialized = builder.build_serialized_network(network, config)
    errors, warnings = logger.take()
    if serialized is None:
        detail = "; ".join(errors + [line for line in native if line.startswith("deploykit plugin:")])
        raise DeployKitError(f"{flv.label} could not build the engine: {detail or 'no reason given'}")
    if cache is not None:
        Path(timing_cache).write_bytes(bytes(cache.serialize()))
    return EngineBuild(
        engine=bytes(serialized), flavour=flv.name, version=flv.version, targets=built_targets,
        layers=_network_layers(flv, network), plugin_library=library, warnings=tuple(warnings),
    )


# --- running -------------------------------------------------------------------------------


def can_run_here(build: EngineBuild | None = None, flavour: str | None = None) -> tuple[bool, str]:
    """Whether an engine (of ``build``, else any) can run on this machine, and why not."""
    try:
        flv = load_tensorrt(build.flavour if build else flavour)
    except EnvironmentProblem as problem:
        return False, str(problem)
    gpus = local_gpus()
    if isinstance(gpus, str):
        return False, f"{flv.label} needs an NVIDIA GPU to run engines and {gpus}"
    name, capability = gpus[0]
    if flv.is_rtx and capability not in rtx_targets(flv):
        return False, (f"{flv.label} does not run on compute capability {capability} ({name}); it runs on "
                       f"{', '.join(rtx_targets(flv))} (RTX-class GPUs)")
    if build and build.targets and capability not in build.targets:
        return False, f"the engine was built for {', '.join(build.targets)}, this {name} is {capability}"
    return True, f"{flv.label} on {name} (compute capability {capability})"


def _deserialize(flv: Flavour, engine: bytes):
    runtime = flv.module.Runtime(_logger(flv))
    runtime.engine_host_code_allowed = True  # the embedded plugin library is host code
    deserialized = runtime.deserialize_cuda_engine(engine)
    if deserialized is None:
        errors, _ = _logger(flv).take()
        ok, reason = can_run_here(flavour=flv.name)
        raise EnvironmentProblem(f"{flv.label} cannot load the engine: {reason if not ok else '; '.join(errors)}")
    return runtime, deserialized


def inspect_engine(engine: EngineBuild | bytes, flavour: str | None = None) -> list[dict]:
    """Layers of an engine from the engine inspector (JSON; details need a DETAILED build).

    Deserializing needs a GPU the engine can run on: on a CPU-only machine use
    ``EngineBuild.plugin_layers`` instead.
    """
    flv = load_tensorrt(engine.flavour if isinstance(engine, EngineBuild) else flavour)
    data = engine.engine if isinstance(engine, EngineBuild) else engine
    _runtime, deserialized = _deserialize(flv, data)
    inspector = deserialized.create_engine_inspector()
    info = json.loads(inspector.get_engine_information(flv.module.LayerInformationFormat.JSON))
    return [layer if isinstance(layer, dict) else {"Name": layer} for layer in info.get("Layers", [])]


def is_plugin_layer(layer: dict) -> bool:
    """Whether an inspector layer dict is one of our plugins."""
    text = json.dumps(layer)
    return "PluginV3" in text or any(op in text for op in PLUGIN_OPS)


class TensorRTRunner:
    """Runs an engine on the GPU, fed and read by name (tensors move through torch.cuda).

    ``runtime_cache`` (TensorRT-RTX) keeps the kernels RTX compiles on first run across runs.
    """

    def __init__(self, engine: EngineBuild | bytes, flavour: str | None = None,
                 runtime_cache: str | os.PathLike | None = None):
        build = engine if isinstance(engine, EngineBuild) else None
        self.flavour = load_tensorrt(build.flavour if build else flavour)
        ok, reason = can_run_here(build, self.flavour.name)
        if not ok:
            raise EnvironmentProblem(f"cannot run the TensorRT engine here: {reason}")
        import torch

        if not torch.cuda.is_available():
            raise EnvironmentProblem("the TensorRT runner moves tensors with torch: install a CUDA build of torch")
        torch.cuda.init()  # RTX's runtime cache wants a current CUDA context
        self._torch, self._stream = torch, torch.cuda.Stream()
        self._runtime, self.engine = _deserialize(self.flavour, build.engine if build else engine)
        self._cache_path = Path(runtime_cache) if runtime_cache else None
        self._cache = None
        if self.flavour.is_rtx:
            runtime_config = self.engine.create_runtime_config()
            if self._cache_path:
                self._cache = runtime_config.create_runtime_cache()
                if self._cache_path.is_file():
                    self._cache.deserialize(self._cache_path.read_bytes())
                runtime_config.set_runtime_cache(self._cache)
            self.context = self.engine.create_execution_context(runtime_config)
        else:
            self.context = self.engine.create_execution_context()
        trt = self.flavour.module
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.input_names = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if n not in self.input_names]
        self.name = self.flavour.name

    def _torch_dtype(self, name: str):
        trt, torch = self.flavour.module, self._torch
        table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                 trt.int32: torch.int32, trt.int64: torch.int64, trt.int8: torch.int8,
                 trt.uint8: torch.uint8, trt.bool: torch.bool}
        return table[self.engine.get_tensor_dtype(name)]

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        with torch.cuda.stream(self._stream):  # TensorRT slows down on the default stream
            inputs = {n: torch.as_tensor(feeds[n]).to("cuda", self._torch_dtype(n)).contiguous()
                      for n in self.input_names}
            for name, tensor in inputs.items():
                self.context.set_input_shape(name, tuple(tensor.shape))
                self.context.set_tensor_address(name, tensor.data_ptr())
            outputs = {n: torch.empty(tuple(self.context.get_tensor_shape(n)), dtype=self._torch_dtype(n),
                                      device="cuda") for n in self.output_names}
            for name, tensor in outputs.items():
                self.context.set_tensor_address(name, tensor.data_ptr())
            if not self.context.execute_async_v3(self._stream.cuda_stream):
                errors, _ = _logger(self.flavour).take()
                raise DeployKitError(f"{self.flavour.label} failed to run the engine: {'; '.join(errors)}")
        self._stream.synchronize()
        return {n: (t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy() for n, t in outputs.items()}

    def close(self) -> None:
        """Write the runtime cache back (RTX), so the next run skips kernel compilation."""
        if self._cache is not None and self._cache_path is not None:
            self._cache_path.write_bytes(bytes(self._cache.serialize()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
