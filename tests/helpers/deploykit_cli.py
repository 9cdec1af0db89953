"""The deploykit CLI in a subprocess, as users run it.

The subprocess finds this folder on PYTHONPATH, so ``--factory model_zoo:NAME`` names a factory
of this folder's model_zoo.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HELPERS = Path(__file__).resolve().parent
BENCHMARKS = HELPERS.parents[1] / "benchmarks"


def run_deploykit(*args, cwd: Path | None = None, columns: int | None = None, timeout: float = 900,
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m deploykit ARGS`` in ``cwd``; ``columns`` is the width its tables are printed at,
    ``env`` variables set on top of this process's."""
    env = cli_env(env)
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "deploykit", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_benchmark(name: str, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python benchmarks/NAME ARGS``, as the device scripts run it."""
    return subprocess.run([sys.executable, BENCHMARKS / name, *map(str, args)], env=cli_env(), capture_output=True,
                          text=True, timeout=timeout)


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment, ``extra`` on top, and this folder first on PYTHONPATH (then ``extra``'s)."""
    extra = extra or {}
    path = os.pathsep.join(filter(None, [str(HELPERS), extra.get("PYTHONPATH"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, **extra, "PYTHONPATH": path}


def convert(cwd: Path, *args) -> subprocess.CompletedProcess:
    """``deploykit convert ARGS`` in ``cwd``, its tables 120 columns wide."""
    return run_deploykit("convert", *args, cwd=cwd, columns=120)


def assert_rejected(result: subprocess.CompletedProcess, *words: str) -> None:
    """Exit 2, every word of the message in stderr, and no traceback."""
    report = f"exit {result.returncode}\nstderr:\n{result.stderr}\nstdout:\n{result.stdout}"
    assert result.returncode == 2, report
    for word in words:
        assert word in result.stderr, f"{word!r} missing from stderr\n{report}"
    assert "Traceback" not in result.stderr, report
