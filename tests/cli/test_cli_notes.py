"""Every command that runs a bundle says what it ran differently from the conversion, as ``run``
does: a foreign op library swapped for this machine's build is one ``note:`` line in the output
of run, validate, bench, profile, debug and serve (and in bench.json, profile.json, debug's JSON).

One foreign bundle serves every test: no command here writes into it.
"""

from __future__ import annotations

import json
import re

import pytest

from deploykit_cli import run_deploykit
from foreign_library import LIBRARY, foreign_bundle

SWAPPED = re.compile(rf"^note: (?P<about>.*){re.escape(LIBRARY)} in the bundle was not built here: using this "
                     r"machine's build \S+ instead$", re.MULTILINE)
FAST_TIMING = ["--device", "cpu", "--iterations", "1", "--warmup", "0"]
COMMANDS = {
    "run": ["run", "{bundle}", "--device", "cpu"],
    "validate": ["validate", "{bundle}", "{weights}", "--factory", "model_zoo:tabular", "--device", "cpu",
                 "--batch", "1"],
    "bench": ["bench", "{bundle}", "--only", "ort-deploykit", *FAST_TIMING, "--rounds", "1", "--max-seconds", "0.1",
              "--batch", "1", "-o", "{out}"],
    "profile": ["profile", "{bundle}", "--only", "onnxruntime", *FAST_TIMING, "-o", "{out}"],
    "debug": ["debug", "{bundle}", "--layerwise"],
}
#: Whose note it is, where a command runs several backends.
ABOUT = {"bench": "ort-deploykit: ", "profile": "onnxruntime (CPUExecutionProvider): "}
#: The results file a command writes, whose timed entry carries the notes too.
RESULTS = {"bench": "bench.json", "profile": "profile.json"}


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """(a bundle whose op library a stranger made, the marker its loading would write)."""
    return foreign_bundle(tmp_path_factory.mktemp("foreign"))


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_notes_the_swapped_library(name, foreign, tmp_path):
    bundle, marker = foreign
    weights = json.loads((bundle / "manifest.json").read_text())["source"]
    args = [part.format(bundle=bundle, weights=weights, out=tmp_path) for part in COMMANDS[name]]
    result = run_deploykit(*args, columns=400)
    assert result.returncode in (0, 1), result.stderr  # debug: 1 where a node diverges
    assert [m["about"] for m in SWAPPED.finditer(result.stderr)] == [ABOUT.get(name, "")], result.stderr
    assert not marker.exists()
    if name in RESULTS:
        written = json.loads((tmp_path / RESULTS[name]).read_text())
        [timed] = [e for e in written.get("contenders") or written["sections"] if e["status"] == "ok"]
        assert _swapped(timed["notes"]), timed["notes"]


def test_debug_keeps_the_notes_for_its_json(foreign):
    from deploykit.tools import debug

    assert _swapped(debug.open_bundle(foreign[0]).notes)


def _swapped(notes: list[str]) -> bool:
    return any(SWAPPED.match(f"note: {note}") for note in notes)


def test_serve_notes_the_swapped_library(foreign):
    pytest.importorskip("fastapi")
    from serving import running_server

    bundle, marker = foreign
    with running_server(bundle, "--device", "cpu", "--instances", "2", "--warmup-runs", "0") as server:
        output = server.output()
        assert server.stop() == 0
    assert [m["about"] for m in SWAPPED.finditer(output)] == ["tabular: "], output
    assert not marker.exists()
