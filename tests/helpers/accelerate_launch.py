"""``accelerate launch`` with 2 processes, as a user starts it, on a CPU-only machine: ``--multi_gpu`` goes
through torchrun as MULTI_CPU over gloo (``--cpu --num_processes 2`` would start one process: accelerate
runs several CPU processes only through mpirun)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def accelerate_launch(script: Path, *args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run ``script args`` under ``accelerate launch`` with 2 processes; the completed process, output kept."""
    launcher = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which("accelerate")
    assert launcher, "accelerate's launcher is installed with the hf extra"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    return subprocess.run([launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                           "--mixed_precision", "no", "--dynamo_backend", "no", str(script), *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
