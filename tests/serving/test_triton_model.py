"""deploykit.serving.triton_model without Triton: ``triton_python_backend_utils`` exists only inside
Triton's python stub, so a stand-in records what the model answers. What only a batch of Triton's
own shows deterministically lives here (a refused request among accepted ones, a failed run); the
real server is tests/export/test_triton_server.py."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

import converted_bundles

from deploykit.export.triton import export_triton
from deploykit.serving import triton_model

INVALID_ARG, INTERNAL = 3, 13


class TritonError:
    INVALID_ARG, INTERNAL = INVALID_ARG, INTERNAL

    def __init__(self, message: str, code: int):
        self.message, self.code = message, code


class Tensor:
    @staticmethod
    def from_dlpack(name: str, tensor):
        return name, np.from_dlpack(tensor).copy()


class InferenceResponse:
    def __init__(self, output_tensors: list, error: TritonError | None = None):
        self.outputs, self.error = dict(output_tensors), error


@pytest.fixture
def pb_utils(monkeypatch):
    module = types.ModuleType("triton_python_backend_utils")
    module.TritonError, module.Tensor, module.InferenceResponse = TritonError, Tensor, InferenceResponse
    module.get_input_tensor_by_name = lambda request, name: request.get(name)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def instance_args(model_dir, kind: str = "CPU", device_id: str = "0", parameters: dict | None = None) -> dict:
    """What Triton passes to initialize (the fields the model reads)."""
    return {"model_config": json.dumps({"parameters": parameters or {}}), "model_repository": str(model_dir),
            "model_version": "1", "model_instance_kind": kind, "model_instance_device_id": device_id,
            "model_name": "tab"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    exported = export_triton(converted_bundles.converted("tabular"), tmp_path_factory.mktemp("repo"), "tab",
                             platform="python", device="cpu")
    loaded = triton_model.TritonPythonModel()
    loaded.initialize(instance_args(exported.model_dir))
    yield loaded
    loaded.finalize()


def features(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 13)).astype(np.float32)


def test_a_refused_request_leaves_the_others_of_the_batch_answered_in_one_run(model, pb_utils, monkeypatch):
    good, nan, more = features(1, 0), features(1, 1), features(2, 2)
    nan[0, 5] = np.nan
    expected = [model.model.runner.run({"features": x}) for x in (good, more)]
    runs = []
    run = model.model.runner.run
    monkeypatch.setattr(model.model.runner, "run", lambda feeds: runs.append(feeds["features"].shape) or run(feeds))
    answers = model.execute([{"features": good}, {"features": nan}, {"features": more}])
    assert runs == [(3, 13)]  # the two accepted requests' rows, together (the CPU's buckets: the rows as they come)
    assert answers[1].error.code == INVALID_ARG and "input features holds 1 NaN" in answers[1].error.message
    for answer, want in zip([answers[0], answers[2]], expected):
        assert answer.error is None and answer.outputs.keys() == want.keys()
        assert all(np.array_equal(answer.outputs[name], want[name]) for name in want)


def test_a_failed_run_answers_each_of_its_requests(model, pb_utils, monkeypatch):
    def fail(feeds):
        raise RuntimeError("device lost")

    monkeypatch.setattr(model.model.runner, "run", fail)
    answers = model.execute([{"features": features(1, 0)}, {"features": features(2, 1)}])
    assert [(a.error.code, a.error.message) for a in answers] == [
        (INTERNAL, "tab failed to run: RuntimeError: device lost")] * 2


def test_the_instance_device_and_consent_come_from_triton(model, monkeypatch):
    loads = []
    monkeypatch.setattr(triton_model, "load_model", lambda bundle, name, places, options: loads.append(
        (name, places, options.trust_native, options.allow_nan, options.allow_failed)))
    parameters = {"trust_native": {"string_value": "true"}, "allow_nan": {"string_value": "false"}}
    triton_model.TritonPythonModel().initialize(instance_args(model.model.path.parents[1], "GPU", "1", parameters))
    assert loads == [("tab", ["cuda:1"], True, False, False)]
