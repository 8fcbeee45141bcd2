"""What a live run's merged segments cost a query per row group: the same files, before and after gathering.

A live writer's folds merge its seals, a few hundred rows each. A merge that wrote one row group per source
left ~2.2 row groups a file on a 1,280-writer run, and a query pays per row group (its footer entry, a read
and a decoder per column). ``merge.merge_segments`` now gathers a merge's rows into row groups of
``ROW_GROUP_ROWS``. This benchmark takes a stopped copy of a live run (``live_scale.py --keep``), copies it
again, and rewrites each of the copy's segments that holds more row groups than its rows need through
``merge_segments`` itself (a merge of that one segment, renamed back onto its own name): the same files,
names and rows, only the row groups gathered. Then each call runs in a fresh process (import, open and the
call; ``cluster_scale.py``'s calls), ``--rounds`` rounds alternating the two copies, medians (min-max) and
the per-round ratio. Rows are checked equal per table in both copies.

    python benchmarks/live_scale.py --writers 1280 --trainers 1024 --steps 300 --procs 4 --seal-s 30 \
        --reads 3 --cluster --keep /tmp/live-copies
    python benchmarks/row_groups.py --run /tmp/live-copies/step-225 --rounds 5
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).parent))
from cluster_scale import rows_per_table  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from copies_ab import CALLS, ab_calls  # noqa: E402

from dynascope.store._columns import ROW_GROUP_ROWS  # noqa: E402
from dynascope.store.layout import SEGMENT_RE, segment_name  # noqa: E402
from dynascope.store.merge import merge_segments  # noqa: E402
from dynascope.store.schema import TABLES  # noqa: E402


def census(run: Path, table: str = "timings") -> tuple[int, int]:
    """(Parquet files, row groups) of ``table`` in ``run``, every writer directory's files."""
    files = groups = 0
    for f in (run / table).glob("writer=*/*.parquet"):
        files += 1
        groups += pq.ParquetFile(f).metadata.num_row_groups
    return files, groups


def gather(run: Path) -> int:
    """Rewrite each segment of ``run`` whose rows fit in fewer row groups, through ``merge_segments``;
    the number rewritten."""
    n = 0
    for table in TABLES:
        for path in sorted((run / table).glob("writer=*/*.parquet")):
            md = pq.ParquetFile(path).metadata
            m = SEGMENT_RE.match(path.name)
            if m is None or md.num_row_groups <= max(math.ceil(md.num_rows / ROW_GROUP_ROWS), 1):
                continue
            lo, hi = int(m.group(1)), int(m.group(2))
            st = path.stat()
            valid = merge_segments(table, [(lo, hi, path)], settle_us=0)
            # back onto its own name: the live-segment rule sees the same files
            os.replace(path.parent / segment_name(lo, hi, valid), path)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True, help="a stopped copy of a live run (live_scale.py --keep)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", nargs="*", default=CALLS)
    ap.add_argument("--timeout", type=float, default=300.0)
    a = ap.parse_args()
    # the copies' writers never close and their heartbeats are stale: no open may fold or tidy them
    os.environ["DYNASCOPE_FOLD"] = "0"
    with tempfile.TemporaryDirectory(dir=a.run.parent) as tmp:
        arms = {"as written": Path(tmp) / "as-written", "gathered": Path(tmp) / "gathered"}
        for d in arms.values():  # both copies fresh, so neither has the page cache's head start
            shutil.copytree(a.run, d, symlinks=True)
        print(f"rewrote {gather(arms['gathered'])} segments; timings files, row groups:",
              {k: census(d) for k, d in arms.items()})
        counted = {k: rows_per_table(d) for k, d in arms.items()}
        assert counted["as written"] == counted["gathered"], counted
        print("rows per table, the same in both:", counted["gathered"])
        ab_calls(arms, a.calls, a.rounds, a.timeout)


if __name__ == "__main__":
    main()
