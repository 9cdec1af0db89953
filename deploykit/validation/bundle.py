"""``deploykit validate``: check a converted bundle against its PyTorch model again, here.

Conversion validates on the converting machine (ONNX Runtime on the CPU). This runs the bundle
as it will be deployed — the backend and device ``deploykit.load`` picks on this machine (the
CUDA provider or the TensorRT engine on a GPU), with the op library — on the user's data or on
seeded random inputs at each batch size of the bundle's range, and compares it with the PyTorch
model by the same rules and tolerances as ``convert`` (docs/validation.md). The bundle is only
read.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from deploykit import runtime
from deploykit.backends.torch.runner import TorchRunner
from deploykit.validation.compare import bundle_tolerances
from deploykit.errors import BadInputError, verdict
from deploykit.conversion.loading import load_model
from deploykit.validation.validate import CandidateValidation, run_checked, validate


@dataclasses.dataclass
class BundleValidation:
    runner: runtime.Runner
    validation: CandidateValidation
    precision: str
    inputs: str

    @property
    def passed(self) -> bool:
        return self.validation.passed

    @property
    def verdict(self) -> str:
        """pass, fail, or inconclusive: it passed, but an output does not depend on the inputs."""
        return verdict(self.passed, bool(self.validation.inconclusive))

    def to_json(self) -> dict:
        return {
            **self.runner.describe(),
            "precision": self.precision,
            "inputs": self.inputs,
            "passed": self.passed,
            "verdict": self.verdict,
            "failures": self.validation.failures(),
            "inconclusive": self.validation.inconclusive_notes(),
            "validation": self.validation.to_json(),
        }


def validate_bundle(bundle: Path, model: Path, *, factory: str | None = None, trust_pickle: bool = False,
                    feeds_path: Path | None = None, batches: list[int] | None = None, seed: int = 0,
                    tolerances: tuple[str, ...] = (), backend: str = "auto", device: str = "auto",
                    allow_failed: bool = False, op_library: bool = True,
                    trust_native: bool = False) -> BundleValidation:
    # validating a batch the conversion did not is what this is for; the runner's notes name it
    runner = runtime.load(bundle, backend, device, allow_failed=allow_failed, op_library=op_library,
                          allow_unvalidated=True, trust_native=trust_native)
    reference = TorchRunner(load_model(model, factory, trust_pickle), runner.input_names)
    feed_sets = _feed_sets(runner.inputs, feeds_path, batches, seed, runner.notes)
    _check_outputs(reference, feed_sets[0], runner.output_names, model)
    precision = runner.bundle.precision
    limits = bundle_tolerances(runner.bundle, tolerances)
    label = f"bundle ({precision})"
    [result] = validate(reference, {label: runner}, feed_sets, limits)
    inputs = str(feeds_path) if feeds_path else f"seeded random (seed {seed})"
    return BundleValidation(runner, result, precision, inputs)


def _feed_sets(specs: list[dict], feeds_path: Path | None, batches: list[int] | None, seed: int,
               notes: list[str]) -> list[dict]:
    """The user's .npz as one set (floats rounded to the bundle's dtypes, noted in ``notes``), else
    random inputs at each batch size (default: the bundle's min, opt and max, or its static batch)."""
    if feeds_path is not None:
        if batches:
            raise BadInputError("--batch applies to random inputs; with --inputs the .npz sets the batch")
        return [runtime.bundle_feeds(specs, feeds_path, rounding_notes=notes)]
    sizes = batches or sorted(set(runtime.batch_sizes(specs) or [None]))
    return [runtime.random_inputs(specs, size, seed) for size in sizes]


def _check_outputs(reference: TorchRunner, feeds: dict[str, np.ndarray], names: list[str], model: Path) -> None:
    """The model must return as many outputs as the bundle has; they take the bundle's names."""
    count = len(run_checked(reference, feeds, BadInputError))
    if count != len(names):
        raise BadInputError(
            f"{model} returns {count} output(s), the bundle {len(names)} ({', '.join(names)}): "
            "give the model the bundle was converted from"
        )
    reference.output_names = names
