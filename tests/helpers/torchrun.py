"""Run a worker script under real ``torchrun`` (gloo, CPU ranks) and fail with its output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dynascope.core.net import free_port

TESTS = Path(__file__).resolve().parents[1]


def torchrun(tmp_path: Path, worker: str, run: Path, nproc: int = 2) -> None:
    script = tmp_path / "worker.py"
    script.write_text(worker)
    # the workers import ``helpers`` (tests/) beside dynascope (PYTHONPATH, or the installed package)
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=path)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script), str(run)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
