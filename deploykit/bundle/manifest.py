"""manifest.json: what a runtime needs to run a bundle, built from the conversion's state.

Readers (:mod:`deploykit.bundle.read`) rely on these keys; ``staged_bundle`` adds ``files``.
``io_precision`` is None where the inputs and outputs keep their declared types.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import onnx

from deploykit.bundle.format import FORMAT, FORMAT_VERSION, MODEL, REFERENCE_MODEL
from deploykit.bundle import trust
from deploykit.bundle.format import cached_sha256, sha256_of
from deploykit.ops import custom_op_types

if TYPE_CHECKING:
    from deploykit.conversion.state import ConversionState


def build_manifest(state: ConversionState) -> dict:
    options, model, precision = state.options, state.shipped_graph, state.precision
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": state.created,
        "source": str(options.model),
        "model": MODEL,
        "precision": options.precision,
        "io_precision": precision.io_precision if precision is not None else None,
        "reference_model": REFERENCE_MODEL if state.reference_graph is not None else None,
        "quantization": _quantization(state),
        "opset": next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
                      state.exported.opset),  # bf16 graphs move to opset 22
        "ir_version": model.ir_version,
        "exporter": state.exported.exporter,
        "inputs": [tensor_spec(value, options.batch.to_json() if options.batch else None)
                   for value in model.graph.input],
        "outputs": [tensor_spec(value) for value in model.graph.output],
        "passes": [s.to_json() for s in state.shipped_pass_stats],
        "engines": [state.engine.to_json()] if state.engine else [],
        "aoti": state.aoti.entries(state.validations) if state.aoti else [],
        "openvino": [state.openvino.validated_entry(state.validations)] if state.openvino else [],
        "custom_op_libraries": [
            {"file": state.library.path.name, "runtime": "onnxruntime", "register": "RegisterCustomOps",
             "ops": custom_op_types(model)}
        ] if state.library.path else [],
        "versions": state.versions,
        "validation": _validation(state),
        "native": state.native,
    }


def native_files(state: ConversionState) -> list[dict]:
    """The native code the bundle carries (the op library, an engine with embedded plugins, AOTInductor
    packages) and its build; each file hashed here once for the report, the manifest and its ``files``."""
    version = state.versions.get("deploykit", "unknown")
    entries = []
    if state.library.path:
        entries.append(trust.manifest_entry(state.library.path.name, trust.OP_LIBRARY,
                                            cached_sha256(state.library.path), state.library.path, version))
    if state.engine and state.engine.plugin_sha256:
        entries.append(trust.manifest_entry(state.engine.file_name, trust.ENGINE,
                                            hashlib.sha256(state.engine.build.engine).hexdigest(), None, version))
    for package in state.aoti.packages if state.aoti else []:
        entries.append(trust.manifest_entry(package.entry["file"], trust.AOTI_PACKAGE, sha256_of(package.path), None,
                                            version))
    return entries


def tensor_spec(value: onnx.ValueInfoProto, batch: dict | None = None) -> dict:
    """Name, dtype and shape of a graph input or output; inputs say their dynamic batch range."""
    tensor = value.type.tensor_type
    entry = {
        "name": value.name,
        "dtype": onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name,
        "shape": [d.dim_param or d.dim_value for d in tensor.shape.dim],
    }
    if batch:
        entry["dynamic"] = {"0": batch}
    return entry


def _quantization(state: ConversionState) -> dict | None:
    """int8, fp8: how it was calibrated (random data is said so), which nodes (fp8: Linear layers) are
    quantized and which stay float."""
    if state.quantized is None:
        return None
    entry = state.quantized.to_json()
    keys = ("format", "calibration_method", "calibration", "quantized_nodes", "float_nodes")
    return {key: entry[key] for key in keys}


def _validation(state: ConversionState) -> dict:
    """The verdict, and the errors of the bundle as it runs at the last batch size validated."""
    final = state.validations[0]
    return {
        "passed": state.passed,
        "backend": final.backend,
        "batch_sizes": state.batch_sizes,
        "max_abs": {o.name: o.metrics.get("max_abs") for o in final.runs[-1].outputs},
        "inconclusive": final.inconclusive,
        "tolerances": list(state.options.tolerances),  # tune and validate judge by these again
    }
