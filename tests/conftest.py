"""Shared set-up for the tests.

Pieces several test files use live in ``tests/helpers/`` (planted runs, naive references, the torchrun
launcher, deadline waits), never in a test module: no test imports another test module or a benchmark
script (``tests/test_import_direction.py`` checks it). This directory is put on ``sys.path`` here, so
``import helpers`` works whichever way pytest imports the test files; subprocesses that need the helpers
get it through ``PYTHONPATH`` (``helpers.torchrun``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

CLI = [sys.executable, "-c", "from dynascope.cli import app; app()"]  # the console script, without PATH


@pytest.fixture(scope="session")
def quick_demo(tmp_path_factory) -> tuple[Path, str]:
    """(run directory, stdout) of one ``dynascope demo --quick``, shared by every test that reads it: a real
    SFT → GRPO training run, probed. Read it, never write into it (copy it first)."""
    run = tmp_path_factory.mktemp("quick_demo") / "demo"
    env = {**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1"}  # wide: the demo's table rows stay one line
    done = subprocess.run([*CLI, "demo", "--quick", "--run", str(run)], capture_output=True, text=True,
                          timeout=900, env=env)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return run, done.stdout
