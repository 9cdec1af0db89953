"""A bundle's OpenVINO model as a runner: its two files (graph and weights) verified against the
manifest, compiled for the CPU, and a warning where it was not validated or another OpenVINO runs it.

An OpenVINO model is a graph and its weights, not native code: it loads without ``--trust-bundle``.
"""

from __future__ import annotations

from deploykit.backends.openvino.loader import compile_model, installed_version
from deploykit.backends.openvino.runner import OpenVinoRunner
from deploykit.bundle.read import Bundle
from deploykit.errors import BadInputError


def openvino_entry(bundle: Bundle, file: str | None = None) -> dict:
    """The manifest entry of the bundle's OpenVINO model ``file`` (None: the first)."""
    for entry in bundle.openvino:
        if file is None or entry["file"] == file:
            return entry
    if not bundle.openvino:
        raise BadInputError(f"{bundle.path} has no OpenVINO model: convert with --backend openvino")
    raise BadInputError(f"{bundle.path} has no OpenVINO model {file} (it has "
                        f"{', '.join(e['file'] for e in bundle.openvino)})")


def load_openvino(bundle: Bundle, entry: dict | None = None, *, verify: bool = True, threads: int | None = None,
                  notes: list[str] | None = None, allow_unvalidated: bool = False) -> OpenVinoRunner:
    """The bundle's OpenVINO model ``entry`` (default: its first) compiled for this CPU, ``threads`` threads."""
    entry = entry or openvino_entry(bundle)
    compiled = compile_model(bundle.file(entry["file"], verify), bundle.file(entry["weights"], verify), threads)
    runner = OpenVinoRunner(compiled, inputs=bundle.inputs, outputs=bundle.outputs, label=entry["file"], notes=notes,
                            bundle=bundle, allow_unvalidated=allow_unvalidated)
    if not entry.get("validated"):
        runner.warn(f"{entry['file']} did not pass validation against PyTorch at conversion time")
    running = installed_version()
    if entry.get("openvino") and entry["openvino"] != running:
        runner.warn(f"{entry['file']} was validated with OpenVINO {entry['openvino']}, running {running}: "
                    "outputs may differ slightly")
    return runner
