"""Small bundles of model_zoo models, converted once per test session and shared by the tests of
the Python runtime, the C++ runtime and the runtime CLI commands.

Converted by the CLI in a subprocess, as users do: an in-process TensorRT build would register
our plugin library in the test process, and other tests register their own build.

Under pytest-xdist the workers share one folder (``SHARED_WORK``, made by tests/conftest.py for
the run): the first worker to ask for a bundle converts it under a file lock, the others wait and
reuse it, so each bundle is converted once per run, not once per worker.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from filelock import FileLock

import model_zoo
from deploykit.testing import randomize_batch_norm
from deploykit_cli import run_deploykit

INPUT_SPECS = {"tabular": "features:1x13", "transformer_mlp": "tokens:1x9x40"}
#: The environment variable naming the folder the workers of one pytest-xdist run share.
SHARED_WORK = "DEPLOYKIT_TEST_SHARED_WORK"


@functools.cache
def _work() -> Path:
    """The run's shared folder, else one of this process's own."""
    if shared := os.environ.get(SHARED_WORK):
        return Path(shared)
    folder = Path(tempfile.mkdtemp(prefix="deploykit-runtime-tests-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _has_tensorrt() -> bool:
    try:
        from deploykit.backends.tensorrt import shim

        shim.load_tensorrt()
        return True
    except Exception:  # noqa: BLE001 - any failure means no TensorRT here
        return False


def _made_once(bundle: Path, make) -> Path:
    """``bundle``, converted by ``make(bundle)`` unless another worker of this run already did; the
    model's weights go beside it."""
    bundle.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(bundle.parent.with_suffix(".lock")):
        if not (bundle / "manifest.json").is_file():  # convert publishes a bundle whole
            make(bundle)
    return bundle


@functools.cache
def converted(name: str) -> Path:
    """A bundle of model_zoo's ``name`` with batch 1:2:4 (tabular: with an engine where possible)."""
    def make(bundle: Path) -> None:
        torch.manual_seed(0)
        weights = bundle.parent / f"{name}.pt"
        torch.save(randomize_batch_norm(getattr(model_zoo, name)(), seed=1).state_dict(), weights)
        engine = ["--backend", "all", "--trt-targets", "8.6,12.0"] if name == "tabular" and _has_tensorrt() else []
        result = run_deploykit("convert", weights, "--factory", f"model_zoo:{name}", "--input", INPUT_SPECS[name],
                               "--batch", "1:2:4", "-o", bundle, *engine)
        assert result.returncode == 0, result.stderr

    return _made_once(_work() / f"{name}-conversion" / name, make)


@functools.cache
def converted_aoti(batch: str | None = "1:2:4", *options: str) -> Path:
    """A bundle of model_zoo's tiny_conv (x: 3x8x8 images; ``batch``: MIN:OPT:MAX, or None for batch 1) with
    AOTInductor packages (``convert --backend aoti OPTIONS``): compiling C++ is slow, so each is made once."""
    def make(bundle: Path) -> None:
        torch.manual_seed(0)
        weights = bundle.parent / "tiny_conv.pt"
        torch.save(randomize_batch_norm(model_zoo.tiny_conv(), seed=1).state_dict(), weights)
        dynamic = ["--batch", batch] if batch else []
        result = run_deploykit("convert", weights, "--factory", "model_zoo:tiny_conv", "--input", "x:1x3x8x8",
                               *dynamic, "--backend", "aoti", *options, "-o", bundle)
        assert result.returncode == 0, result.stderr

    key = re.sub(r"[^\w.-]+", "_", "-".join([batch or "static", *options]))
    return _made_once(_work() / f"tiny_conv-aoti-{key}" / "bundle", make)


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

