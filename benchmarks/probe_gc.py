"""Full garbage collections inside training steps after ``watch()``, in fresh processes.

Each round runs two fresh child processes on the reference workload (benchmarks/probe_overhead.py's
model and batch): one attaches with ``dynascope.watch()`` as shipped, one with the full collection at the
end of ``watch()`` skipped (``gc.collect`` stubbed out for that one call). ``gc.callbacks`` on the
training thread count the full (generation-2) collections that start inside a step and time them.
A first attach is what matters (the objects attaching creates), so every measurement is a new process.

    python3 benchmarks/probe_gc.py --rounds 5 --steps 60
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def child(args: argparse.Namespace, skip_collect: bool) -> dict:
    import gc

    import probe_ab

    import dynascope
    loop = probe_ab.Loop(args)
    for _ in range(2):
        loop.step()
    full: list[list[float]] = []  # [start, end] of each full pass on the training thread
    in_step = [False]

    def seen(phase: str, info: dict) -> None:
        if info["generation"] == 2 and threading.current_thread() is threading.main_thread() and in_step[0]:
            if phase == "start":
                full.append([time.perf_counter(), 0.0])
            elif full:
                full[-1][1] = time.perf_counter()

    real = gc.collect
    if skip_collect:  # the one call at the end of watch(); later calls are the collector's own
        gc.collect = lambda *a, **k: 0  # type: ignore[assignment]
    run = tempfile.mkdtemp(prefix="ds-gc-")
    scope = dynascope.watch(loop.model, loop.opt, run=run)
    gc.collect = real
    gc.callbacks.append(seen)
    steps = []
    for i in range(args.steps):
        in_step[0] = True
        steps.append(loop.step())
        in_step[0] = False
        if full and full[-1][1] and len(full[-1]) == 2:
            full[-1].append(i)
    gc.callbacks.remove(seen)
    scope.close()
    return {"full_in_step": len(full), "stall_ms": [round((e - s) * 1e3, 1) for s, e, *_ in full],
            "at_step": [f[2] for f in full if len(f) > 2], "median_step_ms": statistics.median(steps) * 1e3,
            "objects": len(gc.get_objects())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    import probe_ab
    probe_ab.model_args(ap)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--child", choices=("shipped", "no-collect"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return print(json.dumps(child(args, skip_collect=args.child == "no-collect")))
    base = [sys.executable, __file__, "--steps", str(args.steps), "--child"]
    print(f"{'round':>5}  {'variant':<26} {'full passes in steps':>20}  stalls ms (at step)")
    for r in range(args.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        for skip in order:
            out = subprocess.run(base + ["no-collect" if skip else "shipped"], capture_output=True, text=True,
                                 check=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            name = "watch() without its collect" if skip else "watch() as shipped"
            stalls = ", ".join(f"{ms} ({s})" for ms, s in zip(res["stall_ms"], res["at_step"], strict=False)) or "-"
            print(f"{r:>5}  {name:<26} {res['full_in_step']:>20}  {stalls}", flush=True)


if __name__ == "__main__":
    main()
