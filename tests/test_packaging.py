"""pyproject's extras: ONNX Runtime comes from exactly one of deploykit[cpu] / deploykit[gpu], never
from the base dependencies (pip cannot leave those out), and the test set brings the CPU wheel.
Read from pyproject.toml with packaging's requirement parser; nothing is installed (how pip resolves
'.[gpu]' against the index, without the CPU wheel: README, "Installing").
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

PROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
ORT_WHEELS = {"onnxruntime", "onnxruntime-gpu"}


def resolved(*extras: str) -> set[str]:
    """Distribution names the base dependencies and ``extras`` bring, following deploykit[...] inside extras."""
    names, pending, seen = set(), [Requirement(r) for r in PROJECT["dependencies"]], set()
    pending += [Requirement(f"deploykit[{extra}]") for extra in extras]
    while pending:
        requirement = pending.pop()
        if requirement.name != PROJECT["name"]:
            names.add(requirement.name.lower())
            continue
        for extra in requirement.extras - seen:
            seen.add(extra)
            pending += [Requirement(r) for r in PROJECT["optional-dependencies"][extra]]
    return names


def test_the_base_dependencies_bring_no_onnxruntime():
    assert not resolved() & ORT_WHEELS


@pytest.mark.parametrize("extras, wheel", [(("cpu",), "onnxruntime"), (("gpu",), "onnxruntime-gpu"),
                                           (("test",), "onnxruntime"), (("gpu", "dev"), "onnxruntime-gpu"),
                                           (("gpu", "serve"), "onnxruntime-gpu")])
def test_each_install_brings_exactly_one_onnxruntime_wheel(extras, wheel):
    assert resolved(*extras) & ORT_WHEELS == {wheel}


def test_the_gpu_extra_brings_cuda_python():
    assert {"onnxruntime-gpu", "cuda-python"} <= resolved("gpu")
    assert "cuda-python" not in resolved("cpu")


def test_the_test_extra_is_the_dev_tools_with_the_cpu_wheel_and_openvino():
    assert resolved("test") == resolved("cpu", "dev", "openvino") and "pytest" in resolved("dev")
    assert {"openvino", "nncf"} <= resolved("openvino") and not {"onnxruntime", "onnxruntime-gpu"} & resolved("openvino")


def test_a_source_checkout_without_package_metadata_names_its_version(monkeypatch):
    """Run from a checkout on PYTHONPATH (the GPU machine has no package index), deploykit has no
    installed metadata; export triton and serve's /v2 still say which version it is."""
    import importlib.metadata

    from deploykit import versions

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert versions.deploykit_version() == f"{project['version']} (source checkout)"
