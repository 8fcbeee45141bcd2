"""On-demand cluster what-ifs on the 10M-row run of ``dashboard_render.py`` (1.9M timings rows, 880k samples).

Times, in alternating blocks of one call each (``--rounds`` rounds, median and spread): ``what_if``,
``schedule_inputs`` (the pieces of the schedule what-if), ``schedule_what_if`` (inputs and the replay of
every schedule), ``what_if_shared`` on two shared devices (``--shared``), and the named peer: ``what_if``
as it was before it moved into DuckDB (the polars implementation at ``--peer-rev``, loaded from git),
whose result must equal today's. Beside each call's wall time it prints the process's CPU time (DuckDB's
threads included), which other processes on the cores disturb less: on a loaded machine, compare those.

Two builds compare by running this script with ``PYTHONPATH`` at each in turn: ``--save DIR`` writes each
call's answer to DIR, and ``--against DIR`` holds this build's answers to those (rel and abs 1e-9).

    python benchmarks/whatif_speed.py --dir runs/bench-dashboard --rounds 5
    PYTHONPATH=/path/to/other/tree python benchmarks/whatif_speed.py --rounds 5 --save /tmp/other
    PYTHONPATH=. python benchmarks/whatif_speed.py --rounds 5 --against /tmp/other
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
    ap.add_argument("--shared", action="store_true", help="also time what_if_shared (devices=2, rank 5 replaced)")
    ap.add_argument("--save", type=Path, help="write each call's answer here (Parquet)")
    ap.add_argument("--against", type=Path, help="hold each call's answer to the one saved here")
    args = ap.parse_args()
    from dashboard_run import build
    from polars.testing import assert_frame_equal

    import dynascope
    import dynascope.analyses as A
    from dynascope.store import open_store

    run = args.dir / f"rows-{args.rows}"
    if not (run / "bench.json").exists():
        print(f"building {run} ...", flush=True)
        counts = build(run, args.rows)
        (run / "bench.json").write_text(json.dumps({**counts, "layout": 3}))
    peer = load_peer(args.peer_rev)
    rid = run.name
    calls = {"what_if": lambda s: A.what_if(s, run=rid),
             "schedule_inputs": lambda s: A.schedule_inputs(s, run=rid),
             "schedule_what_if": lambda s: A.schedule_what_if(s, run=rid)}
    if args.shared:
        calls["what_if_shared"] = lambda s: A.what_if_shared(s, run=rid, ranks=[5], devices=2)
    calls[f"peer: what_if at {args.peer_rev} (polars)"] = lambda s: peer.what_if(s, run=rid)
    times: dict[str, list[float]] = {k: [] for k in calls}
    cpu: dict[str, list[float]] = {k: [] for k in calls}  # the process's CPU time, DuckDB's threads included
    print(f"dynascope from {Path(dynascope.__file__).parent}", flush=True)
    print(f"cores {len(os.sched_getaffinity(0))}, load average {os.getloadavg()}", flush=True)
    with open_store(run) as s:
        answers = {name: fn(s) for name, fn in list(calls.items())[:-1]}  # a first call of each, untimed
        assert_frame_equal(answers["what_if"], peer.what_if(s, run=rid), rel_tol=1e-9)
        for name, df in answers.items():
            if args.save:
                args.save.mkdir(parents=True, exist_ok=True)
                df.write_parquet(args.save / f"{name}.parquet")
            if args.against:
                import polars as pl

                assert_frame_equal(df, pl.read_parquet(args.against / f"{name}.parquet"), rel_tol=1e-9, abs_tol=1e-9)
                print(f"{name}: equal to {args.against} ({df.height} rows)", flush=True)
        for i in range(args.rounds):
            for name, fn in (calls.items() if i % 2 == 0 else reversed(calls.items())):
                t, c = time.perf_counter(), time.process_time()
                fn(s)
                times[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
            print(f"round {i}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    peer_med = statistics.median(times[list(calls)[-1]])
    print(f"\n{'call':<34} {'median s':>9} {'min s':>7} {'max s':>7} {'vs peer':>8} {'CPU s':>6} {'min':>6} {'max':>6}")
    for name, v in times.items():
        c = cpu[name]
        print(f"{name:<34} {statistics.median(v):>9.2f} {min(v):>7.2f} {max(v):>7.2f} "
              f"{statistics.median(v) / peer_med:>8.2f} {statistics.median(c):>6.2f} {min(c):>6.2f} {max(c):>6.2f}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
