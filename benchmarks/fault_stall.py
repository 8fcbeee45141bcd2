"""Training under a file system that stops answering: step time with the store's writes stalled, against
the same loop with them answering, in one process, alternating, on a real FUSE mount
(``tests/helpers/faultfs.py``; needs /dev/fuse, fusermount and fusepy).

Each round runs the probed loop for ``--phase-s`` seconds with the mount healthy, then as long with every
write blocked (the writer thread is mid-flush in a ``write`` that does not return), and reports the ratio
of median step times. A probe that waited on its disk would show a ratio of tens or hundreds (steps
blocked for the whole phase); the floor is 1.0. Then ``close(timeout_s=1)`` is timed with the mount
stalled, and the rows are checked to land whole once it answers again.

    python3 benchmarks/fault_stall.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

import dynascope
from dynascope.store import open_store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
from faultfs import Mount  # noqa: E402 - the fault tests' FUSE mount (needs fusepy)


def _wait(cond, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--phase-s", type=float, default=2.0)
    args = ap.parse_args()
    m = Mount(Path(tempfile.mkdtemp(prefix="dynascope-stall-")))
    backing, mnt, mode = m.backing, m.path, m.set
    try:

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scope = dynascope.watch(model, opt, run=mnt / "run", system_interval_s=None, memory_budget=None)
        scope.writer.flush_secs = 0.2
        x = torch.randn(64, 256)

        def phase() -> list[float]:
            out, t0 = [], time.monotonic()
            while time.monotonic() - t0 < args.phase_s:
                t = time.perf_counter()
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                out.append(time.perf_counter() - t)
            return out

        phase()  # warm-up
        ratios, steps = [], 0
        print(f"{'round':>5} {'healthy ms':>11} {'stalled ms':>11} {'slowest stalled ms':>19} {'ratio':>7}")
        for r in range(args.rounds):
            mode("ok")
            healthy = phase()
            mode("stall")
            stalled = phase()
            steps += len(healthy) + len(stalled)
            ratio = statistics.median(stalled) / statistics.median(healthy)
            ratios.append(ratio)
            print(f"{r:>5} {statistics.median(healthy) * 1e3:>11.3f} {statistics.median(stalled) * 1e3:>11.3f} "
                  f"{max(stalled) * 1e3:>19.1f} {ratio:>7.3f}")
        t0 = time.monotonic()
        scope.close(timeout_s=1.0)
        closed = time.monotonic() - t0
        mode("ok")
        print(f"\nstalled/healthy median step time: median {statistics.median(ratios):.3f}x, "
              f"range {min(ratios):.3f}-{max(ratios):.3f}x over {args.rounds} rounds; "
              f"close(timeout_s=1) with the mount stalled returned in {closed:.2f} s")

        def landed() -> bool:
            with open_store(backing / "run") as con:
                return con.rows("SELECT count(DISTINCT step) FROM tensor_stats")[0][0] >= steps

        _wait(landed, "the rows to land after the stall", timeout_s=120)
        print("every step's rows landed once the mount answered again")
    finally:
        m.close()


if __name__ == "__main__":
    main()
