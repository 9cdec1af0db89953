"""Unit tests of ``deploykit.validation.compare``: metrics, the pass/fail rules and the failure messages.

Pure numpy and fast. Each case uses concrete numbers so that a failure shows exactly which
rule of docs/validation.md (atol + rtol*|ref|, min_cosine, NaN/Inf placement, min_top1)
was broken, and that a suggested tolerance ("atol=... would pass") really passes.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from deploykit.validation.compare import Tolerance, compare_output, parse_tolerances, tolerance_excess
from deploykit.errors import BadInputError

FP32 = Tolerance.for_precision("fp32")  # atol=1e-4, rtol=1e-3, min_cosine=0.99999, no min_top1
#: Only the elementwise rule matters: cosine and top-1 are switched off.
ELEMENTWISE = Tolerance(atol=1e-4, rtol=1e-3, min_cosine=-1.0)
#: Nothing but NaN/Inf placement and top-1 can fail.
LOOSE = Tolerance(atol=10.0, rtol=0.0, min_cosine=-1.0)


def compare(ref, cand, tol: Tolerance = FP32):
    return compare_output("out", np.asarray(ref, dtype=np.float64), np.asarray(cand, dtype=np.float64), tol)


def failure_with(result, text: str) -> str:
    """The one failure message containing ``text``; fails the test when there is none."""
    matches = [message for message in result.failures if text in message]
    assert len(matches) == 1, f"expected one failure containing {text!r}, got {result.failures}"
    return matches[0]


def suggested(message: str, key: str) -> str:
    """The value of ``key=VALUE would pass`` in a failure message."""
    match = re.search(rf"{key}=(\S+) would pass", message)
    assert match, f"no '{key}=... would pass' in {message!r}"
    return match.group(1)


# --- identical arrays and the elementwise rule -------------------------------------------

def test_identical_arrays_pass_with_zero_error_and_unit_cosine():
    ref = np.linspace(-3.0, 5.0, 24).reshape(2, 3, 4)
    result = compare(ref, ref.copy())
    assert result.passed and result.failures == []
    assert result.shape == (2, 3, 4)
    assert result.metrics["max_abs"] == 0.0
    assert result.metrics["mean_abs"] == 0.0
    assert result.metrics["p99_abs"] == 0.0
    assert result.metrics["max_rel"] == 0.0
    assert result.metrics["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert result.metrics["ref_max_abs"] == 5.0
    assert (result.metrics["nan"], result.metrics["inf"]) == (0, 0)


REF = np.array([2.0, 1.0, -3.0, 0.5])
BOUND_AT_2 = 1e-4 + 1e-3 * 2.0  # atol + rtol*|ref| for the first element: 0.0021


@pytest.mark.parametrize("factor, passes", [(0.999, True), (1.001, False)])
def test_error_just_inside_the_bound_passes_and_just_outside_fails(factor, passes):
    cand = REF.copy()
    cand[0] += factor * BOUND_AT_2
    result = compare(REF, cand)
    assert result.metrics["max_abs"] == pytest.approx(factor * BOUND_AT_2, rel=1e-9)
    assert result.metrics["max_rel"] == pytest.approx(factor * BOUND_AT_2 / 2.0, rel=1e-9)
    assert result.passed is passes
    if not passes:
        failure_with(result, "exceeds atol=0.0001 + rtol=0.001*|ref|")


def test_elementwise_failure_names_the_numbers_and_the_atol_that_would_pass():
    # The example of docs/validation.md: |d| = 3.1e-4 at |ref| = 0.02.
    result = compare([0.02, 1.0], [0.02 + 3.1e-4, 1.0], ELEMENTWISE)
    assert not result.passed
    message = failure_with(result, "exceeds")
    assert message.startswith("|d| = 0.00031 at |ref| = 0.02 exceeds atol=0.0001 + rtol=0.001*|ref|")
    # needed: 3.1e-4 - 1e-3 * 0.02 = 2.9e-4, rounded up to 1/2/5 x 10^k
    assert suggested(message, "atol") == "0.0005"


def test_failure_names_the_worst_element_relative_to_its_bound():
    # 0.05 at |ref| = 100 is within 1e-4 + 1e-3*100; 0.01 at |ref| = 0 is not.
    result = compare([100.0, 0.0], [100.05, 0.01], ELEMENTWISE)
    assert failure_with(result, "exceeds").startswith("|d| = 0.01 at |ref| = 0 ")


@pytest.mark.parametrize("ref_value, error", [
    (0.02, 3.1e-4),
    (2.0, 0.01),
    (0.0, 0.3),
    (1.0, 0.002),  # in floats, |d| - rtol*|ref| = 1.0000000000000018e-3, a hair above 1e-3
    (0.5, 0.001),
])
def test_suggested_atol_really_passes(ref_value, error):
    ref = np.array([ref_value, 1.0])
    cand = ref + np.array([error, 0.0])
    result = compare(ref, cand, ELEMENTWISE)
    atol = suggested(failure_with(result, "exceeds"), "atol")
    retried = compare(ref, cand, ELEMENTWISE.updated(f"atol={atol}"))
    assert retried.passed, f"atol={atol} was suggested but fails: {retried.failures}"


# --- cosine -------------------------------------------------------------------------------

def test_cosine_below_min_cosine_fails_with_a_suggestion_that_passes():
    ref = np.array([1.0, 0.0])
    cand = np.array([1.0, 0.1])  # cosine = 1 / sqrt(1.01) = 0.9950372
    tol = Tolerance(atol=1.0, rtol=0.0, min_cosine=0.999)
    result = compare(ref, cand, tol)
    assert result.metrics["cosine"] == pytest.approx(1 / np.sqrt(1.01), rel=1e-12)
    message = failure_with(result, "cosine")
    assert message.startswith("cosine 0.9950372 < min_cosine=0.999")
    value = suggested(message, "min_cosine")
    assert value == "0.995037"
    assert compare(ref, cand, tol.updated(f"min_cosine={value}")).passed


def test_all_zero_outputs_have_unit_cosine_and_pass():
    assert compare(np.zeros(5), np.zeros(5)).metrics["cosine"] == 1.0
    assert compare(np.zeros(5), np.zeros(5)).passed


# --- NaN and Inf --------------------------------------------------------------------------

@pytest.mark.parametrize("bad, kind, counter", [(np.nan, "NaN", "nan"), (np.inf, "Inf", "inf")])
def test_nan_or_inf_in_candidate_where_reference_is_finite_fails(bad, kind, counter):
    ref = np.array([1.0, 2.0, 3.0])
    cand = ref.copy()
    cand[1] = bad
    result = compare(ref, cand)
    assert not result.passed
    assert result.metrics[counter] == 1 and result.metrics[f"{counter}_ref"] == 0
    assert failure_with(result, kind) == f"1 elements are {kind} in one result but not the other"


@pytest.mark.parametrize("bad, kind", [(np.nan, "NaN"), (np.inf, "Inf")])
def test_nan_or_inf_in_reference_where_candidate_is_finite_fails(bad, kind):
    cand = np.array([1.0, 2.0, 3.0])
    ref = cand.copy()
    ref[2] = bad
    failure_with(compare(ref, cand), kind)


@pytest.mark.parametrize("bad, counter", [(np.nan, "nan"), (np.inf, "inf"), (-np.inf, "inf")])
def test_matching_nan_or_inf_in_both_passes(bad, counter):
    ref = np.array([1.0, bad, 3.0, -2.0])
    result = compare(ref, ref.copy())
    assert result.passed, result.failures
    assert result.metrics[counter] == result.metrics[f"{counter}_ref"] == 1
    assert result.metrics["max_abs"] == 0.0
    assert result.metrics["cosine"] == pytest.approx(1.0, abs=1e-12)


def test_inf_of_the_opposite_sign_fails():
    # +Inf in the reference but -Inf in the candidate is not "Inf where the reference has it".
    ref = np.array([1.0, np.inf, 3.0])
    cand = np.array([1.0, -np.inf, 3.0])
    assert not compare(ref, cand).passed


# --- top-1 agreement ----------------------------------------------------------------------

LOGITS_REF = np.array([[1.0, 0.9, 0.0], [0.0, 1.0, 0.2], [0.3, 0.0, 1.0], [1.0, 0.0, 0.9]])
LOGITS_CAND = LOGITS_REF.copy()
LOGITS_CAND[3] = [0.9, 0.0, 1.0]  # last row flips from class 0 to class 2: 3 of 4 agree


def test_top1_agreement_is_the_share_of_rows_whose_argmax_agrees():
    assert compare(LOGITS_REF, LOGITS_CAND, LOOSE).metrics["top1_agreement"] == 0.75
    assert compare(LOGITS_REF, LOGITS_REF, LOOSE).metrics["top1_agreement"] == 1.0


def test_top1_is_not_enforced_without_min_top1():
    assert LOOSE.min_top1 is None
    assert compare(LOGITS_REF, LOGITS_CAND, LOOSE).passed


@pytest.mark.parametrize("min_top1, passes", [(0.75, True), (0.8, False)])
def test_top1_is_enforced_when_min_top1_is_set(min_top1, passes):
    result = compare(LOGITS_REF, LOGITS_CAND, LOOSE.updated(f"min_top1={min_top1}"))
    assert result.passed is passes
    if not passes:
        assert failure_with(result, "top-1") == "top-1 agreement 0.7500 < min_top1=0.8"


@pytest.mark.parametrize("shape", [(12,), (12, 1), (2, 3, 2)])
def test_top1_is_only_computed_for_2d_logits(shape):
    ref = np.arange(12.0).reshape(shape)
    assert "top1_agreement" not in compare(ref, ref).metrics


# --- shapes -------------------------------------------------------------------------------

def test_shape_mismatch_fails_with_a_message():
    result = compare(np.zeros((2, 3)), np.zeros((3, 2)))
    assert not result.passed
    assert result.failures == ["shape (3, 2) differs from the reference's (2, 3)"]
    assert result.to_json()["shape"] == [2, 3]


# --- parse_tolerances ---------------------------------------------------------------------

OUTPUTS = ["logits", "features"]


def test_parse_tolerances_defaults_to_the_precision():
    tolerances = parse_tolerances([], "fp16", OUTPUTS)
    assert tolerances == {name: Tolerance(1e-2, 1e-2, 0.999, 0.99, precision="fp16") for name in OUTPUTS}


def test_unnamed_override_applies_to_every_output():
    tolerances = parse_tolerances(["atol=1e-3,min_top1=0.5"], "fp32", OUTPUTS)
    assert tolerances == {name: Tolerance(1e-3, 1e-3, 0.99999, 0.5, user_set=True) for name in OUTPUTS}


def test_named_override_applies_to_that_output_only():
    tolerances = parse_tolerances(["atol=1e-3", "logits:rtol=0.05,min_cosine=0.9"], "fp32", OUTPUTS)
    assert tolerances["logits"] == Tolerance(1e-3, 0.05, 0.9, None, user_set=True)
    assert tolerances["features"] == Tolerance(1e-3, 1e-3, 0.99999, None, user_set=True)


def test_output_names_containing_a_colon_can_be_targeted():
    tolerances = parse_tolerances(["out:0:atol=0.5"], "fp32", ["out:0", "out:1"])
    assert tolerances["out:0"].atol == 0.5 and tolerances["out:1"].atol == 1e-4


@pytest.mark.parametrize("text, expected", [
    ("probs:atol=1e-3", ["'probs'", "logits, features"]),
    ("tolerance=1e-3", ["unknown key 'tolerance'", "atol, rtol, min_cosine, min_top1 or top1_tie_margin"]),
    ("logits:atl=1e-3", ["unknown key 'atl'"]),
    ("atol=small", ["'atol=small' needs a number"]),
])
def test_parse_tolerances_rejects_bad_overrides_naming_the_problem(text, expected):
    with pytest.raises(BadInputError) as raised:
        parse_tolerances([text], "fp32", OUTPUTS)
    for part in expected:
        assert part in str(raised.value)


# --- summary metrics and the histogram sample ---------------------------------------------

def test_mean_and_p99_match_numpy_on_a_known_array():
    error = np.arange(1000) * 1e-3  # 0, 0.001, ..., 0.999
    result = compare(np.zeros(1000), error, ELEMENTWISE)
    assert result.metrics["mean_abs"] == pytest.approx(0.4995, rel=1e-12)
    assert result.metrics["mean_abs"] == pytest.approx(float(np.mean(error)), rel=1e-12)
    assert result.metrics["p99_abs"] == pytest.approx(float(np.percentile(error, 99)), rel=1e-12)
    assert result.metrics["p99_abs"] == pytest.approx(0.98901, rel=1e-9)
    assert result.metrics["max_abs"] == pytest.approx(0.999)


def test_error_sample_is_all_errors_for_a_small_array():
    result = compare(np.zeros(10), np.arange(10.0), LOOSE)
    np.testing.assert_array_equal(np.sort(result.abs_error_sample), np.arange(10.0))


def test_histogram_sample_is_capped_for_a_huge_array():
    size = 300_000
    error = np.linspace(0.0, 1.0, size)
    result = compare(np.zeros(size), error, LOOSE)
    sample = result.abs_error_sample
    assert sample.shape == (200_000,)
    assert np.isin(sample, error).all()
    assert len(np.unique(sample)) == sample.size  # drawn without replacement


# --- judging a numeric miss against float64 -----------------------------------------------

EXACT = np.array([[1000.0, -250.0, 3.0], [0.5, 12.0, -7.0]])
#: PyTorch fp32's own rounding error in this model: far above atol + rtol * |ref|.
FP32_ERROR = np.array([[0.9, -0.4, 0.0], [0.0, 0.2, 0.0]])


def test_a_miss_within_pytorch_fp32_rounding_passes_and_keeps_its_reasons():
    ref = EXACT + FP32_ERROR
    cand = EXACT - 2 * FP32_ERROR  # 3x the error against ref, 2x against float64
    result = compare(ref, cand)
    assert not result.passed and result.may_be_rounding
    reasons = list(result.failures)
    result.judge_by_float64(ref, cand, EXACT)
    assert result.passed and result.failures == [] and result.waived == reasons
    assert result.metrics["float64"] == {"pytorch_fp32_max_abs": pytest.approx(0.9), "fp32_max_abs": pytest.approx(0.9),
                                         "max_abs": pytest.approx(1.8)}
    assert result.to_json()["waived"] == reasons


def test_a_miss_beyond_the_margin_fails_and_says_it_is_not_rounding():
    ref = EXACT + FP32_ERROR
    cand = EXACT + 5 * FP32_ERROR  # 5x PyTorch fp32's error against float64 (margin 4x)
    result = compare(ref, cand)
    result.judge_by_float64(ref, cand, EXACT)
    assert not result.passed and result.waived == []
    message = failure_with(result, "more than fp32 rounding explains")
    assert "4.5" in message and "0.9" in message


def test_a_peer_implementation_widens_what_counts_as_fp32_rounding():
    ref = EXACT + FP32_ERROR
    cand = EXACT + 5 * FP32_ERROR
    result = compare(ref, cand)
    result.judge_by_float64(ref, cand, EXACT, peer_error=1.8)  # the peer errs 2x PyTorch fp32
    assert result.passed and result.metrics["float64"]["fp32_max_abs"] == 1.8
    assert result.metrics["float64"]["plain_export_max_abs"] == 1.8


def test_rounding_seen_on_other_inputs_counts_too():
    """How far a model amplifies rounding is the model's: a lucky low sample on this input does
    not decide alone (timm efficientnet_b0, random statistics: PyTorch fp32 erred 0.015 on one
    input and 0.031 on another, where ONNX Runtime's plain export erred 0.146 and 0.021)."""
    ref = EXACT + FP32_ERROR
    cand = EXACT + 5 * FP32_ERROR
    alone, widened = compare(ref, cand), compare(ref, cand)
    alone.judge_by_float64(ref, cand, EXACT)
    widened.judge_by_float64(ref, cand, EXACT, other_inputs_error=1.2)
    assert not alone.passed and widened.passed
    assert widened.metrics["float64"]["fp32_max_abs"] == 1.2 == widened.metrics["float64"]["other_inputs_fp32_max_abs"]


@pytest.mark.parametrize("case", ["nan", "shape", "user tolerance", "fp16 graph", "passes"])
def test_only_default_numeric_misses_may_be_judged_by_float64(case):
    ref = EXACT + FP32_ERROR
    cand = EXACT - 2 * FP32_ERROR
    if case == "nan":
        cand[0, 2] = np.nan
        result = compare(ref, cand)
    elif case == "shape":
        result = compare(ref, cand[:1])
    elif case == "user tolerance":
        result = compare(ref, cand, FP32.updated("atol=1e-3"))
    elif case == "fp16 graph":  # its error is fp16 rounding, judged by the fp16 tolerances alone
        result = compare(ref, EXACT + 100 * FP32_ERROR, Tolerance.for_precision("fp16"))
    else:
        result = compare(ref, ref.copy())
    assert not result.may_be_rounding


def test_tolerance_excess_is_one_at_the_edge_of_the_tolerance():
    """Auto-fix ranks graphs by it: the worst element's |d| over its bound, or the cosine's shortfall."""
    tol = Tolerance.for_precision("fp16")  # atol = rtol = 1e-2
    ref = np.array([1.0, -100.0, 3.0], dtype=np.float32)
    edge = ref + np.array([0.02, 0.0, 0.0], dtype=np.float32)  # bound at |ref| = 1: 0.01 + 0.01
    assert tolerance_excess(ref, edge, tol) == pytest.approx(1.0, rel=1e-4)
    assert tolerance_excess(ref, ref + np.float32(0.005) * np.sign(ref), tol) < 0.5
    assert tolerance_excess(ref, np.array([1.0, np.nan, 3.0], dtype=np.float32), tol) == np.inf
    assert tolerance_excess(ref, -ref, tol) > 1  # cosine -1 and every element off
