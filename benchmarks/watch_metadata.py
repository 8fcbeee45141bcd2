"""File-system metadata operations of a default ``dynascope.watch()`` run, in real time.

A training loop (a 6-layer MLP with Adam, one process, a step every ``--step-s`` of wall time: the rows per
flush follow the step rate, the files per flush do not) is watched with the
default settings (``flush_secs`` 10 s: rows reach readers, alert rules and /metrics a flush after they
are recorded; ``seal_secs`` 300 s: flushes append to a journal per table, sealed into segments every 5 min)
and, where ``--flush-secs`` or ``--seal-secs`` ask, other intervals (``--seal-secs none``: a segment per
table per flush, the writer's behaviour without a journal). A round should span several seals and a
fold of the writer's own segments (every 4 seals): 20 min at the defaults. Its run directory sits on the FUSE
pass-through of the fault tests (``tests/helpers/faultfs.py``), which logs every call it serves. The
steady state is counted from the writer's first flush to the end of ``--minutes`` (creation of the run
and the fold at close are left out: they happen once a run), and scaled to a writer-hour. Nothing is
compressed: the flushes, folds, deletion windows and heartbeats run at their own periods.

    python3 benchmarks/watch_metadata.py --minutes 20 --rounds 3

Goal: at most one metadata operation (create, rename, unlink, mkdir, rmdir) per 5 s per writer, i.e.
720 per writer-hour.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))
WRITES = ("create", "rename", "unlink", "mkdir", "rmdir")
META = (*WRITES, "utimens", "readdir")
GOAL_PER_HOUR = 3600 / 5


def _train(run: str, flush_secs: float, seal_secs: float | None, seconds: float, step_s: float, started, out) -> None:
    """The watched loop, in a process of its own: signals ``started`` once its first flush is on disk."""
    import torch

    import dynascope

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(256, 256), torch.nn.GELU())])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    scope = dynascope.watch(model, opt, run=run, flush_secs=flush_secs, seal_secs=seal_secs)
    steps, end, signalled = 0, None, False
    while end is None or time.monotonic() < end:
        t = time.monotonic()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps += 1
        if not signalled and scope.writer.rows_written > 0:
            started.set()  # the steady state starts here; the parent takes its first count now
            signalled, end = True, time.monotonic() + seconds
        time.sleep(max(step_s - (time.monotonic() - t), 0.0))
    out.put(steps)
    out.close()
    out.join_thread()
    started.clear()  # the parent takes its last count before close
    time.sleep(1.0)
    scope.close()


def _counts(ops: Path) -> collections.Counter:
    return collections.Counter(ops.read_text().split()) if ops.exists() else collections.Counter()


def one_round(flush_secs: float, seal_secs: float | None, minutes: float, step_s: float) -> dict:
    from faultfs import Mount

    root = Path(tempfile.mkdtemp(prefix="watch-meta-"))
    m = Mount(root)
    try:
        ctx = mp.get_context("spawn")
        started, out = ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=_train, args=(str(m.path / "run"), flush_secs, seal_secs, minutes * 60, step_s,
                                                     started, out))
        proc.start()
        if not started.wait(120):
            raise SystemExit("the watched loop wrote nothing within 120 s")
        before, t0 = _counts(m.ops), time.monotonic()
        steps = out.get(timeout=minutes * 60 + 300)
        while started.is_set() and proc.is_alive():
            time.sleep(0.05)
        ops, wall = _counts(m.ops) - before, time.monotonic() - t0
        proc.join(timeout=300)
        return {"per_hour": {k: ops[k] * 3600 / wall for k in META}, "wall_s": wall, "steps": steps}
    finally:
        m.close()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="steady state counted per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--flush-secs", type=float, nargs="+", default=[10.0])
    ap.add_argument("--seal-secs", default="300", help="the journal's seal interval; 'none': a segment per flush")
    ap.add_argument("--step-s", type=float, default=0.1, help="wall time of a training step")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res: dict[str, list[dict]] = {str(f): [] for f in args.flush_secs}
    for _ in range(args.rounds):  # the intervals alternate, so a slow stretch of the machine hits each
        for f in args.flush_secs:
            r = one_round(f, None if args.seal_secs == "none" else float(args.seal_secs), args.minutes, args.step_s)
            res[str(f)].append(r)
            print(f"flush_secs={f:g}: " + json.dumps({k: round(v) for k, v in r["per_hour"].items()}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    print(f"\none default watch() writer (seal_secs {args.seal_secs}), a step every {args.step_s:g} s, {args.minutes:g} min of steady state per "
          f"round, {args.rounds} rounds; "
          "per writer-hour, median (min–max)\n")
    print("| flush_secs | " + " | ".join(META) + " | create+rename+unlink+mkdir+rmdir | goal |")
    print("|---" * (len(META) + 3) + "|")
    for f, rounds in res.items():
        cells = [statistics.median(r["per_hour"][k] for r in rounds) for k in META]
        writes = [sum(r["per_hour"][k] for k in WRITES) for r in rounds]
        print(f"| {float(f):g} | " + " | ".join(f"{c:,.0f}" for c in cells) +
              f" | {statistics.median(writes):,.0f} ({min(writes):,.0f}–{max(writes):,.0f}) | ≤ {GOAL_PER_HOUR:,.0f} |")


if __name__ == "__main__":
    main()
