"""The writer hands the memory of a flush back to the OS instead of keeping it for the whole run."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest

# A fresh process, so the allocator's state is the flush's alone. It reports the resident bytes of
# mimalloc's arenas (the anonymous mappings of >= 1 GiB it reserves) before the writer exists and once
# the writer thread has flushed a 200k-row batch (~50 MiB of Arrow buffers at its peak).
CHILD = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import pyarrow as pa
    from dynascope.store.writer import RunWriter

    def arena_rss():
        total, big = 0, False
        with open("/proc/self/smaps") as fh:
            for line in fh:
                p = line.split()
                if "-" in p[0] and not p[0].endswith(":"):
                    lo, hi = (int(v, 16) for v in p[0].split("-"))
                    big = len(p) == 5 and hi - lo >= 2**30
                elif p[0] == "Rss:" and big:
                    total += int(p[1]) * 1024
        return total

    pa.array([0])
    before = arena_rss()
    w = RunWriter(sys.argv[1], flush_secs=0.05)
    names = [f"layers.{i}.weight" for i in range(100)]
    for step in range(4):
        w.append("tensor_stats", {"step": step, "tensor": names * 500, "w_norm": np.random.rand(50_000),
                                  "grad_norm": np.random.rand(50_000).tolist()})
    deadline = time.monotonic() + 60
    retained = arena_rss() - before
    # The thread writes the segment, then its rollup, then releases: wait for the end of that, or time out.
    while (w.rows_written < 200_000 or retained > 8 * 2**20) and time.monotonic() < deadline:
        time.sleep(0.1)
        retained = arena_rss() - before
    print(json.dumps({"rows": w.rows_written, "retained": retained,
                      "pool_peak": pa.default_memory_pool().max_memory()}))
    w.close()
""")


@pytest.mark.skipif(pa.default_memory_pool().backend_name != "mimalloc" or not Path("/proc/self/smaps").exists(),
                    reason="measures mimalloc's arenas in /proc")
def test_flush_memory_goes_back_to_the_os(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["rows"] >= 200_000
    assert r["pool_peak"] > 30 * 2**20  # the flush did use the pool: a retained heap would show
    # Without the release the writer thread's mimalloc heap kept ~70 MiB resident here, for good.
    assert r["retained"] <= 8 * 2**20, r["retained"] / 2**20
