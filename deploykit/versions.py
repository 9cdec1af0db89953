"""Versions of the tools a bundle was made with, recorded in its manifest and report."""

from __future__ import annotations

import importlib.metadata
import platform
import tomllib
from pathlib import Path

_DISTRIBUTIONS = ("deploykit", "torch", "onnx", "onnxruntime", "onnxruntime-gpu", "onnxscript", "onnx-ir",
                  "openvino", "nncf")


def tool_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def deploykit_version() -> str:
    """This deploykit's version: installed, or read from the pyproject.toml of the source checkout it
    runs from (PYTHONPATH, as on a machine without a package index), which has no package metadata."""
    try:
        return importlib.metadata.version("deploykit")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        try:
            return tomllib.loads(pyproject.read_text())["project"]["version"] + " (source checkout)"
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown (not installed)"
