"""Bad input through the real CLI: the right exit code, a one-line fix, no traceback, no leftovers.

Every case runs ``python -m deploykit convert`` in a subprocess (cwd = tmp_path) and checks:
exit 2, an ``error:``/usage line that names the problem and its fix, no ``Traceback`` unless
``--verbose``, and that the output directory was not created (or, when it already existed, was
left untouched) with no ``.*.partial``/``.*.old`` staging directory beside it.

Models that must be imported by name (``--factory``, pickled modules, a custom op) live in a
helper module written into a temporary directory that is put on ``PYTHONPATH``.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from deploykit_cli import assert_rejected

BUNDLE_FILES = {"manifest.json", "model.onnx", "report.json", "report.html"}
INPUT = "x:1x3x16x16"


class TinyNet(nn.Module):
    def __init__(self, track_running_stats: bool = True):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=track_running_stats),
            nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
        )

    def forward(self, x):
        return self.body(x)


HELPER_NAME = "dk_helpers"
HELPER_SOURCE = (
    "import pathlib\nimport torch\nfrom torch import nn\n\n\n"
    + inspect.getsource(TinyNet)
    + textwrap.dedent('''

    def build():
        return TinyNet()


    def build_without_stats():
        return TinyNet(track_running_stats=False)


    class MarkedNet(TinyNet):
        """Touches the file named by ``self.marker`` when unpickled: shows whether pickle code ran."""

        def __setstate__(self, state):
            pathlib.Path(state["marker"]).touch()
            super().__setstate__(state)


    def build_marked(marker):
        net = MarkedNet()
        net.marker = str(marker)
        return net


    @torch.library.custom_op("dktest::mystery", mutates_args=())
    def mystery(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


    @mystery.register_fake
    def _(x):
        return torch.empty_like(x)


    class MysteryNet(TinyNet):
        def forward(self, x):
            return mystery(super().forward(x))


    def build_mystery():
        return MysteryNet()
    ''')
)


# --------------------------------------------------------------------------- helpers


def convert(cwd: Path, *args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``deploykit convert ARGS`` as a user would, in ``cwd``."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "deploykit", "convert", *map(str, args)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` with its contents."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def assert_nothing_left(out: Path, before: dict[str, bytes] | None = None) -> None:
    """``out`` was not created (or equals ``before``), and no staging directory remains beside it."""
    if before is None:
        assert not out.exists(), f"{out} was created: {sorted(p.name for p in out.iterdir())}"
    else:
        assert snapshot(out) == before, f"{out} was modified"
    leftovers = [*out.parent.glob(f".{out.name}.*.partial"), *out.parent.glob(f".{out.name}.*.old")]
    assert not leftovers, f"staging directories left behind: {leftovers}"


def save_with_helper(helpers: Path, expression: str, path: Path) -> Path:
    """``torch.save(expression, path)`` in a process that imports the helper module as ``h``."""
    code = f"import sys, torch, {HELPER_NAME} as h; torch.save({expression}, sys.argv[1])"
    env = {**os.environ, "PYTHONPATH": str(helpers)}
    subprocess.run([sys.executable, "-c", code, str(path)], env=env, check=True, timeout=300)
    return path


def trace_and_save(net: nn.Module, path: Path) -> Path:
    net.eval()
    torch.jit.save(torch.jit.trace(net, torch.randn(1, 3, 16, 16)), str(path))
    return path


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def scripted(tmp_path_factory) -> Path:
    """A valid TorchScript model whose input is named ``x``."""
    torch.manual_seed(0)
    return trace_and_save(TinyNet(), tmp_path_factory.mktemp("models") / "tiny.pt")


@pytest.fixture(scope="module")
def helpers(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("helpers")
    (directory / f"{HELPER_NAME}.py").write_text(HELPER_SOURCE)
    return directory


@pytest.fixture
def out(tmp_path) -> Path:
    return tmp_path / "bundle"


# --------------------------------------------------------------------------- cases


def test_missing_model_file(tmp_path, out):
    result = convert(tmp_path, "nope.pt", "-o", out, "--input", INPUT)
    assert_rejected(result, "error:", "nope.pt", "does not exist", "check the path")
    assert_nothing_left(out)


def test_verbose_shows_the_traceback(tmp_path, out):
    result = convert(tmp_path, "nope.pt", "-o", out, "--input", INPUT, "--verbose")
    assert result.returncode == 2, result.stderr
    assert "Traceback" in result.stderr and "does not exist" in result.stderr, result.stderr
    assert_nothing_left(out)


@pytest.mark.parametrize("damage", ["empty", "truncated", "random"])
def test_damaged_model_file(tmp_path, out, scripted, damage):
    data = scripted.read_bytes()
    contents = {
        "empty": b"",
        "truncated": data[: len(data) // 2],
        "random": np.random.default_rng(0).bytes(4096),
    }[damage]
    model = tmp_path / f"{damage}.pt"
    model.write_bytes(contents)
    result = convert(tmp_path, model, "-o", out, "--input", INPUT)
    words = ["empty"] if damage == "empty" else ["not", "PyTorch"]
    assert_rejected(result, "error:", model.name, *words, "torch.jit.save")
    assert_nothing_left(out)


def test_pickled_module_is_not_unpickled_without_trust(tmp_path, out, helpers):
    marker = tmp_path / "unpickled.marker"
    model = save_with_helper(helpers, f"h.build_marked({str(marker)!r})", tmp_path / "whole.pt")
    # The helper module is importable here, so a plain torch.load would run MarkedNet.__setstate__.
    result = convert(tmp_path, model, "-o", out, "--input", INPUT, pythonpath=helpers)
    assert_rejected(result, "error:", "pickled", "--trust-pickle")
    assert not marker.exists(), "code from the pickle ran without --trust-pickle"
    assert_nothing_left(out)


def test_pickled_module_converts_with_trust(tmp_path, out, helpers):
    marker = tmp_path / "unpickled.marker"
    model = save_with_helper(helpers, f"h.build_marked({str(marker)!r})", tmp_path / "whole.pt")
    result = convert(tmp_path, model, "-o", out, "--input", INPUT, "--trust-pickle", pythonpath=helpers)
    assert result.returncode == 0, result.stderr
    assert marker.exists(), "the marker probe is broken: unpickling did not touch it"
    assert {p.name for p in out.iterdir()} == BUNDLE_FILES


def test_state_dict_without_factory(tmp_path, out):
    model = tmp_path / "weights.pt"
    torch.save(TinyNet().state_dict(), model)
    result = convert(tmp_path, model, "-o", out, "--input", INPUT)
    assert_rejected(result, "error:", "state_dict", "--factory")
    assert_nothing_left(out)


def test_state_dict_that_does_not_fit_the_factory(tmp_path, out, helpers):
    weights = tmp_path / "weights.pt"
    state = TinyNet().state_dict()
    state["body.6.weight"] = state.pop("body.5.weight")  # a renamed layer
    torch.save(state, weights)
    result = convert(tmp_path, weights, "-o", out, "--input", INPUT,
                     "--factory", f"{HELPER_NAME}:build", pythonpath=helpers)
    assert_rejected(result, "error:", "1 missing key: body.5.weight", "1 unexpected key: body.6.weight",
                    f"check that {HELPER_NAME}:build builds the architecture")
    assert_nothing_left(out)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        pytest.param(["--input", "x:1x3x16"], ["error:", "x:1x3x16", "--input"], id="wrong-rank"),
        pytest.param(["--input", "y:1x3x16x16"], ["error:", "no input named y", "takes x"], id="wrong-name"),
        pytest.param(["--input", "x:1xAx3"], ["--input", "x:1xAx3", "write e.g."], id="malformed-spec"),
        pytest.param(["--input", INPUT, "--batch", "4:2:1"], ["--batch", "4:2:1", "MIN <= OPT <= MAX"], id="bad-batch"),
    ],
)
def test_input_spec_does_not_fit(tmp_path, out, scripted, args, words):
    result = convert(tmp_path, scripted, "-o", out, *args)
    assert_rejected(result, *words)
    assert_nothing_left(out)


def test_export_failure_names_the_operator(tmp_path, out, helpers):
    weights = save_with_helper(helpers, "h.build_mystery().state_dict()", tmp_path / "mystery.pt")
    result = convert(tmp_path, weights, "-o", out, "--input", INPUT,
                     "--factory", f"{HELPER_NAME}:build_mystery", pythonpath=helpers)
    assert_rejected(result, "error:", "export")
    assert "dktest.mystery" in result.stderr or "dktest::mystery" in result.stderr, result.stderr
    assert_nothing_left(out)


def test_nan_weight(tmp_path, out):
    net = TinyNet()
    with torch.no_grad():
        net.body[0].weight[0, 0, 0, 0] = float("nan")
    model = trace_and_save(net, tmp_path / "nan.pt")
    result = convert(tmp_path, model, "-o", out, "--input", INPUT)
    assert_rejected(result, "error:", "body.0.weight", "NaN/Inf")
    assert_nothing_left(out)


def test_batch_norm_without_running_statistics(tmp_path, out, helpers):
    weights = save_with_helper(helpers, "h.build_without_stats().state_dict()", tmp_path / "nostats.pt")
    result = convert(tmp_path, weights, "-o", out, "--input", INPUT,
                     "--factory", f"{HELPER_NAME}:build_without_stats", pythonpath=helpers)
    assert_rejected(result, "error:", "BatchNorm body.1", "running statistics", "track_running_stats")
    assert_nothing_left(out)


def test_existing_output_dir_needs_force(tmp_path, out, scripted):
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    before = snapshot(out)
    result = convert(tmp_path, scripted, "-o", out, "--input", INPUT)
    assert_rejected(result, "error:", "already exists", "--force")
    assert_nothing_left(out, before)

    result = convert(tmp_path, scripted, "-o", out, "--input", INPUT, "--force")  # not a bundle: kept
    assert_rejected(result, "error:", "neither a deploykit bundle nor empty", "choose another -o")
    assert_nothing_left(out, before)

    (out / "keep.txt").unlink()
    result = convert(tmp_path, scripted, "-o", out, "--input", INPUT, "--force")
    assert result.returncode == 0, result.stderr
    assert {p.name for p in out.iterdir()} == BUNDLE_FILES
    assert_nothing_left(out, snapshot(out))  # no staging or retired directory remains


def test_feeds_lack_the_input(tmp_path, out, scripted):
    feeds = tmp_path / "feeds.npz"
    np.savez(feeds, y=np.zeros((1, 3, 16, 16), np.float32))
    result = convert(tmp_path, scripted, "-o", out, "--input", INPUT, "--inputs", feeds)
    assert_rejected(result, "error:", "--inputs", "lacks x", "name the arrays")
    assert_nothing_left(out)


def test_each_verdict_exits_with_its_code():
    """0 passed, 1 failed, 5 passed but proved nothing: what convert, validate, inspect and debug exit with."""
    from deploykit import errors
    from deploykit.cli._common import exit_with_verdict

    for passed, inconclusive, code in ((True, False, 0), (False, False, 1), (False, True, 1), (True, True, 5)):
        with pytest.raises(SystemExit) as exited:
            exit_with_verdict(errors.verdict(passed, inconclusive))
        assert exited.value.code == code
