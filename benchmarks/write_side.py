"""The write side against torchtitan's structured logger, at the same ranks and steps: files, metadata
operations, per-step cost on the training thread, and what a reader pays to open and count the run.

One process per rank (forked), as in training. Each step a rank records its step's timings, four rows
(forward, backward, optimizer, step):

- **dynascope**: ``RunWriter.append("timings", ...)`` (the call the timing probe makes), one flush a step
  on the writer's own thread (``flush_rows`` is reached: an hours-long run at the default 2 s interval,
  compressed), with its own fold on. Mid-run, with every writer live: the most live segments any writer
  holds per table, the Parquet files on disk, and ``open_store`` + ``count(*)`` of ``timings`` in a fresh
  process (wall seconds and peak RSS from ``wait4``, ``--rounds`` times). After close: files per table
  at rest (the last close's fold, finished by an open), no manual command.
- **torchtitan** (``torchtitan.observability.structured_logger``, 0.3.0: one JSONL file per rank, a
  ``logging.FileHandler`` writing each record on the calling thread): ``set_step`` and one
  ``log_trace_span`` per phase. Open + count: DuckDB ``read_json`` over the ranks' files, in a fresh
  process, ``--rounds`` times.

Metadata operations (create, rename, unlink, mkdir, utime, readdir) are counted by the FUSE pass-through
of the fault tests (``tests/helpers/faultfs.py``) on a smaller run (``--fuse-ranks`` × ``--fuse-steps``),
and scaled to a writer-hour at one step every 2 s (a flush every 2 s is the writer's default).

torchtitan 0.3.0 pins ``datasets<4.8`` and ``huggingface_hub<2``, which would downgrade this environment's,
so it is unpacked without its dependencies into ``--torchtitan`` (the structured logger needs only torch):

    pip download --no-deps torchtitan==0.3.0 -d /tmp/tt && unzip -o -q /tmp/tt/torchtitan-0.3.0-*.whl -d /tmp/tt/lib
    python benchmarks/write_side.py --torchtitan /tmp/tt/lib --ranks 16 --steps 250 500 1000 --rounds 5
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dynascope.store.at_rest as at_rest
import dynascope.store.own_fold as own_fold
from dynascope.store import RunWriter, live_files

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))
PHASES = ["forward", "backward", "optimizer", "step"]
STEPS_PER_HOUR = 3600 / 2.0  # one step (one flush) every 2 s
META = ("create", "rename", "unlink", "mkdir", "rmdir", "utimens", "readdir")
COUNT = {"dynascope": ("from dynascope.store import open_store; s = open_store({path!r}); "
                       "n = s.rows('SELECT count(*) FROM timings')[0][0]"),
         "torchtitan": ("import duckdb; n = duckdb.sql(\"SELECT count(*) FROM read_json({path!r} || "
                        "'/structured_logs/*.jsonl', format = 'newline_delimited', ignore_errors = true)\").fetchall()[0][0]")}
# The same open with the views bound by every file's footer (``union_by_name``), as for runs of other columns.
COUNT["dynascope-wide"] = "import dynascope.store.views as v; v.narrow = lambda loc: False; " + COUNT["dynascope"]
# The what-ifs' filter (the top-level and step rows, placed): a count that types each journal column it names.
COUNT["dynascope-filtered"] = ("from dynascope.analyses.steps import STEP_ROW, TOP_LEVEL; "
                               "from dynascope.store import open_store; s = open_store({path!r}); "
                               "n = s.rows('SELECT count(*) FROM timings WHERE ((' + TOP_LEVEL + ') OR (' + STEP_ROW "
                               "+ ')) AND rank IS NOT NULL AND start_us IS NOT NULL AND dur_us IS NOT NULL')[0][0]")
# A snapshot (lease, listing, and the journal rows' copy, or segments alone) counted as another engine reads it.
for _arm, _journals in (("snapshot", True), ("snapshot-segments", False)):
    COUNT[_arm] = ("from dynascope.store.snapshot import open_snapshot; from dynascope.store.engines import DuckDBTables; "
                   f"snap = open_snapshot({{path!r}}, journals={_journals}); "
                   "n = DuckDBTables(snap, ['timings']).rows('SELECT count(*) FROM timings')[1][0][0]; snap.release()")


def _dyn_rank(run: str, rank: int, ranks: int, steps: int, done, go, out) -> None:
    w = RunWriter(run, rank=rank, world_size=ranks, flush_secs=3600, flush_rows=len(PHASES))
    costs = []
    for step in range(steps):
        t0 = time.perf_counter_ns()
        w.append("timings", {"step": step, "phase": PHASES, "dur_us": [1000, 2000, 500, 3600],
                             "category": ["phase", "phase", "phase", "step"]})
        costs.append(time.perf_counter_ns() - t0)
        deadline = time.monotonic() + 120
        while w.rows_written < len(PHASES) * (step + 1) and time.monotonic() < deadline:
            time.sleep(0.0005)
        done[rank] = step + 1
    go.wait(600)  # the parent measures the live run with every writer open, then lets them close
    w.close()
    _report(out, rank, costs)


def _tt_rank(path: str, rank: int, ranks: int, steps: int, done, go, out, lib: str) -> None:
    sys.path.insert(0, lib)
    from torchtitan.observability import structured_logger as sl

    sl.init_structured_logger(source="trainer", output_dir=path, rank=rank)
    costs = []
    for step in range(steps):
        t0 = time.perf_counter_ns()
        sl.set_step(step)
        with sl.log_trace_span("step"):
            for phase in PHASES[:-1]:
                with sl.log_trace_span(phase):
                    pass
        costs.append(time.perf_counter_ns() - t0)
        done[rank] = step + 1
    go.wait(600)
    _report(out, rank, costs)


def _report(out, rank: int, costs: list[int]) -> None:
    out.put((rank, costs))
    out.close()
    out.join_thread()  # the queue's feeder thread has sent it before the process ends
    os._exit(0)


def _open_count(arm: str, path: Path, rounds: int, env: dict | None = None) -> list[dict]:
    """``open + count`` in a fresh process, ``rounds`` times: wall seconds, peak RSS (MB), rows."""
    out = []
    # peak RSS from the child's own VmHWM: wait4's ru_maxrss would count the fork of this (larger) process
    code = "import json, time, re; t = time.perf_counter(); " + COUNT[arm].format(path=str(path)) + \
           "; s = time.perf_counter() - t; hwm = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())" + \
           "; print(json.dumps({'s': s, 'rows': n, 'rss_mb': int(hwm.group(1)) / 1024}))"
    child = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    for _ in range(rounds):  # run in the tree it imports: ``python -c`` puts its working directory first on sys.path
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=child["PYTHONPATH"], env=child)
        line = proc.stdout.read().decode() if proc.stdout else ""
        if proc.wait() != 0:
            raise SystemExit(f"{arm}: open + count failed")
        out.append(json.loads(line.splitlines()[-1]))
    return out


def _open_ab(path: Path, rounds: int, env: dict | None = None) -> tuple[list[dict], list[dict]]:
    """``open + count`` with narrow views (the default for runs of the current columns) and wide ones,
    alternating round by round, which goes first too."""
    narrow: list[dict] = []
    wide: list[dict] = []
    for r in range(rounds):
        for arm, out in (("dynascope", narrow), ("dynascope-wide", wide))[::1 if r % 2 == 0 else -1]:
            out += _open_count(arm, path, 1, env)
    return narrow, wide


def _files(path: Path, arm: str) -> dict[str, int]:
    def count(d: Path, suffix: str) -> int:  # os.walk passes over directories a fold removes meanwhile
        return sum(1 for _, _, names in os.walk(d) for n in names if n.endswith(suffix))
    if arm == "torchtitan":
        return {"jsonl": count(path, ".jsonl")}
    return {t: count(path / t, ".parquet") for t in ("timings", "events")}


def _live_peak(run: Path) -> dict[str, int]:
    out = {}
    for table in ("timings", "events"):
        per = collections.Counter(f.rsplit("/", 2)[-2] for f in live_files(run, table, at_us=time.time_ns() // 1000))
        out[table] = max((n for w, n in per.items() if w not in ("writer=_schema", "writer=_merged")), default=0)
    return out


def run_arm(arm: str, path: Path, ranks: int, steps: int, rounds: int, lib: str | None, sample: bool = True) -> dict:
    ctx = mp.get_context("fork")
    done, go, out = ctx.Array("l", ranks, lock=False), ctx.Event(), ctx.Queue()
    target, extra = (_dyn_rank, ()) if arm == "dynascope" else (_tt_rank, (lib,))
    procs = [ctx.Process(target=target, args=(str(path), r, ranks, steps, done, go, out, *extra)) for r in range(ranks)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    peak: collections.Counter = collections.Counter()
    while min(done) < steps and any(p.is_alive() for p in procs):
        if arm == "dynascope" and sample and (path / "dynascope.json").exists():
            for t, n in _live_peak(path).items():
                peak[t] = max(peak[t], n)
        time.sleep(0.2)
    wall = time.perf_counter() - t0
    res: dict = {"wall_s": wall, "live_peak": dict(peak), "files_live": _files(path, arm)}
    if rounds and arm == "dynascope":
        res["open_count"], res["open_count_wide"] = _open_ab(path, rounds)
    elif rounds:
        res["open_count"] = _open_count(arm, path, rounds)
    go.set()
    costs = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=600)
    res["step_us"] = [statistics.median(c) / 1e3 for c in costs.values()]  # per rank: its median step cost
    if arm == "dynascope":  # at rest with no manual command: the last close folded, an open finishes it
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            _open_count(arm, path, 1)
            if max(_files(path, arm).values()) <= 2:
                break
            time.sleep(0.5)
        res["rest_s"] = time.perf_counter() - t0 - wall
    res["files_rest"] = _files(path, arm)
    return res


def metadata_ops(ranks: int, steps: int, rounds: int, lib: str | None) -> dict[str, list[dict]]:
    """Metadata operations per writer per step on the FUSE mount, by kind, per arm per round (a run's
    whole life: start, steps, close and, for dynascope, the fold that puts it at rest)."""
    from faultfs import Mount

    root = Path(tempfile.mkdtemp(prefix="dynascope-meta-"))
    m = Mount(root)
    out: dict[str, list[dict]] = {"dynascope": [], "torchtitan": []}
    try:
        for r in range(rounds):
            for arm in out if lib else ["dynascope"]:
                before = collections.Counter(m.ops.read_text().split()) if m.ops.exists() else collections.Counter()
                run_arm(arm, m.path / f"{arm}-{r}", ranks, steps, 0, lib, sample=False)
                ops = collections.Counter(m.ops.read_text().split()) - before
                out[arm].append({k: ops[k] / (ranks * steps) for k in META})
    finally:
        m.close()
        shutil.rmtree(root, ignore_errors=True)
    return out


def open_vs_files(writers: list[int], flushes: int, rounds: int) -> dict[int, dict]:
    """What opening and counting costs per live file: runs of ``writers`` writers holding ``flushes`` live
    segments each (the own fold's bound is 8), written without folding and opened as they are (``DYNASCOPE_FOLD=0``
    in the reader, so it does not fold them behind itself)."""
    out = {}
    for n in writers:
        d = Path(tempfile.mkdtemp(prefix="write-side-files-"))
        try:
            for rank in range(n):
                w = RunWriter(d / "r", rank=rank, world_size=n, flush_secs=3600, flush_rows=10**9, fold=False)
                for step in range(flushes):
                    w.append("timings", {"step": step, "phase": PHASES, "dur_us": [1000, 2000, 500, 3600]})
                    w.flush()
                w.close()
            files = sum(1 for _ in (d / "r").rglob("*.parquet"))
            narrow, wide = _open_ab(d / "r", rounds, {"DYNASCOPE_FOLD": "0"})
            out[n] = {"files": files, "open_count": narrow, "open_count_wide": wide}
            print(f"open vs files: {n} writers, {files} files: "
                  f"{statistics.median(x['s'] for x in out[n]['open_count']):.2f} s", flush=True)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return out


def ipc_step_us(rounds: int, sends: int = 5000) -> list[float]:
    """A node aggregator's cost on the training thread: one step's timings rows pickled and sent over a
    local socket to another process (which reads them), µs per step, per round."""
    import pickle
    import socket

    out = []
    for _ in range(rounds):
        a, b = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            a.close()
            while b.recv(1 << 16):
                pass
            os._exit(0)
        b.close()
        row = {"step": 0, "phase": PHASES, "dur_us": [1000, 2000, 500, 3600], "rank": 3}
        t0 = time.perf_counter_ns()
        for i in range(sends):
            row["step"] = i
            data = pickle.dumps(row, protocol=5)
            a.sendall(len(data).to_bytes(4, "little") + data)
        out.append((time.perf_counter_ns() - t0) / sends / 1e3)
        a.close()
        os.waitpid(pid, 0)
    return out


def _med(xs: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})" if xs else "—"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--steps", type=int, nargs="+", default=[250, 500, 1000])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fuse-ranks", type=int, default=4)
    ap.add_argument("--fuse-steps", type=int, default=200)
    ap.add_argument("--torchtitan", help="a directory holding the unpacked torchtitan 0.3.0 wheel")
    ap.add_argument("--open-writers", type=int, nargs="*", default=[64, 256],
                    help="writers of the runs that time opening against live files (8 segments each)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    # A step comes every ~100 ms here, not every 2 s: settle, grace and deletion windows scaled to match.
    own_fold.SETTLE_S, own_fold.GRACE_S = 0.02, 0.5
    own_fold.DELETE_PERIOD_S, own_fold.DELETE_WINDOW_S = 2.0, 0.25
    at_rest.SETTLE_S, at_rest.GRACE_S = 0.05, 0.1
    arms = ["dynascope", "torchtitan"] if args.torchtitan else ["dynascope"]
    results: dict = {"sizes": {}, "meta": {}}
    print(f"cores {len(os.sched_getaffinity(0))}, load average {os.getloadavg()}", flush=True)
    results["meta"] = metadata_ops(args.fuse_ranks, args.fuse_steps, args.rounds, args.torchtitan)
    results["ipc_us"] = ipc_step_us(args.rounds)
    results["open_vs_files"] = open_vs_files(args.open_writers, 8, args.rounds)
    for steps in args.steps:
        for arm in arms:
            d = Path(tempfile.mkdtemp(prefix=f"write-side-{arm}-"))
            try:
                results["sizes"][f"{arm} {steps}"] = run_arm(arm, d / "r", args.ranks, steps, args.rounds, args.torchtitan)
            finally:
                shutil.rmtree(d, ignore_errors=True)
            print(f"{arm} {args.ranks} x {steps}: {json.dumps(results['sizes'][f'{arm} {steps}'])[:300]}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"\n{args.ranks} ranks, one process each; medians (min–max); load average after {os.getloadavg()}\n")
    print("| arm | steps | live files/writer/table (peak) | files live (timings) | files at rest (timings) | "
          "open + count live s | its peak MB | wide views: s | µs per step on the training thread (ranks' medians) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, r in results["sizes"].items():
        arm, steps = key.split()
        oc = r.get("open_count", [])
        live = r["files_live"].get("timings", r["files_live"].get("jsonl"))
        rest = r["files_rest"].get("timings", r["files_rest"].get("jsonl"))
        print(f"| {arm} | {steps} | {r['live_peak'].get('timings', '—')} | {live} | {rest} | "
              f"{_med([x['s'] for x in oc])} | {_med([x['rss_mb'] for x in oc], '{:.0f}')} | "
              f"{_med([x['s'] for x in r.get('open_count_wide', [])])} | {_med(r['step_us'], '{:.1f}')} |")
    print(f"\nnode aggregation's send, µs per step on the training thread: {_med(results['ipc_us'], '{:.1f}')}")
    for n, r in results["open_vs_files"].items():
        print(f"open + count, {n} writers x 8 live segments ({r['files']} Parquet files): "
              f"{_med([x['s'] for x in r['open_count']])} s, {_med([x['rss_mb'] for x in r['open_count']], '{:.0f}')} MB; "
              f"wide views {_med([x['s'] for x in r['open_count_wide']])} s")
    print(f"\nmetadata operations per writer per step ({args.fuse_ranks} ranks x {args.fuse_steps} steps on FUSE, "
          "the run's whole life), and per writer-hour at a step every 2 s (the default flush interval)\n")
    print("| arm | " + " | ".join(META) + " | create+rename+unlink+mkdir+rmdir per hour | all per hour |")
    print("|---" * (len(META) + 3) + "|")
    for arm, rounds_ in results["meta"].items():
        if rounds_:
            per = {k: statistics.median(r[k] for r in rounds_) for k in META}
            writes = [sum(r[k] for k in META[:5]) * STEPS_PER_HOUR for r in rounds_]
            alls = [sum(r.values()) * STEPS_PER_HOUR for r in rounds_]
            print(f"| {arm} | " + " | ".join(f"{per[k]:.2f}" for k in META) +
                  f" | {_med(writes, '{:,.0f}')} | {_med(alls, '{:,.0f}')} |")


if __name__ == "__main__":
    main()
