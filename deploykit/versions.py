"""Versions of the tools a bundle was made with, recorded in its manifest and report."""

from __future__ import annotations

import importlib.metadata
import platform

_DISTRIBUTIONS = ("deploykit", "torch", "onnx", "onnxruntime", "onnxruntime-gpu", "onnxscript", "onnx-ir")


def tool_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions
