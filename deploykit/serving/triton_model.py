"""The Triton python-backend model of ``deploykit export triton --platform python``: its
``1/model.py`` only imports this class, so what Triton serves is deploykit's tested code.

The bundle copied into ``1/bundle`` is checked whole (every file against its sha256) and loaded
by ``deploykit.load`` on the instance's device, as ``deploykit serve`` loads it (serving.models),
with the consent the export recorded in the config's parameters. Each request is checked as serve
checks it (dtypes, batch range, NaN refusal): a refused one gets a 400 (INVALID_ARG), the others
of Triton's batch still get their answers; the accepted ones run at once, their rows padded up to
the bucket and split back by request (serving.batching.run_rows, serve's batcher's own path).

``triton_python_backend_utils`` exists only inside Triton's python stub, so it is imported there.
The stub is built against numpy 1: with numpy 2, ``pb_utils.Tensor(name, array)`` gives an empty
tensor and ``Tensor.as_numpy()`` wrong values, both silently, so tensors cross by DLPack (exact),
outputs as torch tensors (numpy's own DLPack capsule makes the stub print an error per call).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from deploykit.bundle.read import open_bundle
from deploykit.errors import BadInputError
from deploykit.serving.batching import as_request_error, run_rows
from deploykit.serving.models import ServedModel, ServeOptions, load_model
from deploykit.serving.protocol import RequestError

#: config.pbtxt parameters (string_value "true") that carry export's consent flags to the load:
#: the ServeOptions they set
FLAGS = ("trust_native", "allow_failed", "allow_nan")
BUNDLE_FOLDER = "bundle"


class TritonPythonModel:
    """Triton's python model interface: initialize, execute (a list of requests), finalize."""

    model: ServedModel

    def initialize(self, args: dict) -> None:
        """Load the bundle for this instance, or fail the model's load with one line saying why."""
        config = json.loads(args["model_config"])
        bundle = open_bundle(Path(args["model_repository"]) / args["model_version"] / BUNDLE_FOLDER)
        if problems := bundle.file_problems():
            listed = ", ".join(f"{name} ({kind})" for name, kind in problems.items())
            raise BadInputError(f"{bundle.path}: {listed}; the bundle changed after export: export it again")
        device = f"cuda:{args['model_instance_device_id']}" if args["model_instance_kind"] == "GPU" else "cpu"
        parameters = config.get("parameters", {})
        flags = {flag: parameters.get(flag, {}).get("string_value") == "true" for flag in FLAGS}
        options = ServeOptions(**flags, warmup_runs=0)  # config.pbtxt's model_warmup warms it up, through execute
        self.model = load_model(bundle, args["model_name"], [device], options)

    def execute(self, requests: list) -> list:
        """One response per request, in order: refused ones an error, the others their rows' outputs."""
        import triton_python_backend_utils as pb_utils

        responses: list = [None] * len(requests)
        accepted = []  # (index, inputs, rows)
        for index, request in enumerate(requests):
            try:
                inputs = _inputs(pb_utils, request, self.model.inputs)
                accepted.append((index, inputs, self.model.check(inputs)))
            except RequestError as error:
                responses[index] = _error(pb_utils, error)
        for run in _runs(accepted, self.model.max_batch):
            indices, inputs, rows = zip(*run)
            try:
                answers = [_response(pb_utils, outputs)
                           for outputs in run_rows(self.model, self.model.runner, list(inputs), list(rows))]
            except Exception as error:  # noqa: BLE001 - every request of the run gets an answer
                answers = [_error(pb_utils, as_request_error(error, self.model.name))] * len(run)
            for index, answer in zip(indices, answers):
                responses[index] = answer
        return responses

    def finalize(self) -> None:
        for runner in self.model.runners:
            runner.close()


def _inputs(pb_utils, request, specs: list[dict]) -> dict[str, np.ndarray]:
    """The request's tensors by name (one left out is named by ``ServedModel.check``)."""
    tensors = {spec["name"]: pb_utils.get_input_tensor_by_name(request, spec["name"]) for spec in specs}
    return {name: np.from_dlpack(tensor) for name, tensor in tensors.items() if tensor is not None}


def _runs(accepted: list[tuple], max_batch: int) -> list[list[tuple]]:
    """The accepted requests in arrival order, in runs of at most ``max_batch`` rows (Triton's
    dynamic batcher already keeps a batch within max_batch_size; a model it does not batch runs each alone)."""
    runs: list[list[tuple]] = []
    for item in accepted:
        if not runs or sum(rows for *_, rows in runs[-1]) + item[2] > max_batch:
            runs.append([])
        runs[-1].append(item)
    return runs


def _response(pb_utils, outputs: dict):
    import torch

    tensors = [pb_utils.Tensor.from_dlpack(name, torch.from_numpy(np.ascontiguousarray(value)))
               for name, value in outputs.items()]
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _error(pb_utils, error: RequestError):
    """A refusal as Triton answers one: INVALID_ARG is HTTP 400 (and gRPC INVALID_ARGUMENT)."""
    code = pb_utils.TritonError.INVALID_ARG if error.status < 500 else pb_utils.TritonError.INTERNAL
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(error), code))
