"""Instances over several GPUs of one host, on the CPU: the GPU count is faked, the runners too
(``deploykit.runtime.load`` records the device it was asked for), so that what is checked is the
round-robin, the refusals and what ``/v2/models/NAME/config`` says of it."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

import converted_bundles
from deploykit_cli import run_deploykit

from deploykit import runtime
from deploykit.bundle.read import Bundle
from deploykit.errors import BadInputError, EnvironmentProblem
from deploykit.export.triton import served_config
from deploykit.runtime import choose
from deploykit.serving import placement
from deploykit.serving.models import ServeOptions, load_models
from deploykit.tuning import record


@pytest.fixture
def gpus(monkeypatch):
    """Set the number of GPUs this process sees."""
    def fake(count: int) -> None:
        monkeypatch.setattr(placement, "visible_gpus", lambda: count)
    return fake


@pytest.mark.parametrize(("devices", "instances", "placed"), [
    (["cuda"], 4, ["cuda:0", "cuda:1", "cuda:2", "cuda:0"]),
    (["cuda:0,cuda:2"], 3, ["cuda:0", "cuda:2", "cuda:0"]),
    (["cuda:1", "cuda:0"], 2, ["cuda:1", "cuda:0"]),  # repeated, as comma lists
    (["cuda:0"], 2, ["cuda:0", "cuda:0"]),  # two instances on one GPU
    (["cpu"], 2, ["cpu", "cpu"]),
])
def test_instance_i_runs_on_device_i_mod_n(gpus, devices, instances, placed):
    gpus(3)
    assert placement.instance_devices(devices, instances) == placed


def test_refusals(gpus):
    gpus(2)
    with pytest.raises(BadInputError, match=r"--device cuda:2: this process sees 2 GPU\(s\), cuda:0..cuda:1"):
        placement.instance_devices(["cuda:0,cuda:2"], 2)
    with pytest.raises(BadInputError, match="all run on the CPU or all on GPUs"):
        placement.instance_devices(["cpu,cuda:0"], 2)
    with pytest.raises(BadInputError, match="device 'gpu1': use auto, cpu, cuda or cuda:N"):
        placement.instance_devices(["gpu1"], 1)
    gpus(0)
    with pytest.raises(EnvironmentProblem, match="--device cuda: no GPU is visible here"):
        placement.instance_devices(["cuda"], 1)


@pytest.mark.parametrize(("devices", "backend", "gpu_count", "cores", "workers"), [
    (["auto"], "auto", 1, 16, 8),  # auto with a GPU (and onnxruntime-gpu): half the cores
    (["cuda:0"], "onnxruntime", 1, 64, 8),  # at most 8
    (["cuda"], "auto", 2, 6, 3),
    (["cuda:0"], "auto", 1, 3, 1),  # too few cores to share: one process
    (["auto"], "auto", 0, 16, 1),  # auto without a GPU runs on the CPU
    (["auto"], "openvino", 1, 16, 1),  # and OpenVINO on the CPU whatever the host has
    (["cpu"], "auto", 1, 16, 1),
])
def test_auto_workers(monkeypatch, devices, backend, gpu_count, cores, workers):
    """``serve --workers auto``: HTTP processes for a GPU, one process on a CPU."""
    monkeypatch.setattr(choose, "has_gpu", lambda: gpu_count > 0)
    monkeypatch.setattr(choose, "ort_has_cuda", lambda: True)
    monkeypatch.setattr(placement, "usable_cores", lambda: cores)
    assert placement.auto_workers(devices, backend, [_bundle()]) == workers


TUNED_H200 = {"device": "cuda", "gpu": "NVIDIA H200", "cuda_arch": "9.0"}
ORT_CUDA_AT_1 = {"batch": 1, "backend": "onnxruntime", "options": {}, "p50_ms": 0.5, "candidates": []}


@pytest.mark.parametrize(("manifest", "backend", "workers"), [
    ({}, "auto", 1),  # onnxruntime without CUDA runs it on the CPU, GPU or not
    ({}, "aoti", 8),  # AOTInductor takes its CUDA packages where a GPU is seen
    ({"engines": [{"file": "model.engine"}]}, "auto", 8),  # an engine this GPU runs
    ({"tuning": {**TUNED_H200, "choices": [ORT_CUDA_AT_1]}}, "auto", 8),  # tuned on this GPU
    ({"tuning": {**TUNED_H200, "choices": []}}, "auto", 1),  # tuned on it, but no candidate passed
    ({"tuning": {"device": "cuda", "gpu": "NVIDIA L4", "cuda_arch": "8.9", "choices": [ORT_CUDA_AT_1]}},
     "auto", 1),  # on another
])
def test_auto_workers_follow_where_auto_puts_the_bundle(monkeypatch, manifest, backend, workers):
    """With ``--device auto`` and a GPU visible, HTTP processes only where ``load`` would put the bundle on it."""
    monkeypatch.setattr(choose, "local_gpus", lambda: [("NVIDIA H200", "9.0")])
    monkeypatch.setattr(record, "local_gpus", lambda: [("NVIDIA H200", "9.0")])
    monkeypatch.setattr(choose, "ort_has_cuda", lambda: False)
    monkeypatch.setattr(choose, "engine_problem_here", lambda entry: None)
    monkeypatch.setattr(placement, "usable_cores", lambda: 16)
    assert placement.auto_workers(["auto"], backend, [_bundle(**manifest)]) == workers


def _bundle(**manifest) -> Bundle:
    return Bundle(Path("/bundles/model"), manifest)


def test_served_config_reports_the_gpus_used(gpus, monkeypatch):
    """Five instances on two GPUs: load was asked for cuda:0, cuda:1, ...; Triton's count is per GPU."""
    asked = []

    def fake_load(bundle, backend, device, **_):
        asked.append(device)
        return types.SimpleNamespace(device="cuda", backend="onnxruntime", inputs=bundle.inputs,
                                     outputs=bundle.outputs, bundle=bundle)

    gpus(2)
    monkeypatch.setattr(runtime, "load", fake_load)
    model = load_models([converted_bundles.converted("tabular")], ServeOptions(devices=("cuda",), instances=5))[0]
    assert asked == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"] and model.gpus == [0, 1, 0, 1, 0]
    assert served_config(model, 2.0)["instance_group"] == [{"count": 3, "kind": "KIND_GPU", "gpus": [0]},
                                                           {"count": 2, "kind": "KIND_GPU", "gpus": [1]}]
    model.placements = ["cuda:0", "cuda:1"]
    assert served_config(model, 2.0)["instance_group"] == [{"count": 1, "kind": "KIND_GPU", "gpus": [0, 1]}]


def test_cli_without_a_gpu():
    """On this machine (no GPU visible to the test's CUDA_VISIBLE_DEVICES): one line, exit 3."""
    result = run_deploykit("serve", converted_bundles.converted("tabular"), "--device", "cuda:0,cuda:1",
                           env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 3, result.stderr
    assert "--device cuda:0,cuda:1: no GPU is visible here" in result.stderr
