"""What the canonical view costs: ``tensor_stats_global`` against the hand-written queries it replaces.

On the run ``store_query.py`` builds (4 rank writers, whole tensors on every rank: the DDP layout), each
query is timed three ways, in one process, alternating, ``--rounds`` times:

- ``global``: through ``tensor_stats_global`` (the pooling rule, a replayed step's latest process);
- ``rank0``: over rank 0's rows only, what a hand query that knows the layout is DDP reads (the floor:
  it touches a quarter of the rows and pools nothing);
- ``all``: over every rank's rows, summed (the wrong answer a hand query gets, at the cost of one scan).

and the three answers are checked: ``global`` must equal ``rank0`` (DDP copies count once).

    python3 benchmarks/global_view.py --quick     # 2M rows
    python3 benchmarks/global_view.py             # 10M rows
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
from store_query import build  # benchmarks/ is on sys.path when run as a script

from dynascope.store import open_store

QUERIES = {
    "per-step update ratio": "SELECT step, sqrt(sum(update_norm * update_norm)) / sqrt(sum(w_norm * w_norm)) AS r, "
                             "sum(changed_count) AS c, sum(numel) AS n FROM {src} GROUP BY step",
    "one tensor's history": "SELECT step, update_norm, grad_norm FROM {src} WHERE tensor = 'layers.7.attn_q.weight'",
    "count per step": "SELECT step, count(*) AS n FROM {src} GROUP BY step",
}
SOURCES = {"global": "tensor_stats_global", "rank0": "(SELECT * FROM tensor_stats WHERE rank = 0)",
           "all": "tensor_stats"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dynascope-bench-global"))
    args = ap.parse_args()
    rows = 2_000_000 if args.quick else 10_000_000
    run = args.dir / f"ddp_{rows}"
    if not (run / ".complete").exists():
        shutil.rmtree(run, ignore_errors=True)
        build(run, rows)
        (run / ".complete").write_text("1")
    store = open_store(run, threads=args.threads)
    print(f"{store.rows('SELECT count(*) FROM tensor_stats')[0][0]:,} rows, 4 ranks, threads={args.threads}, "
          f"{args.rounds} rounds, median (min-max) s\n")
    print(f"{'query':<24} {'global':>18} {'rank0':>18} {'all':>18} {'global/rank0':>13}")
    for name, sql in QUERIES.items():
        times: dict[str, list[float]] = {k: [] for k in SOURCES}
        for _ in range(args.rounds):
            for k, src in SOURCES.items():  # alternating, so load drifts hit all three alike
                t0 = time.perf_counter()
                store.frame(sql.format(src=src))
                times[k].append(time.perf_counter() - t0)
        got = {k: store.frame(sql.format(src=src) + " ORDER BY ALL").to_numpy() for k, src in SOURCES.items()}
        assert np.allclose(got["global"].astype(float), got["rank0"].astype(float), rtol=1e-12), name
        cells = [f"{statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f})" for t in times.values()]
        ratio = statistics.median(times["global"]) / statistics.median(times["rank0"])
        print(f"{name:<24} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18} {ratio:>13.2f}")
    print("\nglobal == rank0 for every query (DDP copies count once)")
    store.close()


if __name__ == "__main__":
    main()
