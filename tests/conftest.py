"""The test suite's shared set-up: the helper modules of tests/helpers import by name.

Step one of the layout change: the test modules moved into folders that mirror deploykit's
packages; until the shared code they import from each other moves into tests/helpers, the
folders holding it are put on sys.path too.
"""

import sys
from pathlib import Path

TESTS = Path(__file__).parent
for folder in ("helpers", "conversion", "validation", "runtime", "native"):
    sys.path.insert(0, str(TESTS / folder))
