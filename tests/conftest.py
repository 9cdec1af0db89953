"""The test suite's shared set-up: the helper modules of tests/helpers import by name
(``import model_zoo``) in every test module, as they do in the CLI subprocesses that the tests
start with tests/helpers on PYTHONPATH (``--factory model_zoo:NAME``, see helpers/deploykit_cli.py).

Test modules never import each other: what two of them share lives in tests/helpers. Their
folders mirror deploykit's packages and hold no __init__.py, so their basenames must be unique.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

# pytest-xdist starts its workers with COLUMNS=80, and deploykit's rich console fixes its width
# when it is created (at import) from COLUMNS: tests that set COLUMNS themselves would then print
# 80 columns in a worker and their own width in a plain run.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.pop("COLUMNS", None)


def pytest_configure(config):
    """The folder that converted_bundles shares between the workers of a pytest-xdist run: made by
    the controlling process before it starts the workers, which inherit its environment."""
    from converted_bundles import SHARED_WORK

    if "PYTEST_XDIST_WORKER" not in os.environ and config.getoption("numprocesses", None):
        config.deploykit_shared_work = tempfile.mkdtemp(prefix="deploykit-tests-")
        os.environ[SHARED_WORK] = config.deploykit_shared_work


def pytest_unconfigure(config):
    if shared := getattr(config, "deploykit_shared_work", None):
        shutil.rmtree(shared, ignore_errors=True)
