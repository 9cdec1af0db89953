"""Each candidate's outputs against a reference, by validation/compare.py's rules and tolerances.

At conversion the reference is the in-memory PyTorch model with the conversion's tolerances. For
``deploykit tune BUNDLE`` it is the source model when it loads, else the bundle's own validated
graph on ONNX Runtime's CPU provider (the fp32 reference graph of a reduced-precision bundle),
judged with the tolerances the bundle was validated with (its precision's defaults and the
conversion's ``--tolerance``, recorded in the manifest), then tune's own ``--tolerance``. A
candidate is compared with the same reference run on the same inputs as every other one.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from deploykit.backends.onnxruntime.runner import OnnxRuntimeRunner
from deploykit.bundle.read import Bundle
from deploykit.validation.compare import Tolerance, bundle_tolerances
from deploykit.validation.validate import Remembered, validate


@dataclasses.dataclass
class Reference:
    """What candidates are compared with: a runner, its label for the table, the tolerances."""

    runner: object
    label: str
    tolerances: dict[str, Tolerance]


def source_reference(loaded, bundle: Bundle, overrides: tuple[str, ...] = ()) -> Reference:
    """The source PyTorch model (fp32, CPU), its outputs named as the bundle's."""
    from deploykit.backends.torch.runner import TorchRunner

    runner = TorchRunner(loaded, [spec["name"] for spec in bundle.inputs])
    runner.output_names = [spec["name"] for spec in bundle.outputs]
    return Reference(Remembered(runner), "source PyTorch model (fp32, CPU)", bundle_tolerances(bundle, overrides))


def graph_reference(bundle: Bundle, overrides: tuple[str, ...] = ()) -> Reference:
    """The bundle's validated graph on ONNX Runtime's CPU provider, its ONNX function fallbacks for
    our ops; a reduced-precision bundle's fp32 reference graph."""
    name = bundle.manifest.get("reference_model") or bundle.model
    runner = CastingRunner(OnnxRuntimeRunner.from_model(bundle.file(name)))
    return Reference(Remembered(runner), f"{name} on ONNX Runtime, CPU (no source model)",
                     bundle_tolerances(bundle, overrides))


class CastingRunner:
    """A runner whose float inputs are cast to the types its graph declares: the fp32 reference
    graph takes fp32 where the bundle may take fp16."""

    def __init__(self, runner: OnnxRuntimeRunner):
        self.runner, self.name = runner, runner.name
        self.dtypes = {spec["name"]: np.dtype(spec["dtype"]) for spec in runner.inputs}

    def run(self, feeds: dict) -> dict:
        return self.runner.run({name: array.astype(self.dtypes[name]) if array.dtype.kind == "f" else array
                                for name, array in feeds.items()})


def check(reference: Reference, runner, label: str, feeds: dict) -> dict:
    """``passed``, ``max_abs`` (the largest over outputs) and ``failures`` of one candidate on one feed set."""
    # whether outputs depend on the input is the conversion's (or validate's) verdict: no extra runs here
    [result] = validate(reference.runner, {label: runner}, [feeds], reference.tolerances, check_dependence=False)
    outputs = result.runs[0].outputs
    worst = max((o.metrics.get("max_abs", float("inf")) for o in outputs), default=0.0)
    return {"passed": result.passed, "max_abs": worst, "failures": result.failures()[:3]}
