"""Files and metadata operations of live writers, with their own fold on and off, on a real FUSE mount that
counts every call the file system answers (``tests/helpers/faultfs.py``; needs /dev/fuse and fusepy).

``--writers`` writers (one ``RunWriter`` each, as one per rank) make ``--flushes`` flushes each, every flush a
step's rows of ``scalars``, ``tensor_stats`` and ``timings``. The two arms (fold on, fold off) alternate
``--rounds`` times in one process. Per arm it reports, per writer and table, the most live segments seen at
any flush and the files on disk at the end; the metadata operations the mount answered per writer per
flush (creates, renames, unlinks, mkdirs, directory listings, stats), scaled to an hour at the default
flush interval (2 s); and the median time to open the live store and count ``timings`` (rows checked
exact). A flush here comes every few milliseconds rather than every 2 s, so the fold's settle and grace
are scaled to match (``--settle-s``, ``--grace-s``: one flush and five, as 2 s and 10 s are at the
default interval).

    python3 benchmarks/writer_files.py --writers 8 --flushes 400 --rounds 5
"""

from __future__ import annotations

import argparse
import collections
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import dynascope.store.own_fold as own_fold
from dynascope.store import RunWriter, open_store
from dynascope.store.live import live_files

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
from faultfs import Mount  # noqa: E402 - the fault tests' FUSE mount, which counts its calls (needs fusepy)

TABLES = ("scalars", "tensor_stats", "timings")
FLUSHES_PER_HOUR = 3600 / 2.0  # RunWriter's default flush_secs
KINDS = ("create", "rename", "unlink", "mkdir", "readdir", "getattr")


def _wait(cond, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.005)


def _ops(path: Path) -> collections.Counter:
    return collections.Counter(path.read_text().split()) if path.exists() else collections.Counter()


def _arm(run: Path, writers: int, flushes: int, fold: bool, ops_file: Path) -> dict:
    before = _ops(ops_file)
    # 38 rows a step: the step's last append reaches flush_rows and wakes the writer thread, one flush a step
    ws = [RunWriter(run, rank=r, world_size=writers, flush_secs=3600, flush_rows=38) for r in range(writers)]
    for w in ws:
        w.fold = fold
    peak, t0 = 0, time.perf_counter()
    for i in range(flushes):
        seqs = [w._seq for w in ws]
        for w in ws:
            w.append("scalars", {"step": i, "key": [f"m{k}" for k in range(20)], "value": np.full(20, float(i))})
            w.append("tensor_stats", {"step": i, "tensor": [f"t{k}" for k in range(16)], "numel": 64,
                                      "w_norm": np.ones(16)})
            w.append("timings", {"step": i, "phase": ["forward", "backward"], "dur_us": [1000, 2000]})
        for w, seq in zip(ws, seqs, strict=True):
            _wait(lambda w=w, seq=seq: w._seq > seq, "a flush")
        if i % 25 == 24 or i == flushes - 1:  # live segments of the busiest writer directory
            live = collections.Counter(f.rsplit("/", 2)[-2] + f.split("/")[-3] for t in TABLES
                                       for f in live_files(run, t))
            peak = max(peak, max(live.values()))
    interval_ms = (time.perf_counter() - t0) / flushes * 1e3
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        with open_store(run) as con:
            n = con.rows("SELECT count(*) FROM timings")[0][0]
        times.append(time.perf_counter() - t0)
        if n != 2 * writers * flushes:
            raise SystemExit(f"timings rows {n} != {2 * writers * flushes}")
    for w in ws:
        w.close()
    ops = _ops(ops_file) - before
    on_disk = max(len(list(d.glob("*.parquet"))) for t in TABLES for d in (run / t).glob("writer=*")
                  if not d.name.endswith("_schema"))
    per = {k: ops[k] / (writers * flushes) for k in KINDS}
    return {"peak_live": peak, "on_disk": on_disk, "per_flush": per, "open_count_s": statistics.median(times),
            "interval_ms": interval_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--flushes", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--settle-s", type=float, default=0.05)
    ap.add_argument("--grace-s", type=float, default=0.25)
    args = ap.parse_args()
    own_fold.SETTLE_S, own_fold.GRACE_S = args.settle_s, args.grace_s
    own_fold.DELETE_PERIOD_S, own_fold.DELETE_WINDOW_S = 10 * args.settle_s, 1.25 * args.settle_s  # as 20 s, 2.5 s to 2 s
    root = Path(tempfile.mkdtemp(prefix="dynascope-files-"))
    m = Mount(root)
    backing, mnt, ops_file = m.backing, m.path, m.ops
    results: dict[str, list[dict]] = {"fold on": [], "fold off": []}
    try:
        for r in range(args.rounds):
            for arm in (("fold on", "fold off") if r % 2 == 0 else ("fold off", "fold on")):
                run = mnt / f"run-{r}-{arm.replace(' ', '-')}"
                results[arm].append(_arm(run, args.writers, args.flushes, arm == "fold on", ops_file))
                shutil.rmtree(backing / run.name)
        print(f"{args.writers} writers x {args.flushes} flushes, {args.rounds} rounds, medians (range)\n")
        head = ["arm", "ms/flush round", "live segs/writer/table (peak)", "files/writer/table at end", "open+count s",
                *[f"{k}/flush" for k in KINDS], "metadata ops/writer/hour"]
        print(" | ".join(head))
        for arm, rs in results.items():
            med = lambda xs: statistics.median(xs)  # noqa: E731
            per = {k: med([x["per_flush"][k] for x in rs]) for k in KINDS}
            opens = [x["open_count_s"] for x in rs]
            print(" | ".join([arm, f"{med([x['interval_ms'] for x in rs]):.1f}", f"{med([x['peak_live'] for x in rs]):.0f}", f"{med([x['on_disk'] for x in rs]):.0f}",
                              f"{med(opens):.3f} ({min(opens):.3f}-{max(opens):.3f})",
                              *[f"{per[k]:.1f}" for k in KINDS], f"{sum(per.values()) * FLUSHES_PER_HOUR:,.0f}"]))
    finally:
        m.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
