"""Compare a candidate's outputs with the reference's: metrics and tolerances (pure numpy).

An output passes when every finite element satisfies ``|d| <= atol + rtol * |ref|``,
the cosine similarity reaches ``min_cosine``, NaN/Inf appear exactly where the
reference has them, and (when ``min_top1`` is set) 2-D logits agree on the top class.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from deploykit.errors import BadInputError

#: Default tolerances per precision; documented in docs/validation.md.
DEFAULT_TOLERANCES = {
    "fp32": {"atol": 1e-4, "rtol": 1e-3, "min_cosine": 0.99999, "min_top1": None},
    "fp16": {"atol": 1e-2, "rtol": 1e-2, "min_cosine": 0.999, "min_top1": 0.99},
    "bf16": {"atol": 5e-2, "rtol": 5e-2, "min_cosine": 0.999, "min_top1": 0.98},
}
_REL_EPS = 1e-12
#: Largest number of error samples kept for the report's histogram.
_HISTOGRAM_SAMPLES = 200_000


@dataclasses.dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    min_cosine: float
    min_top1: float | None = None

    @classmethod
    def for_precision(cls, precision: str) -> Tolerance:
        return cls(**DEFAULT_TOLERANCES[precision])

    def updated(self, text: str) -> Tolerance:
        """Apply ``atol=1e-3,rtol=1e-2,min_cosine=0.999,min_top1=0.99`` overrides."""
        changes = {}
        for item in filter(None, text.split(",")):
            key, _, value = item.partition("=")
            if key not in {f.name for f in dataclasses.fields(self)}:
                raise BadInputError(
                    f"--tolerance: unknown key {key!r}; use atol, rtol, min_cosine or min_top1"
                )
            try:
                changes[key] = float(value)
            except ValueError:
                raise BadInputError(f"--tolerance: {item!r} needs a number, e.g. {key}=1e-3") from None
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def parse_tolerances(texts: list[str], precision: str, output_names: list[str]) -> dict:
    """Per-output tolerances from ``[OUTPUT:]key=value,...`` strings; unnamed ones apply to all."""
    base = Tolerance.for_precision(precision)
    per_output = {name: base for name in output_names}
    for text in texts:
        target, sep, rest = text.rpartition(":")
        names = [target] if sep else output_names
        if sep and target not in per_output:
            raise BadInputError(
                f"--tolerance {text!r}: the model has no output {target!r}; "
                f"outputs are {', '.join(output_names)}"
            )
        for name in names:
            per_output[name] = per_output[name].updated(rest)
    return per_output


@dataclasses.dataclass
class OutputComparison:
    """Metrics of one output, its verdict, and error samples for the report's plot."""

    name: str
    shape: tuple[int, ...]
    metrics: dict
    tolerance: Tolerance
    passed: bool
    failures: list[str]
    abs_error_sample: np.ndarray = dataclasses.field(repr=False)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "passed": self.passed,
            "failures": self.failures,
            "metrics": self.metrics,
            "tolerance": self.tolerance.to_json(),
        }


def _cosine(ref: np.ndarray, cand: np.ndarray) -> float:
    norm = float(np.linalg.norm(ref) * np.linalg.norm(cand))
    if norm == 0.0:
        return 1.0 if not ref.any() and not cand.any() else 0.0
    return float(np.dot(ref, cand) / norm)


def _nice_ceiling(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten that is >= value, so suggestions read well."""
    if value <= 0:
        return 0.0
    exponent = math.floor(math.log10(value))
    while True:
        for step in (1, 2, 5):
            candidate = float(f"{step * 10.0**exponent:.3g}")
            if candidate >= value:
                return candidate
        exponent += 1


def compare_output(name: str, ref: np.ndarray, cand: np.ndarray, tol: Tolerance) -> OutputComparison:
    if ref.shape != cand.shape:
        return OutputComparison(
            name, ref.shape, {}, tol, False,
            [f"shape {cand.shape} differs from the reference's {ref.shape}"], np.zeros(0),
        )
    ref64 = ref.astype(np.float64).ravel()
    cand64 = cand.astype(np.float64).ravel()
    finite = np.isfinite(ref64) & np.isfinite(cand64)
    diff = np.abs(ref64[finite] - cand64[finite])
    magnitude = np.abs(ref64[finite])
    metrics = {
        "max_abs": float(diff.max(initial=0.0)),
        "mean_abs": float(diff.mean()) if diff.size else 0.0,
        "p99_abs": float(np.percentile(diff, 99)) if diff.size else 0.0,
        "max_rel": float((diff / (magnitude + _REL_EPS)).max(initial=0.0)),
        "cosine": _cosine(ref64[finite], cand64[finite]),
        "ref_max_abs": float(magnitude.max(initial=0.0)),
        "nan_ref": int(np.isnan(ref64).sum()),
        "nan": int(np.isnan(cand64).sum()),
        "inf_ref": int(np.isinf(ref64).sum()),
        "inf": int(np.isinf(cand64).sum()),
    }
    if ref.ndim == 2 and ref.shape[1] > 1:
        metrics["top1_agreement"] = float((ref.argmax(1) == cand.argmax(1)).mean())
    failures = _check(metrics, diff, magnitude, ref64, cand64, tol)
    sample = diff if diff.size <= _HISTOGRAM_SAMPLES else np.random.default_rng(0).choice(
        diff, _HISTOGRAM_SAMPLES, replace=False)
    return OutputComparison(name, ref.shape, metrics, tol, not failures, failures, sample)


def _check(metrics, diff, magnitude, ref64, cand64, tol: Tolerance) -> list[str]:
    """Reasons the output fails, each with the tolerance that would have passed."""
    failures = []
    excess = diff - (tol.atol + tol.rtol * magnitude)
    if diff.size and excess.max() > 0:
        worst = int(excess.argmax())
        need_atol = _nice_ceiling(float((diff - tol.rtol * magnitude).max()))
        failures.append(
            f"|d| = {diff[worst]:.3g} at |ref| = {magnitude[worst]:.3g} exceeds "
            f"atol={tol.atol:g} + rtol={tol.rtol:g}*|ref|; atol={need_atol:g} would pass"
        )
    if metrics["cosine"] < tol.min_cosine:
        failures.append(
            f"cosine {metrics['cosine']:.7f} < min_cosine={tol.min_cosine:g}; "
            f"min_cosine={math.floor(metrics['cosine'] * 1e6) / 1e6:g} would pass"
        )
    for kind, test in (("NaN", np.isnan), ("Inf", np.isinf)):
        mismatched = int((test(ref64) != test(cand64)).sum())
        if mismatched:
            failures.append(f"{mismatched} elements are {kind} in one result but not the other")
    flipped = int((np.isinf(ref64) & np.isinf(cand64) & (ref64 != cand64)).sum())
    if flipped:
        failures.append(f"{flipped} elements are Inf of the opposite sign to the reference's")
    top1 = metrics.get("top1_agreement")
    if tol.min_top1 is not None and top1 is not None and top1 < tol.min_top1:
        failures.append(f"top-1 agreement {top1:.4f} < min_top1={tol.min_top1:g}")
    return failures
