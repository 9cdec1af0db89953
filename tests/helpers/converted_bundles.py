"""Small bundles of model_zoo models, converted once per test session and shared by the tests of
the Python runtime, the C++ runtime and the runtime CLI commands.

Converted by the CLI in a subprocess, as users do: an in-process TensorRT build would register
our plugin library in the test process, and other tests register their own build.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import torch

import model_zoo
from deploykit.testing import randomize_batch_norm
from deploykit_cli import run_deploykit

INPUT_SPECS = {"tabular": "features:1x13", "transformer_mlp": "tokens:1x9x40"}
_WORK = Path(tempfile.mkdtemp(prefix="deploykit-runtime-tests-"))
atexit.register(shutil.rmtree, _WORK, ignore_errors=True)


def _has_tensorrt() -> bool:
    try:
        from deploykit.backends.tensorrt import shim

        shim.load_tensorrt()
        return True
    except Exception:  # noqa: BLE001 - any failure means no TensorRT here
        return False


@functools.cache
def converted(name: str) -> Path:
    """A bundle of model_zoo's ``name`` with batch 1:2:4 (tabular: with an engine where possible)."""
    torch.manual_seed(0)
    weights = _WORK / f"{name}.pt"
    torch.save(randomize_batch_norm(getattr(model_zoo, name)(), seed=1).state_dict(), weights)
    engine = ["--backend", "all", "--trt-targets", "8.6,12.0"] if name == "tabular" and _has_tensorrt() else []
    result = run_deploykit("convert", weights, "--factory", f"model_zoo:{name}", "--input", INPUT_SPECS[name],
                           "--batch", "1:2:4", "-o", _WORK / name, *engine)
    assert result.returncode == 0, result.stderr
    return _WORK / name


@functools.cache
def converted_aoti(batch: str | None = "1:2:4", *options: str) -> Path:
    """A bundle of model_zoo's tiny_conv (x: 3x8x8 images; ``batch``: MIN:OPT:MAX, or None for batch 1) with
    AOTInductor packages (``convert --backend aoti OPTIONS``): compiling C++ is slow, so each is made once."""
    folder = Path(tempfile.mkdtemp(prefix="tiny_conv-aoti-", dir=_WORK))
    torch.manual_seed(0)
    weights = folder / "tiny_conv.pt"
    torch.save(randomize_batch_norm(model_zoo.tiny_conv(), seed=1).state_dict(), weights)
    dynamic = ["--batch", batch] if batch else []
    result = run_deploykit("convert", weights, "--factory", "model_zoo:tiny_conv", "--input", "x:1x3x8x8", *dynamic,
                           "--backend", "aoti", *options, "-o", folder / "bundle")
    assert result.returncode == 0, result.stderr
    return folder / "bundle"


def aoti_source_model(bundle: Path) -> torch.nn.Module:
    """The PyTorch model a ``converted_aoti`` bundle was converted from, in eval mode."""
    module = model_zoo.tiny_conv()
    module.load_state_dict(torch.load(bundle.parent / "tiny_conv.pt"))
    return module.eval()


def copy_bundle(name: str, destination: Path) -> Path:
    """A copy of ``converted(name)`` that a test may change."""
    return Path(shutil.copytree(converted(name), destination / name))


def edit_manifest(bundle: Path, change) -> None:
    """Rewrite the bundle's manifest after ``change(manifest)`` (its files' hashes stay as they were)."""
    path = bundle / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))

