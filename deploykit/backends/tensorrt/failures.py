"""What TensorRT's error log says when an engine does not build: the layer, the target, the reason.

TensorRT-RTX compiles each layer for every compute capability it is asked for and refuses some
(layer, target) pairs, e.g. an fp32 GEMM for Turing. Those refusals name the layer and the SM,
so the builder can leave that target out and the user reads which layer stopped it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from deploykit.errors import EnvironmentProblem

#: Myelin's per-target refusal: "Cannot compile operation 'node_linear' for Turing (SM75): FP32 GEMM is not supported."
_REFUSAL = re.compile(r"Cannot compile operation '(?P<layer>[^']+)' for (?P<arch>\w+) \(SM(?P<sm>\d+)\): "
                      r"(?P<reason>.+?)(?:\. In \w+ at |\)?$)")
#: Errors about this machine's missing GPU, logged by every GPU-less RTX build, also by builds that succeed.
_NO_GPU_NOISE = ("Cuda Runtime", "cudaError")


@dataclass(frozen=True)
class LayerFailure:
    """One layer TensorRT could not build; ``target`` is None when the log names no compute capability."""

    layer: str | None
    target: str | None
    reason: str
    architecture: str | None = None

    def __str__(self) -> str:
        where = f" for {self.architecture or 'compute capability'} ({self.target})" if self.target else ""
        return f"layer {self.layer}{where}: {self.reason}" if self.layer else f"{self.reason}{where}"

    def to_json(self) -> dict:
        return {"target": self.target, "architecture": self.architecture, "layer": self.layer, "reason": self.reason}


class EngineBuildError(EnvironmentProblem):
    """TensorRT cannot build this graph for these targets (exit 3): a limit of the backend, not a bug.

    ``failures`` are the refusals read from the log, ``targets`` what the build was asked for,
    ``choices`` the targets this TensorRT could be asked for instead (none for plain TensorRT).
    """

    def __init__(self, message: str, failures: Sequence[LayerFailure], targets: Sequence[str],
                 choices: Sequence[str] = ()):
        super().__init__(message)
        self.failures, self.targets, self.choices = tuple(failures), tuple(targets), tuple(choices)


def relevant_errors(errors: Iterable[str]) -> list[str]:
    """The errors about the model: without the CUDA runtime's complaints of a GPU-less machine
    (unless nothing else is left)."""
    errors = [e for e in errors if e.strip()]
    model_errors = [e for e in errors if not any(noise in e for noise in _NO_GPU_NOISE)]
    return model_errors or errors


def layer_failures(errors: Iterable[str]) -> tuple[LayerFailure, ...]:
    """The (layer, target) refusals in TensorRT's errors; one failure without a layer when none is named."""
    errors = relevant_errors(errors)
    found = []
    for error in errors:
        for match in _REFUSAL.finditer(error):
            sm = match["sm"]
            found.append(LayerFailure(match["layer"], f"{sm[:-1]}.{sm[-1]}", match["reason"].strip(), match["arch"]))
    if found:
        return tuple(dict.fromkeys(found))
    return (LayerFailure(None, None, "; ".join(errors) or "no reason given"),)


def refused_targets(failures: Iterable[LayerFailure]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(f.target for f in failures if f.target))
