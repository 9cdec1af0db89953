"""Run the reference and each candidate on the same inputs and compare every output."""

from __future__ import annotations

import dataclasses

import numpy as np

from deploykit.compare import OutputComparison, Tolerance, compare_output
from deploykit.errors import BadInputError, DeployKitError, error_summary


@dataclasses.dataclass
class BatchRun:
    batch: int
    outputs: list[OutputComparison]

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)


@dataclasses.dataclass
class CandidateValidation:
    """One candidate (e.g. ONNX Runtime on the final graph) against the reference."""

    label: str
    backend: str
    runs: list[BatchRun]

    @property
    def passed(self) -> bool:
        return all(run.passed for run in self.runs)

    def failures(self) -> list[str]:
        return [
            f"{self.label}: output {o.name} (batch {run.batch}): {reason}"
            for run in self.runs for o in run.outputs for reason in o.failures
        ]

    def to_json(self) -> dict:
        return {
            "label": self.label,
            "backend": self.backend,
            "passed": self.passed,
            "runs": [{"batch": r.batch, "passed": r.passed, "outputs": [o.to_json() for o in r.outputs]} for r in self.runs],
        }


def validate(
    reference,
    candidates: dict[str, object],
    feed_sets: list[dict[str, np.ndarray]],
    tolerances: dict[str, Tolerance],
) -> list[CandidateValidation]:
    """Compare each candidate runner with ``reference`` on every feed set.

    Outputs that miss only default numeric tolerances are then judged against a float64 run of the
    reference (``OutputComparison.judge_by_float64``), which runs only when there are some.
    """
    references = [_run(reference, feeds, BadInputError) for feeds in feed_sets]
    results, numeric_misses = [], []
    for label, runner in candidates.items():
        runs = []
        for index, (feeds, expected) in enumerate(zip(feed_sets, references)):
            actual = _run(runner, feeds, DeployKitError)
            outputs = [compare_output(name, expected[name], actual[name], tolerances[name]) for name in expected]
            numeric_misses += [(index, o, actual[o.name]) for o in outputs if o.may_be_rounding]
            runs.append(BatchRun(_batch_size(feeds), outputs))
        results.append(CandidateValidation(label, runner.name, runs))
    if numeric_misses:
        _judge_by_float64(reference, feed_sets, references, numeric_misses)
    return results


def _judge_by_float64(reference, feed_sets, references, misses) -> None:
    """Run the reference in float64 on the feed sets that need it and judge each miss by it."""
    try:
        exact_runner = reference.in_float64()
        exact = {index: exact_runner.run(feed_sets[index]) for index in sorted({m[0] for m in misses})}
    except Exception as error:  # a model that fixes its dtypes cannot run in float64: keep the verdict
        for _, comparison, _ in misses:
            comparison.metrics["float64"] = {"unavailable": error_summary(error)[:200]}
        return
    for index, comparison, actual in misses:
        name = comparison.name
        comparison.judge_by_float64(references[index][name], actual, exact[index][name])


def _batch_size(feeds: dict[str, np.ndarray]) -> int:
    return int(next(iter(feeds.values())).shape[0])


def _run(runner, feeds, error_type) -> dict[str, np.ndarray]:
    """Run, turning a crash into an error that names the runner and the batch size.

    The reference failing is the user's to fix (a batch size the model cannot take);
    a converted model failing where PyTorch succeeded is ours.
    """
    try:
        return runner.run(feeds)
    except DeployKitError:
        raise
    except Exception as error:
        hint = "narrow --batch to sizes the model accepts" if error_type is BadInputError else "please report this"
        raise error_type(
            f"{runner.name} fails at batch {_batch_size(feeds)}: {error_summary(error)[:300]}; {hint}"
        ) from error
