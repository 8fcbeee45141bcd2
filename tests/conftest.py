"""Shared set-up for the tests.

Pieces several test files use live in ``tests/helpers/`` (planted runs, naive references, the torchrun
launcher, deadline waits), never in a test module: no test imports another test module or a benchmark
script (``tests/test_import_direction.py`` checks it). This directory is put on ``sys.path`` here, so
``import helpers`` works whichever way pytest imports the test files; subprocesses that need the helpers
get it through ``PYTHONPATH`` (``helpers.torchrun``).
"""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
