"""On-demand cluster what-ifs on the 10M-row run of ``dashboard_render.py`` (1.9M timings rows, 880k samples).

Times, in alternating blocks of one call each (``--rounds`` rounds, median and spread): ``what_if`` (DuckDB),
``schedule_inputs`` (the DuckDB part of the schedule what-if), ``schedule_what_if`` (inputs and the replay
of every schedule), and the named peer: ``what_if`` as it was before it moved into DuckDB (the polars
implementation at ``--peer-rev``, loaded from git), whose result must equal today's.

    python benchmarks/whatif_speed.py --dir runs/bench-dashboard --rounds 5
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
REPO = Path(__file__).resolve().parents[1]


def load_peer(rev: str):
    """The ``stragglers`` module as of ``rev``, imported under another name."""
    src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:dynascope/analyses/stragglers.py"], check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "stragglers_peer.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("stragglers_peer", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("runs/bench-dashboard"))
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--peer-rev", default="015349d", help="a commit whose what_if is the polars implementation")
    args = ap.parse_args()
    from dashboard_run import build
    from polars.testing import assert_frame_equal

    import dynascope.analyses as A
    from dynascope.store import open_store

    run = args.dir / f"rows-{args.rows}"
    if not (run / "bench.json").exists():
        print(f"building {run} ...", flush=True)
        counts = build(run, args.rows)
        (run / "bench.json").write_text(json.dumps({**counts, "layout": 3}))
    peer = load_peer(args.peer_rev)
    rid = run.name
    calls = {"what_if (DuckDB)": lambda s: A.what_if(s, run=rid),
             "schedule_inputs": lambda s: A.schedule_inputs(s, run=rid),
             "schedule_what_if": lambda s: A.schedule_what_if(s, run=rid),
             f"peer: what_if at {args.peer_rev} (polars)": lambda s: peer.what_if(s, run=rid)}
    times: dict[str, list[float]] = {k: [] for k in calls}
    print(f"cores {len(os.sched_getaffinity(0))}, load average {os.getloadavg()}", flush=True)
    with open_store(run) as s:
        assert_frame_equal(A.what_if(s, run=rid), peer.what_if(s, run=rid), rel_tol=1e-9)
        for i in range(args.rounds):
            for name, fn in (calls.items() if i % 2 == 0 else reversed(calls.items())):
                t = time.perf_counter()
                fn(s)
                times[name].append(time.perf_counter() - t)
            print(f"round {i}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    peer_med = statistics.median(times[list(calls)[-1]])
    print(f"\n{'call':<34} {'median s':>9} {'min s':>7} {'max s':>7} {'vs peer':>8}")
    for name, v in times.items():
        print(f"{name:<34} {statistics.median(v):>9.2f} {min(v):>7.2f} {max(v):>7.2f} "
              f"{statistics.median(v) / peer_med:>8.2f}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
