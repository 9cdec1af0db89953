"""Every command-line script in benchmarks/ runs its main: a script whose ``--help`` prints no usage
would do nothing on the GPU machine and still exit 0 (it happened, costing a device call)."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(path for path in BENCHMARKS.glob("*.py") if "argparse" in path.read_text())


def test_the_benchmark_scripts_are_found():
    assert {"profile_runner_call.py", "serve_load.py", "probe_aoti_configs.py"} <= {path.name for path in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_a_benchmark_script_answers_help_with_its_usage(script):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: " + script.name)
