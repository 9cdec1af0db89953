"""``convert --inputs`` and ``debug --inputs`` cast an array to the declared dtype by ``run --inputs``'s
rule: only when every value survives; a cast that would change one is exit 2, naming the input and
both dtypes (deploykit.validation.inputs.cast_input, the one function all of them call)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import model_zoo
from converted_bundles import converted
from deploykit.errors import BadInputError
from deploykit.specs import InputSpec
from deploykit.validation.inputs import load_feeds
from deploykit_cli import run_deploykit

FEATURES = InputSpec("features", (1, 13))
#: float64 that float32 does not hold exactly: refused by every --inputs
ROUNDED = np.full((2, 13), 0.1)
#: float64 that float32 holds exactly: cast without a word
EXACT = np.arange(-13, 13).reshape(2, 13) / 4


def npz(tmp_path: Path, **arrays) -> Path:
    np.savez(tmp_path / "x.npz", **arrays)
    return tmp_path / "x.npz"


@pytest.mark.parametrize("array, spec, words", [
    (ROUNDED, FEATURES, "input features is float64, the model takes float32, and the cast would change 26 of its "
                        "values (e.g. 0.1 becomes 0.10000000149011612): save it as float32"),
    (np.full((2, 13), 1e300), FEATURES, "(e.g. 1e+300 becomes inf)"),
    (np.full((2, 13), 2**40), InputSpec("features", (1, 13), "int32"),
     "input features is int64, the model takes int32, and the cast would change 26"),
], ids=["rounding", "overflow", "int-wraparound"])
def test_a_cast_that_changes_a_value_is_refused(tmp_path, array, spec, words):
    with pytest.raises(BadInputError) as refused:
        load_feeds(npz(tmp_path, features=array), [spec])
    assert words in str(refused.value) and refused.value.exit_code == 2


@pytest.mark.parametrize("array, spec", [
    (EXACT, FEATURES), (np.arange(26).reshape(2, 13), InputSpec("features", (1, 13), "int32")),
], ids=["float64-exact", "int64-in-range"])
def test_an_exact_cast_passes(tmp_path, array, spec):
    (feeds,) = load_feeds(npz(tmp_path, features=array), [spec]).values()
    assert feeds.dtype == np.dtype(spec.dtype) and np.array_equal(feeds, array)


def assert_one_line_refusal(result, *words: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and all(word in lines[0] for word in words), result.stderr


def test_convert_refuses_inputs_the_cast_would_change(tmp_path):
    torch.save(model_zoo.tabular().state_dict(), tmp_path / "tabular.pt")
    result = run_deploykit("convert", tmp_path / "tabular.pt", "--factory", "model_zoo:tabular", "--input",
                           "features:2x13", "--inputs", npz(tmp_path, features=ROUNDED), "-o", tmp_path / "out",
                           cwd=tmp_path, columns=200)
    assert_one_line_refusal(result, "input features is float64, the model takes float32", "save it as float32")
    assert not (tmp_path / "out").exists()


def test_debug_refuses_inputs_the_cast_would_change_and_takes_exact_ones(tmp_path):
    bundle = converted("tabular")
    refused = run_deploykit("debug", bundle, "--inputs", npz(tmp_path, features=ROUNDED), columns=200)
    assert_one_line_refusal(refused, "input features is float64, the model takes float32", "save it as float32")
    exact = run_deploykit("debug", bundle, "--inputs", npz(tmp_path, features=EXACT), "--json", columns=200)
    assert exact.returncode == 0, exact.stderr
