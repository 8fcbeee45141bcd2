"""benchmarks/smollm2_long.py's SmolLM2 lock: run as the docs say, under ``flock <lock> python ...``, the
script holds the lock its parent took instead of waiting for it for ever; run alone, it waits for
another holder and proceeds once that one lets go."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def holder(lock: Path) -> list[str]:
    code = (f"import sys; sys.path.insert(0, {str(BENCH)!r}); import smollm2_long as m\n"
            f"with m.smollm2_lock({str(lock)!r}): print('held', flush=True)")
    return [sys.executable, "-c", code]


@pytest.mark.skipif(shutil.which("flock") is None, reason="needs util-linux flock")
def test_under_flock_the_script_holds_its_parents_lock(tmp_path: Path) -> None:
    lock = tmp_path / "smollm2.lock"
    res = subprocess.run(["flock", str(lock), *holder(lock)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.split() == ["held"], res.stderr


def test_alone_the_script_waits_for_another_holder(tmp_path: Path) -> None:
    lock = tmp_path / "smollm2.lock"
    with open(lock, "w") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        proc = subprocess.Popen(holder(lock), stdout=subprocess.PIPE, text=True)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=3)  # still waiting while the other holder has it
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.split() == ["held"]
