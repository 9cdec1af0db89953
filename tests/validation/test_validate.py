"""validate(): candidates against the PyTorch reference, and misses judged against float64.

Deep networks with large activations amplify rounding, so PyTorch fp32 itself can miss the
exact result by more than the fp32 tolerance; a converted graph that misses PyTorch fp32 by
as much has lost nothing. These tests use a real PyTorch reference (TorchRunner) of a model
whose fp32 rounding is large on purpose (model_zoo.Cancelling), and candidates with known errors.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from deploykit.backends.torch.runner import TorchRunner
from deploykit.validation.compare import Tolerance
from deploykit.conversion.loading import LoadedModel
from deploykit.validation.validate import validate
from model_zoo import Cancelling

FEEDS = [{"x": np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)}]
FP32 = {"output": Tolerance.for_precision("fp32")}


class FixedDtype(Cancelling):
    """Casts to fp32 inside forward: its float64 copy cannot run (a matmul of mixed dtypes)."""

    def forward(self, x):
        return super().forward(x.float())


def reference(module: nn.Module) -> TorchRunner:
    return TorchRunner(LoadedModel(module.eval(), "module", None, ["x"]), ["x"])


class Offset:
    """A candidate: the exact (float64) result plus ``factor`` times PyTorch fp32's own error."""

    name = "numpy"

    def __init__(self, module: nn.Module, factor: float):
        self.module, self.factor = module, factor

    def run(self, feeds):
        x = torch.from_numpy(feeds["x"])
        with torch.no_grad():
            exact = Cancelling.forward(copy.deepcopy(self.module).double(), x.double()).numpy()
            fp32 = Cancelling.forward(self.module, x).double().numpy()
        return {"output": exact + self.factor * (fp32 - exact)}


def run(module, factor, tolerances=FP32):
    torch.manual_seed(0)
    [result] = validate(reference(module), {"candidate": Offset(module, factor)}, FEEDS, tolerances)
    return result.runs[0].outputs[0]


@pytest.mark.parametrize("peer_factor, passes", [(2.0, True), (-2.0, True), (5.0, False), (None, False)])
def test_a_passing_fp32_peer_counts_as_rounding_too(peer_factor, passes):
    """A candidate at 6x PyTorch fp32's error passes only next to a peer that errs 2x and passes."""
    module = Cancelling()
    candidates = {"candidate": Offset(module, 6.0)}
    if peer_factor is not None:
        candidates["peer"] = Offset(module, peer_factor)
    results = validate(reference(module), candidates, FEEDS, FP32, fp32_peer="peer")
    output = results[0].runs[0].outputs[0]
    assert output.passed is passes
    if peer_factor is not None:
        assert results[1].runs[0].outputs[0].passed is (abs(peer_factor) <= 4)
        assert ("plain_export_max_abs" in output.metrics["float64"]) is (abs(peer_factor) <= 4)


def test_the_exact_result_misses_pytorch_fp32_yet_passes():
    output = run(Cancelling(), factor=0.0)
    assert output.passed and output.waived and output.metrics["float64"]["max_abs"] == 0.0


def test_a_candidate_within_fp32_rounding_passes_with_its_misses_recorded():
    output = run(Cancelling(), factor=-1.0)  # as far from float64 as PyTorch fp32, other side
    assert output.passed and output.failures == [] and output.waived
    judged = output.metrics["float64"]
    assert judged["max_abs"] == pytest.approx(judged["pytorch_fp32_max_abs"], rel=1e-6) == judged["fp32_max_abs"]
    assert judged["pytorch_fp32_max_abs"] > 1e-2


def test_a_candidate_beyond_the_margin_still_fails():
    output = run(Cancelling(), factor=6.0)
    assert not output.passed and output.waived == []
    assert any("more than fp32 rounding explains" in reason for reason in output.failures)


def test_a_tolerance_of_the_users_is_kept_as_given():
    tolerances = {"output": Tolerance.for_precision("fp32").updated("atol=1e-4")}
    output = run(Cancelling(), factor=-1.0, tolerances=tolerances)
    assert not output.passed and "float64" not in output.metrics


def test_a_model_that_cannot_run_in_float64_keeps_its_verdict():
    output = run(FixedDtype(), factor=-1.0)
    assert not output.passed and output.waived == []
    assert "unavailable" in output.metrics["float64"]


def test_float64_runs_only_when_an_output_misses():
    class NoFloat64(TorchRunner):
        def in_float64(self):
            raise AssertionError("float64 run without a miss")

    module = nn.Linear(64, 8).eval()
    runner = NoFloat64(LoadedModel(module, "module", None, ["x"]), ["x"])
    [result] = validate(runner, {"same": reference(module)}, FEEDS, FP32)
    assert result.passed


def test_the_float64_copy_leaves_the_reference_in_fp32():
    module = Cancelling()
    runner = reference(module)
    runner.run(FEEDS[0])
    exact = runner.in_float64().run(FEEDS[0])["output"]
    assert exact.dtype == np.float64 and module.weight.dtype == torch.float32
    assert runner.run(FEEDS[0])["output"].dtype == np.float32
