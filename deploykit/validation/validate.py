"""Run the reference and each candidate on the same inputs and compare every output."""

from __future__ import annotations

import dataclasses

import numpy as np

from deploykit.validation.compare import FP32_NOISE_MARGIN, OutputComparison, Tolerance, compare_output, max_abs_error
from deploykit.validation.dependence import inconclusive_outputs
from deploykit.validation.inputs import batch_size
from deploykit.errors import BadInputError, DeployKitError, error_summary


@dataclasses.dataclass
class BatchRun:
    batch: int
    outputs: list[OutputComparison]

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    def output(self, name: str) -> OutputComparison:
        return next(o for o in self.outputs if o.name == name)


@dataclasses.dataclass
class CandidateValidation:
    """One candidate (e.g. ONNX Runtime on the final graph) against the reference."""

    label: str
    backend: str
    runs: list[BatchRun]
    #: output name -> why matching it proves nothing (it does not depend on the input)
    inconclusive: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(run.passed for run in self.runs)

    def failures(self) -> list[str]:
        return [
            f"{self.label}: output {o.name} (batch {run.batch}): {reason}"
            for run in self.runs for o in run.outputs for reason in o.failures
        ]

    def rounding_notes(self) -> list[str]:
        """One line per output that passed by float64 (judge_by_float64), at its worst batch."""
        worst = {}
        for run in self.runs:
            for output in run.outputs:
                judged = output.metrics.get("float64", {})
                if output.waived and judged["max_abs"] >= worst.get(output.name, (-1.0,))[0]:
                    worst[output.name] = (judged["max_abs"], judged["fp32_max_abs"], run.batch)
        return [
            f"output {name} (batch {batch}) misses PyTorch fp32 by more than the tolerance, but errs "
            f"{error:.3g} against float64 where fp32 itself errs {fp32:.3g} (within {FP32_NOISE_MARGIN:g}x): "
            "the model amplifies fp32 rounding; counted as a pass (docs/validation.md)"
            for name, (error, fp32, batch) in worst.items()
        ]

    def inconclusive_notes(self) -> list[str]:
        return [f"output {name}: {reason}" for name, reason in self.inconclusive.items()]

    def to_json(self) -> dict:
        return {
            "label": self.label,
            "backend": self.backend,
            "passed": self.passed,
            "inconclusive": self.inconclusive,
            "runs": [{"batch": r.batch, "passed": r.passed, "outputs": [o.to_json() for o in r.outputs]} for r in self.runs],
        }


class Remembered:
    """A reference run once per feed set (keyed by the feed set's identity): the candidates, the
    auto-fix and the validation after it compare with the same run, and the reference does not run
    again each time. Its float64 copy is remembered the same way."""

    def __init__(self, runner):
        self.runner, self.name, self._runs, self._exact = runner, runner.name, {}, None

    @property
    def output_names(self) -> list[str] | None:
        return self.runner.output_names

    def run(self, feeds: dict) -> dict:
        key = id(feeds)
        if key not in self._runs:
            self._runs[key] = (feeds, self.runner.run(feeds))  # the feeds are kept: their id stays theirs
        return self._runs[key][1]

    def in_float64(self) -> Remembered:
        if self._exact is None:
            self._exact = Remembered(self.runner.in_float64())
        return self._exact


def validate(
    reference,
    candidates: dict[str, object],
    feed_sets: list[dict[str, np.ndarray]],
    tolerances: dict[str, Tolerance],
    fp32_peer: str | None = None,
    check_dependence: bool = True,
) -> list[CandidateValidation]:
    """Compare each candidate runner with ``reference`` on every feed set.

    Outputs that miss only default numeric tolerances are then judged against a float64 run of
    the reference (``OutputComparison.judge_by_float64``), which runs only when there are some.
    ``fp32_peer`` labels a candidate that is another fp32 implementation of the model (the plain
    export): where it passes, its error against float64 counts as fp32 rounding too.
    ``check_dependence``: name the outputs that do not depend on the input (``inconclusive``),
    which may run the reference on one more input.
    """
    references = [run_checked(reference, feeds, BadInputError) for feeds in feed_sets]
    inconclusive = inconclusive_outputs(reference, feed_sets, references) if check_dependence else {}
    results, actuals = [], {}
    for label, runner in candidates.items():
        runs, actuals[label] = [], []
        for feeds, expected in zip(feed_sets, references):
            actual = run_checked(runner, feeds, DeployKitError)
            actuals[label].append(actual)
            runs.append(BatchRun(batch_size(feeds), [
                compare_output(name, expected[name], actual[name], tolerances[name]) for name in expected
            ]))
        results.append(CandidateValidation(label, runner.name, runs, inconclusive))
    misses = [(result, index, output) for result in results for index, run in enumerate(result.runs)
              for output in run.outputs if output.may_be_rounding]
    if misses:
        peer = next((result for result in results if result.label == fp32_peer), None)
        _judge_by_float64(reference, feed_sets, references, actuals, misses, peer)
    return results


def _judge_by_float64(reference, feed_sets, references, actuals, misses, peer) -> None:
    """Run the reference in float64 on every feed set and judge each miss by it (``peer``: the
    fp32 peer's validation, or None). The peer is judged first, by PyTorch's rounding alone;
    where it then passes, its error counts as fp32 rounding for the other candidates."""
    try:
        exact_runner = reference.in_float64()
        exact = [exact_runner.run(feeds) for feeds in feed_sets]
    except Exception as error:  # a model that fixes its dtypes cannot run in float64: keep the verdict
        for _, _, output in misses:
            output.metrics["float64"] = {"unavailable": error_summary(error)[:200]}
        return
    # fp32 rounding of the model on each input: PyTorch's own error, then also the peer's where it passes
    rounding = {name: [max_abs_error(expected[name], exact[i][name]) for i, expected in enumerate(references)]
                for name in references[0]}
    for result, index, output in misses:
        if result is peer:
            _judge(output, index, references, actuals[result.label], exact, rounding, None)
    peer_errors = {}
    if peer is not None:
        for name, errors in rounding.items():
            peer_errors[name] = [max_abs_error(actuals[peer.label][i][name], exact[i][name])
                                 if run.output(name).passed else None for i, run in enumerate(peer.runs)]
            rounding[name] = [max(error, peer or 0.0) for error, peer in zip(errors, peer_errors[name])]
    for result, index, output in misses:
        if result is not peer:
            peer_error = peer_errors[output.name][index] if peer_errors else None
            _judge(output, index, references, actuals[result.label], exact, rounding, peer_error)


def _judge(output, index, references, actual, exact, rounding, peer_error) -> None:
    """Judge one miss by float64, with the largest fp32 rounding seen on the other inputs as well."""
    name = output.name
    elsewhere = max((error for i, error in enumerate(rounding[name]) if i != index), default=0.0)
    output.judge_by_float64(references[index][name], actual[index][name], exact[index][name], peer_error, elsewhere)


def run_checked(runner, feeds, error_type) -> dict[str, np.ndarray]:
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
            f"{runner.name} fails at batch {batch_size(feeds)}: {error_summary(error)[:300]}; {hint}"
        ) from error
