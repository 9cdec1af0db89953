"""Build TensorRT / TensorRT-RTX engines from deploykit's ONNX, with our plugins embedded.

Both flavours are strongly typed here: precision comes from the ONNX model, never from builder
flags (TensorRT 11 and RTX have no FP16/INT8 flags at all). Which flavour and GPU: ``shim``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Mapping, Sequence

from deploykit.errors import BadInputError, EnvironmentProblem
from deploykit.native.stderr import captured_stderr
from deploykit.backends.tensorrt.failures import EngineBuildError, LayerFailure, layer_failures, refused_targets
from deploykit.backends.tensorrt.shim import Flavour, ensure_rtx_library_link, load_tensorrt, local_gpus, logger, rtx_targets


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
    skipped: tuple[LayerFailure, ...] = ()  # targets left out because TensorRT refused a layer for them
    plugin_library: str | None = None
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def requirements(self) -> dict:
        """What the engine needs to run, as a bundle's engine entry says it (see ``compat``)."""
        return {"flavour": self.flavour, "version": self.version, "targets": list(self.targets)}

    @property
    def plugin_layers(self) -> tuple[dict, ...]:
        return tuple(layer for layer in self.layers if "plugin" in layer)


def _choose_targets(flavour: Flavour, targets: Sequence[str] | None,
                    minimum: tuple[str, str] | None = None) -> tuple[str, ...]:
    """The compute capabilities to build for: the given ones, checked; else the local GPU's where
    RTX knows it, else every one RTX knows (the build then drops those the graph cannot use).
    ``minimum``: (the lowest compute capability the graph runs on, why), e.g. float8 types' 8.9:
    older targets are refused when named and left out of the default ones."""
    gpus = local_gpus()
    if not flavour.is_rtx:
        local = gpus[0][1]  # build_engine checked there is a GPU
        if targets and set(targets) != {local}:
            raise BadInputError(f"{flavour.label} builds for this GPU only (compute capability {local}); "
                                f"targets {list(targets)} need TensorRT-RTX")
        _check_minimum([local], minimum, "this GPU")
        return (local,)
    supported = rtx_targets(flavour)
    if not targets:
        usable = [t for t in supported if not minimum or _capability(t) >= _capability(minimum[0])]
        local = gpus[0][1] if not isinstance(gpus, str) and gpus[0][1] in usable else None
        targets = [local] if local else usable
    unknown = [t for t in targets if t not in supported]
    if unknown:
        raise BadInputError(f"{flavour.label} cannot build for compute capability {', '.join(unknown)}; "
                            f"it supports {', '.join(supported)}")
    _check_minimum(targets, minimum, "the targets asked for")
    return tuple(targets)


def _capability(target: str) -> tuple[int, ...]:
    return tuple(int(part) for part in target.split("."))


def _check_minimum(targets: Sequence[str], minimum: tuple[str, str] | None, where: str) -> None:
    if minimum is None:
        return
    lowest, why = minimum
    below = [t for t in targets if _capability(t) < _capability(lowest)]
    if below:
        raise BadInputError(f"{why}, not {', '.join(below)} ({where}): build for {lowest} or newer")


def _set_targets(flavour: Flavour, config, targets: Sequence[str]) -> None:
    if not flavour.is_rtx:
        return
    config.num_compute_capabilities = len(targets)
    for index, target in enumerate(targets):
        capability = getattr(flavour.module.ComputeCapability, "SM" + target.replace(".", ""))
        config.set_compute_capability(capability, index)


