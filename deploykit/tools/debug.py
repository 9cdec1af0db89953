"""``deploykit debug BUNDLE``: read a converted bundle, compare it layer by layer, or auto-fix it.

The bundle holds the typed graph, the fp32 graph it came from (``model.fp32.onnx``) and our op
library; this module turns them into the inputs of :mod:`deploykit.validation.layerwise` and
:mod:`deploykit.validation.auto_fix`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from deploykit.bundle import read, trust
from deploykit.bundle.format import REFERENCE_MODEL, REPORT
from deploykit.errors import BadInputError
from deploykit.passes.precision import FLOAT, emulate
from deploykit.specs import InputSpec
from deploykit.validation.auto_fix import FixProblem, FixResult, auto_fix
from deploykit.validation.compare import Tolerance
from deploykit.validation.inputs import load_feeds, random_feeds
from deploykit.validation.layerwise import LayerDiff, compare_layers, run_values


@dataclasses.dataclass
class BundleGraphs:
    """What ``deploykit debug`` reads from a bundle."""

    path: Path
    manifest: dict
    model: onnx.ModelProto
    reference: onnx.ModelProto | None
    op_library: Path | None
    precision: str
    io_precision: str | None
    notes: list[str] = dataclasses.field(default_factory=list)  # what differs from the conversion, as a runner's


def open_bundle(path: Path, trust_native: bool = False) -> BundleGraphs:
    """The bundle's graphs and op library: debug examines graphs whatever their sha256 (one may have
    been edited since conversion), but the op library is native code, so it is verified and goes
    through the trust decision like every loader's (noting a foreign one swapped for this machine's build)."""
    bundle = read.open_bundle(path)
    if bundle.precision == "int8":  # its per-node rounding is not the fp16 emulation debug compares
        raise BadInputError("deploykit debug does not examine int8 bundles yet; deploykit validate BUNDLE MODEL "
                            "compares one with PyTorch output by output")
    reference = _file_if_present(bundle, bundle.manifest.get("reference_model") or REFERENCE_MODEL)
    notes: list[str] = []
    library = trust.op_library(bundle, trust_native=trust_native, notes=notes) if bundle.op_library else None
    return BundleGraphs(
        bundle.path, bundle.manifest, onnx.load(bundle.file(bundle.model, verify=False)),
        onnx.load(reference) if reference else None, library, bundle.precision, _io_precision(bundle), notes,
    )


def _file_if_present(bundle: read.Bundle, name: str) -> Path | None:
    return bundle.file(name, verify=False) if (bundle.path / name).is_file() else None


def _io_precision(bundle: read.Bundle) -> str | None:
    """From the manifest; bundles written before it recorded io_precision have it in report.json only."""
    if "io_precision" in bundle.manifest:
        return bundle.manifest["io_precision"]
    report = _file_if_present(bundle, REPORT)
    return json.loads(report.read_text()).get("precision", {}).get("io_precision") if report else None


def bundle_feeds(bundle: BundleGraphs, feeds_path: Path | None, seed: int, batch: int | None) -> dict:
    """The user's .npz, or seeded random inputs at ``batch`` (default: the largest validated); floats are
    compared in float32, so a user's float64 array is refused unless float32 holds it exactly."""
    specs = []
    sizes = bundle.manifest.get("validation", {}).get("batch_sizes") or [1]
    for entry in bundle.manifest["inputs"]:
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in entry["shape"]]
        shape[0] = batch or max(sizes)
        kind = np.dtype(entry["dtype"]).kind if entry["dtype"] != "bfloat16" else "f"
        specs.append(InputSpec(entry["name"], tuple(shape), "float32" if kind == "f" else entry["dtype"]))
    if feeds_path is not None:
        return load_feeds(feeds_path, specs)
    return random_feeds(specs, seed)


def layerwise(bundle: BundleGraphs, feeds: dict, reference: onnx.ModelProto | None = None) -> list[LayerDiff]:
    """Node-by-node diffs of the bundle's graph against ``reference``.

    Reduced precision: the rounding emulation of model.onnx against the fp32 graph it came
    from. fp32: model.onnx as deployed (our op library, ONNX Runtime's rewrites) against
    ``reference``, by default model.onnx without either (the ONNX semantics).
    """
    graph = ir.serde.deserialize_graph(bundle.model.graph)
    if bundle.precision != "fp32":
        expected = run_values(reference or _need_reference(bundle), feeds, bundle.op_library)
        actual = run_values(emulate(bundle.model), feeds, bundle.op_library)
    else:
        expected = run_values(reference or bundle.model, feeds, None, optimize=False)
        actual = run_values(bundle.model, feeds, bundle.op_library)
    return compare_layers(graph, expected, actual, Tolerance.for_precision(bundle.precision))


def fix_bundle(bundle: BundleGraphs, feeds: dict, max_pinned: int = 16,
               reference: onnx.ModelProto | None = None) -> FixResult:
    """Auto-fix a reduced-precision bundle, starting from the fp32 nodes it already has."""
    fp32 = reference or _need_reference(bundle)
    expected = run_values(fp32, feeds, bundle.op_library)
    outputs = [o.name for o in fp32.graph.output]
    tolerances = {name: Tolerance.for_precision(bundle.precision) for name in outputs}
    problem = FixProblem(fp32, bundle.precision, bundle.io_precision, {}, feeds,
                         {name: expected[name] for name in outputs}, tolerances, bundle.op_library,
                         keep_fp32=dict.fromkeys(fp32_node_names(bundle.model), "fp32 in the bundle"),
                         fp32_values=expected)
    return auto_fix(problem, max_pinned)


def fp32_node_names(model: onnx.ModelProto) -> list[str]:
    """Nodes of a typed graph that compute in fp32 (Casts aside)."""
    graph = ir.serde.deserialize_graph(model.graph)
    return [node.name for node in graph
            if node.op_type != "Cast" and any(v.dtype == FLOAT for v in node.outputs)]


def _need_reference(bundle: BundleGraphs) -> onnx.ModelProto:
    if bundle.reference is None:
        raise BadInputError(f"{bundle.path} has no {REFERENCE_MODEL}: convert it again with this deploykit, "
                            "or give the fp32 graph with --reference")
    return bundle.reference
