"""The native build CI runs: every CUDA source compiles for every GPU we ship to, and the
three libraries (kernels, ONNX Runtime op library, TensorRT plugins) come out of one build."""

import fcntl
import os
import shutil

import pytest

from deploykit.native import build as native

SHIPPED_ARCHITECTURES = ("80", "86", "89", "90", "120")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
def test_default_build_compiles_cuda_for_every_shipped_architecture(monkeypatch):
    monkeypatch.delenv("DEPLOYKIT_CUDA_ARCHS", raising=False)
    build = native.build_plugins()
    assert build.cuda, build.disabled
    libraries = {"onnxruntime": build.ort_library, "tensorrt": build.tensorrt_library, "kernels": build.kernels_library}
    assert all(libraries.values()), build.disabled
    for name, path in libraries.items():
        image = path.read_bytes()
        found = [arch for arch in SHIPPED_ARCHITECTURES if f"sm_{arch}".encode() in image]
        assert found == list(SHIPPED_ARCHITECTURES), f"{name}: device code only for {found}"
        assert b"sm_75" not in image  # the search tells architectures apart


def test_pruning_keeps_the_most_recently_used_builds_and_any_in_use(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPLOYKIT_CACHE", str(tmp_path))
    root = tmp_path / "build"
    for age, name in enumerate(["newest", "recent", "old", "older", "in-use"]):
        (root / name).mkdir(parents=True)
        (root / name / native.MANIFEST).write_text("{}")
        os.utime(root / name / native.MANIFEST, (1e9 - age, 1e9 - age))
    with open(root / "in-use.lock", "w") as held:  # another process building or reading it
        fcntl.flock(held, fcntl.LOCK_EX)
        removed = native.prune_builds(2)
    assert sorted(p.name for p in removed) == ["old", "older"]
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["in-use", "newest", "recent"]
    assert not (root / "old.lock").exists()
