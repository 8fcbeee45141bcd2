"""The timing analyses on two stopped copies of live runs, side by side: which layout a query pays less for.

``live_scale.py --keep`` leaves a copy of the run at each read, its writers stopped mid-run. This benchmark
copies two such runs afresh (neither with the page cache's head start), counts their files and rows per
table, then runs each call in a fresh process (import, open and the call; ``cluster_scale.py``'s calls),
``--rounds`` rounds alternating the copies: medians (min-max) and the per-round ratio of the second copy's
call to the first's. The copies need not hold the same rows (two runs stopped at the same step hold about
the same); their rows are printed beside the times.

    python benchmarks/live_scale.py --writers 1280 --trainers 1024 --steps 300 --procs 4 --seal-s 30 \\
        --reads 3 --cluster --keep /tmp/per-rank
    python benchmarks/live_scale.py --writers 1280 --trainers 1024 --per-writer 8 --steps 300 --procs 4 \\
        --seal-s 6 --reads 3 --cluster --keep /tmp/per-node
    python benchmarks/copies_ab.py --runs /tmp/per-rank/step-225 /tmp/per-node/step-225 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cluster_scale import measure, rows_per_table  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

CALLS = ["open + count(timings)", "what_if", "schedule_what_if", "step_breakdown", "straggler_scores"]


def files_of(run: Path, table: str = "timings") -> tuple[int, int]:
    """(Parquet files, journals) of ``table`` in ``run``, every writer directory's."""
    names = [p.name for p in (run / table).glob("writer=*/*")]
    return sum(n.endswith(".parquet") for n in names), sum(n.endswith(".jsonl") for n in names)


def ab_calls(arms: dict[str, Path], calls: list[str], rounds: int, timeout: float) -> None:
    """Each of ``calls`` in a fresh process, ``rounds`` rounds alternating the two ``arms`` (name: run), and
    print per call each arm's median (min-max) call time, wall time and peak RSS, and the ratio per round
    of the second arm's call time to the first's."""
    (first, _), (second, _) = arms.items()
    script = str(Path(__file__).parent / "cluster_scale.py")
    for call in calls:
        got: dict[str, list[dict]] = {k: [] for k in arms}
        for r in range(rounds):
            for k, d in list(arms.items())[::1 if r % 2 == 0 else -1]:  # which goes first alternates too
                got[k].append(measure([sys.executable, script, "--child", call, str(d)], timeout))
        errors = [x["error"] for xs in got.values() for x in xs if "error" in x]
        if errors:
            print(f"{call}: failed: {errors[0]}")
            continue
        line = []
        for k, xs in got.items():
            s, w = [x["call_s"] for x in xs], [x["wall_s"] for x in xs]
            line.append(f"{k} call {statistics.median(s):.2f} s ({min(s):.2f}-{max(s):.2f}), "
                        f"wall {statistics.median(w):.2f} s, {statistics.median(x['rss_mb'] for x in xs):.0f} MB")
        ratio = [b["call_s"] / a["call_s"] for a, b in zip(got[first], got[second], strict=True)]
        print(f"{call}: " + "; ".join(line) + f"; ratio {statistics.median(ratio):.2f} "
              f"({min(ratio):.2f}-{max(ratio):.2f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=Path, nargs=2, required=True, help="two stopped copies (live_scale.py --keep)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", nargs="*", default=CALLS)
    ap.add_argument("--timeout", type=float, default=300.0)
    a = ap.parse_args()
    # the copies' writers never close and their heartbeats are stale: no open may fold or tidy them
    os.environ["DYNASCOPE_FOLD"] = "0"
    with tempfile.TemporaryDirectory(dir=a.runs[0].parent) as tmp:
        arms = {f"{run.parent.name}/{run.name}": Path(tmp) / str(i) for i, run in enumerate(a.runs)}
        if len(arms) < 2:
            raise SystemExit("--runs: two copies of different names (parent/name)")
        for run, d in zip(a.runs, arms.values(), strict=True):
            shutil.copytree(run, d, symlinks=True)
        for k, d in arms.items():
            parquet, journals = files_of(d)
            print(f"{k}: timings {parquet:,} Parquet files and {journals:,} journals; rows {rows_per_table(d)}")
        ab_calls(arms, a.calls, a.rounds, a.timeout)


if __name__ == "__main__":
    main()
