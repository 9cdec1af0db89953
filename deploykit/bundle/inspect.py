"""``deploykit inspect``: what a bundle holds, read from its manifest, and whether its files are intact.

For whoever receives a bundle: the inputs and outputs to feed and expect (with the dynamic
batch range), the precision, our ops and the library they need, the engines and what they were
built for, the AOTInductor packages and what they need (torch, GPU or CPU), the passes, the
validation it passed at conversion, the tuning table (what ``load`` runs where), and every file against its sha256, and the native files it carries with where they came from as far as this machine can
tell (whether ``--trust-bundle`` is needed). Nothing is loaded or run, so it works on any machine.
"""

from __future__ import annotations

from pathlib import Path

from deploykit import runtime
from deploykit.bundle import trust


def describe_bundle(path: Path) -> dict:
    bundle = runtime.open_bundle(path)
    manifest = bundle.manifest
    problems = bundle.file_problems()
    batch = _batch_symbols(bundle.inputs)
    return {
        "bundle": str(bundle.path),
        "source": manifest.get("source"),
        "created": manifest.get("created"),
        "precision": bundle.precision,
        "exporter": manifest.get("exporter"),
        "opset": manifest.get("opset"),
        "ir_version": manifest.get("ir_version"),
        "inputs": [_tensor(spec, batch) for spec in bundle.inputs],
        "outputs": [_tensor(spec, batch) for spec in bundle.outputs],
        "custom_ops": [op for entry in manifest.get("custom_op_libraries", []) for op in entry["ops"]],
        "op_library": (bundle.op_library or {}).get("file"),
        "engines": [{key: engine.get(key) for key in ("file", "flavour", "version", "targets")}
                    | {"skipped_targets": engine.get("skipped_targets", [])} for engine in bundle.engines],
        "aoti": [{key: entry.get(key) for key in ("file", "device", "torch", "cuda_arch", "gpu", "cpu_isa", "precision",
                                                  "cuda_graph", "validated")} | {"batch": _range(entry["batch"])}
                 for entry in bundle.aoti],
        "openvino": [{key: entry.get(key) for key in ("file", "precision", "openvino", "nncf", "validated")}
                     for entry in bundle.openvino],
        "passes": {p["name"]: {k: v for k, v in p["changes"].items() if v} for p in manifest.get("passes", [])},
        "validation": manifest.get("validation", {}),
        "quantization": manifest.get("quantization"),  # int8, fp8: calibration, quantized and float nodes
        "versions": manifest.get("versions", {}),
        "tuning": manifest.get("tuning"),
        "files": {name: {"bytes": entry.get("bytes"), "status": problems.get(name, "ok")}
                  for name, entry in manifest.get("files", {}).items()},
        "files_ok": not problems,
        "native": [{"file": n.file, "kind": n.kind, "provenance": n.provenance, "needs_trust": not n.known}
                   for n in trust.native_files(bundle)],
    }


def _batch_symbols(inputs: list[dict]) -> dict[str, str]:
    """Symbolic batch dimension -> "MIN..MAX", from the inputs' dynamic ranges (outputs share the symbol)."""
    symbols = {}
    for spec in inputs:
        batch = spec.get("dynamic", {}).get("0")
        if batch and spec["shape"] and isinstance(spec["shape"][0], str):
            symbols[spec["shape"][0]] = f"{batch['min']}..{batch['max']}"
    return symbols


def _range(batch: dict) -> str:
    return str(batch["min"]) if batch["min"] == batch["max"] else f"{batch['min']}..{batch['max']}"


def _tensor(spec: dict, batch: dict[str, str]) -> dict:
    """Name, dtype and shape, a dynamic batch as MIN..MAX (other symbolic sizes as named)."""
    shape = "x".join(batch.get(d, str(d)) if isinstance(d, str) else str(d) for d in spec["shape"])
    return {"name": spec["name"], "dtype": spec["dtype"], "shape": shape}