def _build_message(flavour: Flavour, failures: Sequence[LayerFailure], targets: Sequence[str]) -> str:
    """One line: what TensorRT refused, for which compute capabilities."""
    return (f"{flavour.label} cannot build the engine for compute capability {', '.join(targets)}: "
            f"{'; '.join(map(str, failures))}")


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
        errors, _ = logger(flavour).take()
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
    min_capability: tuple[str, str] | None = None,
) -> EngineBuild:
    """Build a serialized engine from an ONNX file (path, so external data works) or bytes.

    With ``plugin_library`` our plugins replace deploykit nodes (ENABLE_PLUGIN_OVERRIDE beats
    the ONNX local functions) and the library is embedded so the engine file stands alone;
    without it the parser inlines the functions. ``batch`` = (min, opt, max) of axis 0 of
    every input whose axis 0 is dynamic; ``input_shapes`` fixes other dynamic dimensions.
    ``targets`` = compute capabilities ("8.6", "12.0") for TensorRT-RTX; plain TensorRT builds
    for the local GPU. ``min_capability`` = (capability, why): targets below it are refused, left
    out of the default ones.
    """
    flv = load_tensorrt(flavour)
    trt, log = flv.module, logger(flv)
    log.take()
    if not flv.is_rtx and isinstance(local_gpus(), str):
        raise EnvironmentProblem(f"{flv.label} builds for the local GPU and {local_gpus()}; TensorRT-RTX "
                                 "builds without one: pip install tensorrt-rtx-cu13-libs tensorrt-rtx-cu13-bindings")
    builder = trt.Builder(log)
    library = load_plugin_library(plugin_library, flv.name) if plugin_library else None
    creation = trt.NetworkDefinitionCreationFlag
    flags = 1 << int(creation.STRONGLY_TYPED) if "STRONGLY_TYPED" in creation.__members__ else 0
    network = builder.create_network(flags)
    if flv.is_rtx:
        ensure_rtx_library_link()
    parser = trt.OnnxParser(network, log)
    if library:
        parser.set_flag(trt.OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE)
    native: list[str] = []
    with captured_stderr(native):
        if isinstance(model, (bytes, bytearray, memoryview)):
            parsed = parser.parse(bytes(model))
        else:
            parsed = parser.parse_from_file(str(model))
    if not parsed:
        reason = _parser_error_text(parser, native)
        raise EngineBuildError(f"{flv.label} cannot parse the model: {reason}", (LayerFailure(None, None, reason),), ())

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
    built_targets = _choose_targets(flv, targets, min_capability)
    if library:
        config.plugins_to_serialize = [library]
        if not flv.is_rtx:
            config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    cache = None
    if timing_cache is not None and hasattr(config, "create_timing_cache"):
        cache_path = Path(timing_cache)
        cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
        config.set_timing_cache(cache, ignore_mismatch=True)

    serialized, built_targets, skipped, warnings = _serialize(flv, builder, network, config, built_targets,
                                                             explicit=bool(targets))
    if cache is not None:
        Path(timing_cache).write_bytes(bytes(cache.serialize()))
    return EngineBuild(
        engine=bytes(serialized), flavour=flv.name, version=flv.version, targets=built_targets, skipped=skipped,
        layers=_network_layers(flv, network), plugin_library=library, warnings=tuple(warnings),
    )


def _serialize(flavour: Flavour, builder, network, config, targets: tuple[str, ...], explicit: bool):
    """(engine, targets built, targets skipped, warnings). A target TensorRT refuses a layer for is
    dropped and the build retried, unless the caller chose the targets: then it is an error."""
    skipped: list[LayerFailure] = []
    while True:
        _set_targets(flavour, config, targets)
        native: list[str] = []
        with captured_stderr(native):
            serialized = builder.build_serialized_network(network, config)
        errors, warnings = logger(flavour).take()
        if serialized is not None:
            return serialized, targets, tuple(skipped), warnings
        failures = layer_failures(errors + [line for line in native if line.startswith("deploykit plugin:")])
        refused = set(refused_targets(failures)) & set(targets)
        if explicit or not refused or refused == set(targets):
            failures = (*skipped, *failures)
            asked = tuple(dict.fromkeys([*refused_targets(skipped), *targets]))
            choices = rtx_targets(flavour) if flavour.is_rtx else ()
            raise EngineBuildError(_build_message(flavour, failures, asked), failures, asked, choices)
        skipped += [f for f in failures if f.target in refused]
        targets = tuple(t for t in targets if t not in refused)
