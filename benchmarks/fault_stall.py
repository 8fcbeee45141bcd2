"""Training under each fault the probe must absorb: step time during the fault against the same loop
healthy, in one process, alternating, on a real FUSE mount (``tests/helpers/faultfs.py``; needs /dev/fuse,
fusermount and fusepy).

Faults, one phase each per round, each after a healthy phase of the same length:

- ``stall``: every write of the store blocks (an NFS or Lustre server that stops answering);
- ``enospc`` / ``eio``: every write fails (a full disk, a dying one): the writer retries with back-off;
- ``listener-raise``: a listener raises at every call, under ``warnings.simplefilter("error")``;
- ``listener-hang``: a listener that never returns (a ``wandb.log`` on a dead network), added fresh each
  round: it is dropped after its deadline;
- ``warnings-error``: ``warnings.simplefilter("error")`` with a probe that raises at every step.

Each round alternates ``--pairs`` short healthy and fault blocks per fault (an in-process A/B: load
from the rest of the machine falls on both alike) and reports the ratio of the fault blocks' median step
time to the healthy blocks'. A probe that waited on its disk or a listener would show ratios of tens or
hundreds (steps blocked for the block); the floor is 1.0. Then ``close(timeout_s=1)`` is timed with the mount stalled, and every step's rows are
checked to land once it answers again.

    python3 benchmarks/fault_stall.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import warnings
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.nn as nn

import dynascope
from dynascope.probes.protocol import Probe
from dynascope.store import open_store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
from faultfs import Mount  # noqa: E402 - the fault tests' FUSE mount (needs fusepy)

FAULTS = ("stall", "enospc", "eio", "listener-raise", "listener-hang", "warnings-error")


class _Switch(Probe):
    """A probe that raises at every step while ``on`` (the warnings-as-errors fault)."""

    name = "planted"
    on = False

    def after(self, ctx):
        if self.on:
            raise ValueError("planted probe failure")


def _wait(cond, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--phase-s", type=float, default=0.25, help="length of one block")
    ap.add_argument("--pairs", type=int, default=8, help="healthy/fault block pairs per fault per round")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    args = ap.parse_args()
    faults = args.faults.split(",")
    m = Mount(Path(tempfile.mkdtemp(prefix="dynascope-stall-")))
    release = threading.Event()  # lets the hung listeners' threads end with the benchmark
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        planted = _Switch()
        raising = {"on": False}

        def listener(step, summary):
            if raising["on"]:
                raise RuntimeError("planted listener failure")

        scope = dynascope.watch(model, opt, run=m.path / "run", system_interval_s=None, memory_budget=None,
                                probes=[planted], listeners=[listener])
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

        def faulty(fault: str) -> list[float]:
            with ExitStack() as stack:
                if fault in ("stall", "enospc", "eio"):
                    m.set(fault)
                    stack.callback(m.set, "ok")
                if fault in ("listener-raise", "warnings-error"):
                    stack.enter_context(warnings.catch_warnings())
                    warnings.simplefilter("error")
                if fault == "listener-raise":
                    raising["on"] = True
                    stack.callback(raising.update, on=False)
                if fault == "warnings-error":
                    planted.on = True
                    stack.callback(setattr, planted, "on", False)
                if fault == "listener-hang":
                    scope.add_listener(lambda step, summary: release.wait(3600), deadline_s=0.5)
                return phase()

        phase()  # warm-up
        ratios: dict[str, list[float]] = {f: [] for f in faults}
        steps = 0
        print(f"{'fault':>15} {'round':>5} {'healthy ms':>11} {'fault ms':>9} {'slowest healthy ms':>19} "
              f"{'slowest fault ms':>17} {'ratio':>7}")
        for r in range(args.rounds):
            for fault in faults:
                healthy, during = [], []
                for _ in range(args.pairs):
                    healthy += phase()
                    during += faulty(fault)
                steps += len(healthy) + len(during)
                ratio = statistics.median(during) / statistics.median(healthy)
                ratios[fault].append(ratio)
                print(f"{fault:>15} {r:>5} {statistics.median(healthy) * 1e3:>11.3f} "
                      f"{statistics.median(during) * 1e3:>9.3f} {max(healthy) * 1e3:>19.1f} "
                      f"{max(during) * 1e3:>17.1f} {ratio:>7.3f}")
        m.set("stall")
        t0 = time.monotonic()
        scope.close(timeout_s=1.0)
        closed = time.monotonic() - t0
        m.set("ok")
        print(f"\nfault/healthy median step time over {args.rounds} rounds (median, range):")
        for fault, rs in ratios.items():
            print(f"  {fault:>15}: {statistics.median(rs):.3f}x ({min(rs):.3f}-{max(rs):.3f})")
        print(f"close(timeout_s=1) with the mount stalled returned in {closed:.2f} s")

        def landed() -> bool:
            with open_store(m.backing / "run") as con:
                return con.rows("SELECT count(DISTINCT step) FROM timings WHERE category = 'step'")[0][0] >= steps

        _wait(landed, "the rows to land after the stall", timeout_s=120)
        with open_store(m.backing / "run") as con:
            kinds = dict(con.rows("SELECT event, count(*) FROM events GROUP BY 1"))
        print(f"every step's timing rows landed once the mount answered again; events: {kinds}")
    finally:
        release.set()
        m.close()


if __name__ == "__main__":
    main()
