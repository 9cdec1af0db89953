"""Validations that prove nothing are named: outputs that are 0, or the same, for every input.

Unit tests of ``inconclusive_outputs`` on small functions, then ``convert`` and ``validate`` on
torchvision's tiny ViT as torchvision builds it (its head is zero: every output 0, exit 5), on an
MLP whose output is its last bias (exit 5), and on the same ViT with a random head (exit 0).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

import model_zoo
from deploykit.errors import EXIT_OK, EXIT_VALIDATION_INCONCLUSIVE
from deploykit.validation.dependence import PROBE_SEED, SAME_VALUE_SHARE, inconclusive_outputs
from deploykit_cli import convert, run_deploykit


class FunctionRunner:
    """A reference runner over a numpy function of ``x``; records the inputs it ran on."""

    def __init__(self, function):
        self.function, self.seen = function, []

    def run(self, feeds):
        self.seen.append(feeds["x"])
        return {"y": self.function(feeds["x"])}


def judge(function, *batches: int) -> tuple[dict, FunctionRunner]:
    rng = np.random.default_rng(0)
    feed_sets = [{"x": rng.standard_normal((b, 6)).astype(np.float32)} for b in batches]
    runner = FunctionRunner(function)
    references = [runner.run(feeds) for feeds in feed_sets]
    runner.seen.clear()
    return inconclusive_outputs(runner, feed_sets, references), runner


def test_an_output_that_depends_on_the_input_is_conclusive():
    found, runner = judge(lambda x: np.tanh(x) @ np.ones((6, 3), np.float32), 1, 3)
    assert found == {} and runner.seen == []  # four samples: no extra input needed


def test_zeros_for_every_input():
    found, _ = judge(lambda x: np.zeros((x.shape[0], 5), np.float32), 2, 4)
    assert set(found) == {"y"}
    assert "0 on every input it ran on (6)" in found["y"] and "initialised to zero" in found["y"]
    assert "--inputs" in found["y"] and "trained checkpoint" in found["y"]


def test_the_same_value_for_every_input():
    bias = np.array([0.5, -2.0, 3.0], np.float32)
    found, _ = judge(lambda x: np.broadcast_to(bias, (x.shape[0], 3)) + 1e-9 * x[:, :3], 1, 2, 4)
    assert "the same on every input it ran on (7;" in found["y"]
    assert "does not depend on the input" in found["y"]


def test_a_spread_above_rounding_is_conclusive():
    found, _ = judge(lambda x: 3.0 + 100 * SAME_VALUE_SHARE * 3.0 * x[:, :1], 2, 4)
    assert found == {}


def test_one_sample_is_compared_with_a_seeded_random_input():
    """Batch 1 alone cannot show dependence: the reference runs once more, on a seeded random input."""
    found, runner = judge(lambda x: np.full((x.shape[0], 2), 7.0, np.float32), 1)
    assert "the same on every input it ran on (2;" in found["y"]
    [probe] = runner.seen
    expected = np.random.default_rng(PROBE_SEED).standard_normal((1, 6), dtype=np.float32)
    np.testing.assert_array_equal(probe, expected)


def test_a_model_that_rejects_the_random_input_is_judged_on_its_own_inputs():
    def only_the_given_input(x):
        if x[0, 0] != given:
            raise ValueError("takes only real data")
        return np.full((1, 2), 7.0, np.float32)

    given = np.random.default_rng(0).standard_normal((1, 6)).astype(np.float32)[0, 0]
    assert judge(only_the_given_input, 1)[0] == {}  # one sample of a constant: undecided, not flagged
    given_zero = judge(lambda x: np.zeros((1, 2), np.float32) if x[0, 0] == given else 1 / 0, 1)[0]
    assert "0 on every input it ran on (1)" in given_zero["y"]


# --------------------------------------------------------------------------- through the CLI


def converted(tmp_path: Path, factory: str, spec: str, *extra: str):
    torch.manual_seed(0)
    torch.save(getattr(model_zoo, factory)().state_dict(), tmp_path / "weights.pt")
    result = convert(tmp_path, "weights.pt", "--factory", f"model_zoo:{factory}", "--input", spec,
                     "-o", "bundle", *extra)
    report = json.loads((tmp_path / "bundle" / "report.json").read_text())
    return result, report


def test_vit_as_torchvision_builds_it_is_inconclusive(tmp_path):
    result, report = converted(tmp_path, "vit_tiny_zero_head", "x:1x3x32x32")
    assert result.returncode == EXIT_VALIDATION_INCONCLUSIVE, result.stdout + result.stderr
    assert report["verdict"] == "inconclusive"
    assert "proves nothing for output" in report["summary"] and "worst max abs error 0" in report["summary"]
    [line] = report["inconclusive"]
    assert "0 on every input it ran on (2)" in line and "--inputs" in line
    printed = result.stdout + result.stderr
    assert "INCONCLUSIVE" in printed and "initialised to zero" in printed
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    assert manifest["validation"]["passed"]  # the bundle matched: it loads and runs
    assert set(manifest["validation"]["inconclusive"]) == {output["name"] for output in manifest["outputs"]}
    assert "INCONCLUSIVE" in (tmp_path / "bundle" / "report.html").read_text()

    again = run_deploykit("validate", "bundle", "weights.pt", "--factory", "model_zoo:vit_tiny_zero_head",
                          cwd=tmp_path, columns=120)
    assert again.returncode == EXIT_VALIDATION_INCONCLUSIVE, again.stdout + again.stderr
    assert "INCONCLUSIVE" in again.stdout + again.stderr


def test_a_constant_output_is_inconclusive(tmp_path):
    result, report = converted(tmp_path, "constant_output", "input:1x13", "--batch", "1:2:4")
    assert result.returncode == EXIT_VALIDATION_INCONCLUSIVE, result.stdout + result.stderr
    [line] = report["inconclusive"]
    assert "the same on every input it ran on (7;" in line


def test_the_same_vit_with_a_random_head_passes(tmp_path):
    result, report = converted(tmp_path, "vit_tiny", "x:1x3x32x32")
    assert result.returncode == EXIT_OK, result.stdout + result.stderr
    assert report["verdict"] == "pass" and report["inconclusive"] == []
