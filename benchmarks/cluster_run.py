"""Generate one synthetic cluster run with planted faults, through the real RunWriter (one writer per rank).

The run (``dynascope.demo.synthetic``): ``--ranks`` FSDP trainer ranks, 8 to a node, plus rollout workers
on nodes of their own; per-rank phase timings every step, each rank's shard of every tensor's statistics
every ``--tensor-every`` steps, rollout samples, checkpoints; one slow rank, one slow node, one rank slow
every 4th step and one rollout worker with a long tail, written to ``<run>/planted.json``. Prints the time
it took, the planted faults, and the files, bytes and rows per table.

    python benchmarks/cluster_run.py runs/cluster-64 --ranks 64 --steps 500
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path

from dynascope.store.layout import COMMITS, SEGMENT_RE


def census(run: Path) -> dict[str, dict[str, int]]:
    """Per table (``(commits)`` for the commit and begin records, ``(other)`` for heartbeats, markers and the
    truth file): files, bytes, writer dirs."""
    files: Counter = Counter()
    size: Counter = Counter()
    dirs: Counter = Counter()
    for dirpath, _dirs, names in os.walk(run):
        rel = Path(dirpath).relative_to(run).parts
        table = rel[0] if rel and rel[0] in _tables() else "(commits)" if rel and rel[0] == COMMITS else "(other)"
        if len(rel) == 2 and table != "(other)":
            dirs[table] += 1
        for n in names:
            files[table] += 1
            try:
                size[table] += os.lstat(os.path.join(dirpath, n)).st_size
            except FileNotFoundError:
                pass
    return {t: {"files": files[t], "bytes": size[t], "writer_dirs": dirs[t]} for t in sorted(files)}


def _tables() -> tuple[str, ...]:
    from dynascope.store.schema import TABLES

    return tuple(TABLES)


def segment_count(run: Path) -> int:
    return sum(1 for _, _, names in os.walk(run) for n in names if SEGMENT_RE.match(n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="run directory to create (must not exist or be empty)")
    ap.add_argument("--ranks", type=int, default=64, help="trainer ranks")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--workers", type=int, default=None, help="rollout workers (default ranks / 4, at least 2)")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tensor-every", type=int, default=10)
    ap.add_argument("--processes", type=int, default=None, help="writer processes (default: CPU count)")
    ap.add_argument("--fsync", action="store_true", help="fsync every segment, as the writer does by default")
    args = ap.parse_args()
    from dynascope.demo.synthetic import ClusterSpec
    from dynascope.demo.synthetic_write import write_cluster_run

    spec = ClusterSpec(ranks=args.ranks, ranks_per_node=args.ranks_per_node, rollout_workers=args.workers,
                       steps=args.steps, layers=args.layers, tensor_every=args.tensor_every)
    print(f"cores {len(os.sched_getaffinity(0))}, load average {os.getloadavg()}", flush=True)
    t = time.perf_counter()
    truth = write_cluster_run(args.run, spec, processes=args.processes, fsync=args.fsync)
    took = time.perf_counter() - t
    print(f"wrote {args.run} in {took:.1f} s with {truth['processes']} processes "
          f"({spec.ranks} trainers + {spec.workers} rollout workers, {spec.steps} steps); "
          f"load average after {os.getloadavg()}")
    print(json.dumps(truth["planted"], indent=1))
    rows = truth["rows"]
    print(f"\n{'table':<24} {'rows':>12} {'files':>9} {'writer dirs':>12} {'MB':>9}")
    for table, c in census(args.run).items():
        print(f"{table:<24} {rows.get(table, 0):>12,} {c['files']:>9,} {c['writer_dirs']:>12,} {c['bytes'] / 1e6:>9.1f}")


if __name__ == "__main__":
    main()
