"""What the tests of the C++ runtime's AOTInductor path share about a bundle with AOTI packages
(converted_bundles.converted_aoti): which package a batch goes to, inputs, a tuning table."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from converted_bundles import edit_manifest

INPUT = "x"  # tiny_conv's input, (batch, 3, 8, 8)


def manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def device_of(bundle: Path) -> str:
    return manifest(bundle)["aoti"][0]["device"]


def package_for(bundle: Path, batch: int) -> str:
    """The file the runners should route a call of ``batch`` to: its static package, else the dynamic one."""
    entries = manifest(bundle)["aoti"]
    static = [e["file"] for e in entries if e["batch"]["min"] == e["batch"]["max"] == batch]
    dynamic = [e["file"] for e in entries if e["batch"]["min"] < e["batch"]["max"]]
    return (static or dynamic)[0]


def inputs(directory: Path, batch: int, dtype=np.float32) -> Path:
    """``directory`` holding x.npy of ``batch`` random images."""
    array = np.random.default_rng(batch).standard_normal((batch, 3, 8, 8)).astype(dtype)
    np.save(directory / f"{INPUT}.npy", array)
    return directory


def copied(bundle: Path, destination: Path) -> Path:
    return Path(shutil.copytree(bundle, destination / bundle.name))


def this_machine(device: str) -> dict:
    """The machine fields of a tuning table timed here."""
    if device == "cpu":
        return {"device": "cpu", "gpu": None, "cuda_arch": None}
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    return {"device": "cuda", "gpu": torch.cuda.get_device_name(0), "cuda_arch": f"{major}.{minor}"}


def tuned(bundle: Path, destination: Path, machine: dict) -> Path:
    """A copy of the bundle with a tuning table as deploykit tune writes it: batch 1 to the static
    packages ({"packages": "static"}), batch 2 to the dynamic one named by file ({"file": ...}, the
    form the manifest schema also allows), batch 4 to ONNX Runtime (batch 3 goes to the nearest tuned
    size above that takes it: 4)."""
    copy = copied(bundle, destination)
    choices = [{"batch": 1, "backend": "aoti", "options": {"packages": "static", "cuda_graph": False}, "p50_ms": 0.1},
               {"batch": 2, "backend": "aoti", "options": {"file": package_for(bundle, 3), "cuda_graph": False},
                "p50_ms": 0.1},
               {"batch": 4, "backend": "onnxruntime", "options": {}, "p50_ms": 0.2}]
    table = {**machine, "created": "2026-12-01T12:00:00Z", "versions": {}, "choices": choices}
    edit_manifest(copy, lambda m: m.update(tuning=table))
    return copy
