"""Trace import + temporal breakdown: dynascope vs Holistic Trace Analysis on the same large traces.

Builds an 8-rank job by tiling a shared HTA trace (each copy shifted in time, with fresh correlation ids
and ProfilerStep numbers) to ~1 GB of uncompressed JSON in all (``--quick``: ~50 MB), then runs, each in
a fresh subprocess:

* dynascope: ``import_traces`` (streaming) + ``temporal_breakdown``;
* HTA: ``TraceAnalysis(trace_dir=...)`` (loads every rank) + ``get_temporal_breakdown``.

Peak memory is the largest sum of RSS over the subprocess and its children (HTA parses ranks in a
process pool), sampled every 20 ms; ``ru_maxrss`` of the largest single process is printed beside it.
CPU time (user + system, the subprocess and the children it reaped) is printed too: on a shared machine it
moves less than wall time does. Both sides parse several ranks at once (HTA: processes; dynascope: threads).
Not run in CI.  Usage: ``python benchmarks/trace_import.py [--quick] [--keep DIR]``
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces" / "hta"
BASE = SHARED / "trace_diff" / "control" / "control.json.gz"
STEP = re.compile(r"ProfilerStep#(\d+)")

DYNASCOPE = """
import sys, time
from pathlib import Path
from dynascope.importers.trace import import_traces
from dynascope.analyses.gpu_timeline import temporal_breakdown  # not the package index: it imports torch
t = time.perf_counter()
import_traces([Path(sys.argv[1])], Path(sys.argv[2]))
df = temporal_breakdown(Path(sys.argv[2]))
print(df.select("rank", "idle_time_pct", "compute_time_pct").to_dicts()[:2], time.perf_counter() - t)
"""
# Appended to both: the largest RSS of this process or any child it reaped (HTA's parser pool).
MAXRSS = """
import resource
print("MAXRSS_KB", max(resource.getrusage(w).ru_maxrss for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
"""

HTA = """
import sys, time, logging, warnings
warnings.filterwarnings("ignore"); logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
t = time.perf_counter()
df = TraceAnalysis(trace_dir=sys.argv[1]).get_temporal_breakdown(visualize=False)
print(df[["rank", "idle_time_pctg", "compute_time_pctg"]].head(2).to_dict("records"), time.perf_counter() - t)
"""


def build(out: Path, ranks: int, target_bytes: int) -> int:
    """Write ``ranks`` gzip traces of ~``target_bytes`` total JSON; return the uncompressed total."""
    doc = json.loads(gzip.open(BASE).read())
    events = doc.pop("traceEvents")
    per_copy = len(json.dumps(events))
    copies = max(1, round(target_bytes / ranks / per_copy))
    ts = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float))]
    lo, span = min(ts), max(ts) - min(ts) + 1000
    if target_bytes / ranks < per_copy:  # smaller than one copy: the events of the first part of the time
        cut = lo + span * target_bytes / ranks / per_copy
        events = [e for e in events if not isinstance(e.get("ts"), (int, float)) or e["ts"] <= cut]
    total = 0
    out.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        head = dict(doc, distributedInfo={"backend": "nccl", "rank": rank, "world_size": ranks})
        with gzip.open(out / f"rank-{rank}.json.gz", "wb", compresslevel=1) as f:
            prefix = json.dumps(head)[:-1] + ', "traceEvents": ['
            f.write(prefix.encode())
            total += len(prefix)
            for k in range(copies):
                tile = copy.deepcopy(events)
                for e in tile:
                    if isinstance(e.get("ts"), (int, float)):
                        e["ts"] += k * span
                    args = e.get("args")
                    if isinstance(args, dict) and isinstance(args.get("correlation"), int):
                        args["correlation"] += k * 10**8
                    if isinstance(e.get("name"), str) and "ProfilerStep" in e["name"]:
                        e["name"] = STEP.sub(lambda m, k=k: f"ProfilerStep#{int(m.group(1)) + k * 1000}", e["name"])
                body = json.dumps(tile)[1:-1] + (", " if k < copies - 1 else "")
                f.write(body.encode())
                total += len(body)
            f.write(b"]}")
    return total


def measure(code: str, *args: str) -> tuple[float, float, float, float, str]:
    """Run ``code`` in a fresh interpreter: (wall s, peak tree RSS MB, max single-process RSS MB, CPU s, stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code + MAXRSS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.02)
    out, err = proc.communicate()
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode:
        raise SystemExit(f"subprocess failed ({proc.returncode}): {err.decode()[-2000:]}")
    text, _, single = out.decode().strip().rpartition("MAXRSS_KB ")
    return wall, peak / 2**20, int(single) / 1024, cpu, text.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~50 MB instead of ~1 GB")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--keep", type=Path, help="build the traces here and keep them")
    a = ap.parse_args()
    if not BASE.exists():
        raise SystemExit(f"shared traces not found at {SHARED}")
    work = a.keep or Path(tempfile.mkdtemp(prefix="dynascope-bench-"))
    try:
        t = time.perf_counter()
        size = build(work / "traces", a.ranks, 50 * 2**20 if a.quick else 2**30)
        gz = sum(p.stat().st_size for p in (work / "traces").iterdir())
        print(f"built {a.ranks} ranks: {size / 2**20:.0f} MiB JSON ({gz / 2**20:.0f} MiB gzip) "
              f"in {time.perf_counter() - t:.0f} s")
        ours = measure(DYNASCOPE, str(work / "traces"), str(work / "run"))
        theirs = measure(HTA, str(work / "traces"))
        print(f"\n{'':28}{'dynascope':>12}{'HTA 0.5':>12}{'ratio':>10}")
        print(f"{'wall time (s)':28}{ours[0]:12.1f}{theirs[0]:12.1f}{theirs[0] / ours[0]:9.1f}x")
        print(f"{'peak RSS, process tree (MB)':28}{ours[1]:12.0f}{theirs[1]:12.0f}{theirs[1] / ours[1]:9.1f}x")
        print(f"{'max RSS, one process (MB)':28}{ours[2]:12.0f}{theirs[2]:12.0f}{theirs[2] / ours[2]:9.1f}x")
        print(f"{'CPU time, user+sys (s)':28}{ours[3]:12.1f}{theirs[3]:12.1f}{theirs[3] / ours[3]:9.1f}x")
        print(f"\ndynascope: {ours[4]}\nHTA:       {theirs[4]}")
    finally:
        if a.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
