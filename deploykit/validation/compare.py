"""Compare a candidate's outputs with the reference's: metrics and tolerances (pure numpy).

An output passes when every finite element satisfies ``|d| <= atol + rtol * |ref|`` (unless
``atol`` is None: int8 judges by cosine and top-1 only),
the cosine similarity reaches ``min_cosine``, NaN/Inf appear exactly where the
reference has them, and (when ``min_top1`` is set) 2-D logits agree on the top class (with
``top1_tie_margin``, rows whose reference lead is within the output's typical error are near ties, not counted).
An fp32 output that misses only those numeric tolerances can still pass against a float64 run
of the model (``judge_by_float64``): when it errs no more than FP32_NOISE_MARGIN times fp32's
own rounding error.
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
    # int8's rounding step is a share of each tensor's calibrated range, not of each value: an
    # elementwise bound would have to be as loose as the largest activation, so direction (cosine)
    # and the decision (top-1) judge it (docs/precision.md).
    "int8": {"atol": None, "rtol": None, "min_cosine": 0.99, "min_top1": 0.95, "top1_tie_margin": 3.0},
    # fp8 e4m3 keeps 3 mantissa bits: each product's inputs are rounded by up to 1/16 of their value,
    # so, as for int8, direction and decision judge it, not an elementwise bound.
    "fp8": {"atol": None, "rtol": None, "min_cosine": 0.99, "min_top1": 0.95, "top1_tie_margin": 3.0},
}
_REL_EPS = 1e-12
#: Largest number of error samples kept for the report's histogram.
_HISTOGRAM_SAMPLES = 200_000
#: An output within this many times PyTorch fp32's own error against float64 lost nothing.
FP32_NOISE_MARGIN = 4.0


@dataclasses.dataclass(frozen=True)
class Tolerance:
    atol: float | None  # None: no elementwise bound (int8's defaults); --tolerance atol=... sets one
    rtol: float | None
    min_cosine: float
    min_top1: float | None = None
    #: a row whose reference top-1 leads the second class by less than this many times the output's RMS
    #: error is a near tie that the candidate's error may flip: not counted in top-1 agreement (int8)
    top1_tie_margin: float | None = None
    #: set by --tolerance: the user's bound holds as given, float64 does not judge it
    user_set: bool = False
    #: the precision of the graph it judges; only fp32 misses can be fp32 rounding
    precision: str = "fp32"

    @classmethod
    def for_precision(cls, precision: str) -> Tolerance:
        return cls(**DEFAULT_TOLERANCES[precision], precision=precision)

    def updated(self, text: str) -> Tolerance:
        """Apply ``atol=1e-3,rtol=1e-2,min_cosine=0.999,min_top1=0.99`` overrides."""
        changes = {}
        for item in filter(None, text.split(",")):
            key, _, value = item.partition("=")
            if key not in {"atol", "rtol", "min_cosine", "min_top1", "top1_tie_margin"}:
                raise BadInputError(
                    f"--tolerance: unknown key {key!r}; use atol, rtol, min_cosine, min_top1 or top1_tie_margin"
                )
            try:
                changes[key] = float(value)
            except ValueError:
                raise BadInputError(f"--tolerance: {item!r} needs a number, e.g. {key}=1e-3") from None
        return dataclasses.replace(self, **changes, user_set=True)

    @property
    def elementwise(self) -> tuple[float, float] | None:
        """(atol, rtol) of the elementwise bound, None where there is none; an unset half is 0."""
        if self.atol is None and self.rtol is None:
            return None
        return self.atol or 0.0, self.rtol or 0.0

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


def bundle_tolerances(bundle, overrides=()) -> dict[str, Tolerance]:
    """Per output of a converted ``Bundle``: the tolerances it was validated with (its precision's,
    then the conversion's --tolerance texts its manifest records), then ``overrides``."""
    names = [spec["name"] for spec in bundle.outputs]
    return parse_tolerances([*bundle.tolerances, *overrides], bundle.precision, names)


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
    #: an fp32 graph that misses only default numeric tolerances (no shape, NaN or Inf mismatch,
    #: no --tolerance of the user's): it may be fp32 rounding of the model itself, float64 may judge it
    may_be_rounding: bool = False
    #: failures waived because the error is fp32 rounding of the model itself (judge_by_float64)
    waived: list[str] = dataclasses.field(default_factory=list)

    def judge_by_float64(self, ref: np.ndarray, cand: np.ndarray, exact: np.ndarray,
                         peer_error: float | None = None, other_inputs_error: float = 0.0) -> None:
        """Pass a numeric failure that is no larger than fp32's own rounding error.

        Deep networks with large activations amplify rounding: PyTorch fp32 itself then misses
        the float64 result by more than the tolerance, and a graph that misses PyTorch fp32 by
        as much has lost nothing that fp32 can keep. ``peer_error``: the error against float64
        of another fp32 implementation that passed (the plain export), a second sample of how
        far fp32 rounding goes on these inputs. ``other_inputs_error``: the largest such error on
        the other validation inputs: how much a model amplifies rounding is a property of the
        model, and one input's sample can be a lucky low one.
        """
        pytorch_error, error = max_abs_error(ref, exact), max_abs_error(cand, exact)
        fp32_error = max(pytorch_error, peer_error or 0.0, other_inputs_error)
        self.metrics["float64"] = {"max_abs": error, "fp32_max_abs": fp32_error, "pytorch_fp32_max_abs": pytorch_error}
        if peer_error is not None:
            self.metrics["float64"]["plain_export_max_abs"] = peer_error
        if other_inputs_error:
            self.metrics["float64"]["other_inputs_fp32_max_abs"] = other_inputs_error
        if error <= FP32_NOISE_MARGIN * fp32_error:
            self.waived, self.failures, self.passed = self.failures, [], True
        else:
            self.failures.append(
                f"against float64 it errs by {error:.3g}, more than {FP32_NOISE_MARGIN:g}x "
                f"fp32's own {fp32_error:.3g}: more than fp32 rounding explains"
            )

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "passed": self.passed,
            "failures": self.failures,
            "waived": self.waived,
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


def finite_max_abs(array: np.ndarray) -> float:
    """The largest magnitude among an array's finite values, in float64 (0 for none)."""
    return float(np.abs(array[np.isfinite(array)].astype(np.float64)).max(initial=0.0))


def max_abs_error(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| in float64 over the elements finite in both."""
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    finite = np.isfinite(a64) & np.isfinite(b64)
    return float(np.abs(a64[finite] - b64[finite]).max(initial=0.0))


def tolerance_excess(ref: np.ndarray, cand: np.ndarray, tol: Tolerance) -> float:
    """How far ``cand`` is from passing ``tol``'s numeric checks, as one number: the worst of
    ``|d| / (atol + rtol * |ref|)`` and ``(1 - cosine) / (1 - min_cosine)``; 1 is the edge, inf
    a shape or NaN/Inf mismatch. Auto-fix ranks what it tries by it; top-1 is not in it."""
    ref64, cand64 = ref.astype(np.float64).ravel(), cand.astype(np.float64).ravel()
    if ref.shape != cand.shape or (np.isfinite(ref64) != np.isfinite(cand64)).any():
        return math.inf
    finite = np.isfinite(ref64)
    diff, magnitude = np.abs(ref64[finite] - cand64[finite]), np.abs(ref64[finite])
    elementwise = 0.0
    if bound := tol.elementwise:
        elementwise = float((diff / (bound[0] + bound[1] * magnitude + _REL_EPS)).max(initial=0.0))
    cosine_gap = (1.0 - _cosine(ref64[finite], cand64[finite])) / max(1.0 - tol.min_cosine, _REL_EPS)
    return max(elementwise, cosine_gap)


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
        metrics.update(_top1_metrics(ref, cand, tol.top1_tie_margin))
    numeric = _numeric_failures(metrics, diff, magnitude, tol)
    failures = numeric + _special_value_failures(ref64, cand64)
    sample = diff if diff.size <= _HISTOGRAM_SAMPLES else np.random.default_rng(0).choice(
        diff, _HISTOGRAM_SAMPLES, replace=False)
    return OutputComparison(name, ref.shape, metrics, tol, not failures, failures, sample,
                            may_be_rounding=bool(numeric) and len(numeric) == len(failures)
                            and not tol.user_set and tol.precision == "fp32")


def _top1_metrics(ref: np.ndarray, cand: np.ndarray, tie_margin: float | None) -> dict:
    """Top-1 agreement of 2-D logits; with ``tie_margin`` also over the rows that are no near tie.

    A row whose best class leads the second by less than ``tie_margin`` times the output's RMS error
    (over all rows: the candidate's typical error, so that one row's outsized error still counts) is
    decided by that error, not by the model: int8 flips such ties between random-weight logits at
    cosine 0.999, where every decided row agrees."""
    agree = ref.argmax(1) == cand.argmax(1)
    metrics = {"top1_agreement": float(agree.mean())}
    if tie_margin is None:
        return metrics
    ref64 = ref.astype(np.float64)
    top2 = np.sort(ref64, axis=1)[:, -2:]
    rms = float(np.sqrt(np.nanmean((cand.astype(np.float64) - ref64) ** 2)))
    decided = (top2[:, 1] - top2[:, 0]) >= tie_margin * rms
    metrics["top1_near_ties"] = int((~decided).sum())
    metrics["top1_agreement_decided"] = float(agree[decided].mean()) if decided.any() else None
    return metrics


def judged_top1(metrics: dict) -> float | None:
    """The top-1 agreement min_top1 judges: over the decided rows where near ties are set aside."""
    return metrics["top1_agreement_decided"] if "top1_agreement_decided" in metrics else metrics.get("top1_agreement")


def _numeric_failures(metrics, diff, magnitude, tol: Tolerance) -> list[str]:
    """Tolerances the output misses, each with the value that would have passed."""
    failures = []
    if bound := tol.elementwise:
        failures += _elementwise_failures(diff, magnitude, *bound)
    if metrics["cosine"] < tol.min_cosine:
        failures.append(
            f"cosine {metrics['cosine']:.7f} < min_cosine={tol.min_cosine:g}; "
            f"min_cosine={math.floor(metrics['cosine'] * 1e6) / 1e6:g} would pass"
        )
    top1 = judged_top1(metrics)
    if tol.min_top1 is not None and top1 is not None and top1 < tol.min_top1:
        ties = metrics.get("top1_near_ties")
        among = f" (over the rows that are no near tie; {ties} near ties)" if ties is not None else ""
        failures.append(f"top-1 agreement {top1:.4f}{among} < min_top1={tol.min_top1:g}")
    return failures


def _elementwise_failures(diff, magnitude, atol: float, rtol: float) -> list[str]:
    excess = diff - (atol + rtol * magnitude)
    if not diff.size or excess.max() <= 0:
        return []
    worst = int(excess.argmax())
    need_atol = _nice_ceiling(float((diff - rtol * magnitude).max()))
    return [f"|d| = {diff[worst]:.3g} at |ref| = {magnitude[worst]:.3g} exceeds "
            f"atol={atol:g} + rtol={rtol:g}*|ref|; atol={need_atol:g} would pass"]


def _special_value_failures(ref64, cand64) -> list[str]:
    """NaN and Inf where the reference has none, or of the other sign."""
    failures = []
    for kind, test in (("NaN", np.isnan), ("Inf", np.isinf)):
        mismatched = int((test(ref64) != test(cand64)).sum())
        if mismatched:
            failures.append(f"{mismatched} elements are {kind} in one result but not the other")
    flipped = int((np.isinf(ref64) & np.isinf(cand64) & (ref64 != cand64)).sum())
    if flipped:
        failures.append(f"{flipped} elements are Inf of the opposite sign to the reference's")
    return failures
