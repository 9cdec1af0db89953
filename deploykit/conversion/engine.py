"""The TensorRT stage of a conversion: build an engine from the optimized graph, with our
plugins embedded, and run it for validation where this machine can.

Kept apart from the pipeline because everything here is optional: it runs only for
``--backend tensorrt`` or ``all``, and imports TensorRT only then.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx

from deploykit.bundle.format import cached_sha256
from deploykit.native import build as native
from deploykit.backends.tensorrt.builder import EngineBuild, build_engine
from deploykit.backends.tensorrt.compat import engine_problem_here
from deploykit.backends.tensorrt.runner import TensorRTRunner
from deploykit.backends.tensorrt.failures import EngineBuildError, refused_targets
from deploykit.backends.tensorrt.shim import load_tensorrt, local_gpus
from deploykit.errors import EnvironmentProblem
from deploykit.ops import DOMAIN, custom_op_types
from deploykit.specs import BatchRange, InputSpec

#: float8 tensor cores: Ada (8.9), Hopper, Blackwell; TensorRT refuses fp8 layers for older targets
FP8_CAPABILITY = ("8.9", "fp8 engines need compute capability 8.9 or newer (Ada, Hopper, Blackwell)")


@dataclasses.dataclass
class EngineStage:
    """An engine ready for the bundle, its runner (None when it cannot run here) and notes."""

    build: EngineBuild
    file_name: str
    plugin_sha256: str | None
    runner: TensorRTRunner | None
    run_note: str

    def to_json(self) -> dict:
        return {
            "file": self.file_name,
            "flavour": self.build.flavour,
            "version": self.build.version,
            "targets": list(self.build.targets),
            "skipped_targets": [failure.to_json() for failure in self.build.skipped],
            "plugin_library_sha256": self.plugin_sha256,
            "plugin_layers": len(self.build.plugin_layers),
            "plugin_layer_list": [dict(layer) for layer in self.build.plugin_layers],
            "layers": len(self.build.layers),
            "validated": self.runner is not None,
            "note": self.run_note,
        }


def build_tensorrt_stage(
    model: onnx.ModelProto,
    specs: list[InputSpec],
    batch: BatchRange | None,
    targets: list[str] | None,
    workspace_bytes: int | None,
    precision: str = "fp32",
) -> EngineStage:
    plugin_library = _plugin_library(model)
    try:
        build = build_engine(
            model.SerializeToString(),
            plugin_library=plugin_library,
            batch=(batch.min, batch.opt, batch.max) if batch else None,
            input_shapes={spec.name: spec.shape for spec in specs},
            targets=targets,
            workspace_bytes=workspace_bytes,
            timing_cache=native.cache_dir() / f"{build_flavour_key()}.timing-cache",
            min_capability=FP8_CAPABILITY if precision == "fp8" else None,
        )
    except EngineBuildError as error:
        fixes = " or ".join(_fixes(error, model, precision))
        raise EngineBuildError(f"{error}; to get an engine: {fixes}", error.failures, error.targets,
                               error.choices) from error
    if plugin_library is not None and len(build.plugin_layers) != _custom_node_count(model):
        raise EnvironmentProblem(
            f"TensorRT made {len(build.plugin_layers)} plugin layers for {_custom_node_count(model)} deploykit "
            "nodes: our plugins did not replace every node; run deploykit build-plugins --force"
        )
    problem = engine_problem_here(build.requirements())
    runner = None if problem else TensorRTRunner.from_build(build)
    note = f"engine built but not executed: {problem}" if problem else f"validated on {_where(build)}"
    sha = cached_sha256(plugin_library) if plugin_library else None  # once, though auto-fix builds again
    targets_text = "_".join("sm" + t.replace(".", "") for t in build.targets)
    return EngineStage(build, f"model.{precision}.{targets_text}.engine", sha, runner, note)


def _fixes(error: EngineBuildError, model: onnx.ModelProto, precision: str) -> list[str]:
    """The convert options that avoid what TensorRT refused: other targets, fp16, no plugins."""
    fixes = []
    refused = refused_targets(error.failures)
    others = [t for t in error.targets if t not in refused] or [t for t in error.choices if t not in refused]
    if refused and error.choices and others:
        fixes.append(f"--trt-targets {','.join(others)} (without {', '.join(refused)})")
    if precision == "fp32" and any(f.target or "fp32" in f.reason.lower() for f in error.failures):
        fixes.append("--precision fp16")  # the per-target refusals TensorRT-RTX 1.7 makes are of fp32 layers
    ours = {node.name for node in model.graph.node if node.domain == DOMAIN}
    if ours and any(f.layer is None or f.layer in ours for f in error.failures):
        fixes.append("--no-custom-ops")
    return [*fixes, "--backend onnxruntime (no engine)"]


def _where(build: EngineBuild) -> str:
    """The TensorRT and GPU an engine was validated on, e.g. "TensorRT 10.14.1 on NVIDIA H200 (compute capability 9.0)"."""
    name, capability = local_gpus()[0]
    return f"{load_tensorrt(build.flavour).label} on {name} (compute capability {capability})"


def build_flavour_key() -> str:
    flavour = load_tensorrt()
    return f"{flavour.name}-{flavour.version}"


def _custom_node_count(model: onnx.ModelProto) -> int:
    return sum(1 for node in model.graph.node if node.op_type in custom_op_types(model))


def _plugin_library(model: onnx.ModelProto) -> Path | None:
    """Our plugin library when the graph has deploykit nodes; a clear error if it cannot be built."""
    if not custom_op_types(model):
        return None
    build = native.build_plugins()
    if build.tensorrt_library is None:
        raise EnvironmentProblem(
            f"the graph uses {', '.join(custom_op_types(model))} but deploykit's TensorRT plugins are not "
            f"available ({build.disabled.get('tensorrt')}); install what is named, or pass --no-custom-ops"
        )
    return build.tensorrt_library
