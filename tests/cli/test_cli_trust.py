"""Every command that can load a bundle's native code refuses a foreign library (exit 2, one line
naming --trust-bundle) and never loads it; --trust-bundle loads it; inspect calls it foreign.

The commands run where deploykit cannot build its op library (an empty cache, no headers, a
compiler that fails), so a foreign library cannot be swapped for this machine's build.
"""

from __future__ import annotations

import pytest

from deploykit.errors import EXIT_BAD_INPUT
from deploykit_cli import run_deploykit
from foreign_library import LIBRARY, foreign_bundle

COMMANDS = {
    "run": ["run", "{bundle}", "--device", "cpu"],
    "validate": ["validate", "{bundle}", "model.pt", "--device", "cpu"],
    "bench": ["bench", "{bundle}", "--only", "ort-deploykit", "--device", "cpu", "--iterations", "1", "-o", "{out}"],
    "tune": ["tune", "{bundle}", "--device", "cpu", "--iterations", "1", "--warmup", "0"],
    "profile": ["profile", "{bundle}", "--only", "onnxruntime", "--device", "cpu", "--iterations", "1", "-o", "{out}"],
    "doctor": ["doctor", "{bundle}"],
    "debug": ["debug", "{bundle}", "--layerwise"],
}


@pytest.fixture
def foreign(monkeypatch, tmp_path):
    """(foreign bundle, marker), and the commands' environment set up so they cannot build here."""
    made = foreign_bundle(tmp_path)  # converting the shared bundle needs the real cache: first
    monkeypatch.setenv("DEPLOYKIT_CACHE", str(tmp_path / "cache"))
    for variable in ("ORT_ROOT", "TENSORRT_ROOT"):
        monkeypatch.setenv(variable, str(tmp_path / "nowhere"))
    for variable in ("CC", "CXX"):
        monkeypatch.setenv(variable, "/bin/false")
    return made


def _command(name: str, bundle, tmp_path, *extra) -> list[str]:
    return [part.format(bundle=bundle, out=tmp_path / "out") for part in COMMANDS[name]] + list(extra)


@pytest.mark.parametrize("name", COMMANDS)
def test_foreign_library_refused(name, tmp_path, foreign):
    bundle, marker = foreign
    result = run_deploykit(*_command(name, bundle, tmp_path), columns=400)
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert f"{LIBRARY} is native code this machine's deploykit did not build" in result.stderr
    assert "--trust-bundle" in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists()


@pytest.mark.parametrize("name", ["run", "doctor"])
def test_trust_bundle_loads_it(name, tmp_path, foreign):
    bundle, marker = foreign
    run_deploykit(*_command(name, bundle, tmp_path, "--trust-bundle"))
    assert marker.read_text() == "loaded"


def test_inspect_calls_it_foreign(tmp_path):
    bundle, marker = foreign_bundle(tmp_path)
    result = run_deploykit("inspect", bundle, columns=400)
    assert result.returncode == 0, result.stderr
    assert f"native {LIBRARY} (onnxruntime-op-library): foreign; needs --trust-bundle" in result.stderr
    assert not marker.exists()
