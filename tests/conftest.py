"""The test suite's shared set-up: the helper modules of tests/helpers import by name
(``import model_zoo``) in every test module, as they do in the CLI subprocesses that the tests
start with tests/helpers on PYTHONPATH (``--factory model_zoo:NAME``, see helpers/deploykit_cli.py).

Test modules never import each other: what two of them share lives in tests/helpers. Their
folders mirror deploykit's packages and hold no __init__.py, so their basenames must be unique.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
