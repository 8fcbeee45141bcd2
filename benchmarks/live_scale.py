"""A live run at cluster scale through the real writers, read while it runs.

``--writers`` ``RunWriter``s (``--trainers`` of them trainers, the rest rollout workers), each watch()'s
journal writer with its own background maintenance on (flushes append to a journal per table, a seal every
``--seal-s``, the writer's own fold of its seals and its deletion windows), are hosted as threads of
``--procs`` forked processes. Each writer records a step's four phase rows every ``--step-s`` of wall time
for ``--steps`` steps (``--event-every`` steps, an ``events`` row too): an hours-long run compressed, with
a seal every ``--seal-s`` standing for watch()'s 300 s. Nothing else is faked: the files, their names,
seals, merges and deletions are the writers' own. The writers skip ``fsync`` (synthetic rows need not
survive a power cut, and 1,280 writers' fsyncs would measure this machine's disk; the files are the same).

While the run is live, at ``--reads`` evenly spaced steps, the writers' processes are stopped (SIGSTOP: on
this machine their 1,280 threads would take the reader's cores, where a real reader has a node of its own;
queries beside running writers are the tests' part) and a fresh process opens the run and counts
``timings``, ``--rounds`` times: seconds and its peak RSS; then every row of every table the writers wrote
against those they had flushed (none lost), and the timings rows read twice (none doubled). With ``--cluster``
each step's timings are the synthetic cluster's (``demo.synthetic``: start times, a slow node, the rollout
workers' phases), and ``--calls`` times the timing analyses and ``dynascope report`` on the live files at each
read, each in a fresh process (import, open and the call), as ``cluster_scale.py`` does on a finished run;
with ``--baseline`` also with another checkout's code, and with ``--at-rest`` also on a copy of the stopped
run that ``dynascope compact`` brought to rest: the same rows in a few files, so what of a call's time is
the live files and what the rows.
Every ~2 s the parent samples each writer directory: Parquet files and journals on disk, and live
segments (the files a query counts). After the last writer closes, nothing else runs: the run must come to
rest (a few files per table) by itself, with every row counted once.

    python benchmarks/live_scale.py --writers 1280 --trainers 1024 --steps 500 --procs 4
    python benchmarks/live_scale.py --writers 64 --trainers 64 --steps 5000 --procs 2 --step-s 0.05 --flush-s 1 --seal-s 2
    python benchmarks/live_scale.py --writers 1280 --trainers 1024 --steps 300 --procs 4 --seal-s 30 --reads 3 \
        --cluster --calls straggler_scores what_if step_breakdown schedule_what_if report
    python benchmarks/live_scale.py --writers 1280 --trainers 1024 --steps 300 --procs 4 --seal-s 30 --reads 3 \
        --rounds 5 --cluster --calls what_if step_breakdown schedule_what_if straggler_scores --at-rest \
        --baseline ../dynascope-before
    python benchmarks/live_scale.py --writers 1280 --trainers 1024 --per-writer 8 --steps 300 --procs 4 --seal-s 6 \
        --reads 3 --rounds 5 --cluster --calls what_if schedule_what_if step_breakdown straggler_scores --at-rest

With ``--per-writer K`` each writer also writes the rows of the K - 1 ranks after its own, each row with
its rank and role, as a node writer (``store.node``) writes its node's: the files, seals, folds and deletion
windows a query meets are a node writer's, without the sockets (on this 2-core machine, beside 1,280 writer threads,
node writers answer their senders too late and the senders fall back to their own files; ``--node`` runs
the real thing).

The first is watch()'s flush interval (10 s) with a seal a minute; the second seals every 2 s, 125 seals a
writer, to show the files stay flat however many seals a writer makes; the third reads a live run the way
the timing analyses and the report do, at three points of the writers' fold cycles; the fourth times them
against an earlier checkout on the same live files, and on the same rows at rest; the fifth times them on
a writer per node of 8's files.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from write_side import COUNT, _live_peak, _open_count  # noqa: E402  (write_side's open + count, live census)

from dynascope.demo.synthetic import ClusterPlan, ClusterSpec  # noqa: E402
from dynascope.demo.synthetic_write import trainer_timings, worker_timings  # noqa: E402
from dynascope.store import RunWriter  # noqa: E402
from dynascope.store.layout import MARKER  # noqa: E402

PHASES = ["forward", "backward", "optimizer", "step"]
DUR_US = [1000, 2000, 500, 3600]
TABLES = ("timings", "events")
# Beside the timed count: every row the writers wrote (none lost: at least those they had flushed), and
# the timings rows read twice (none doubled: each rank's step and phase once).
OPEN = "from dynascope.store import open_store; s = open_store({path!r}); "
COUNT["live-all"] = OPEN + ("n = s.rows('SELECT (SELECT count(*) FROM timings) + (SELECT count(*) FROM events)"
                            " + (SELECT count(*) FROM runs)')[0][0]")  # a writer's rows_written counts its runs row
COUNT["live-fallback"] = OPEN + "n = s.rows(\"SELECT count(*) FROM events WHERE event = 'node_fallback'\")[0][0]"
COUNT["live-twice"] = OPEN + "n = s.rows('SELECT count(*) - count(DISTINCT (rank, step, phase)) FROM timings')[0][0]"


def _host(run: str, p: int, ranks: list[int], a: argparse.Namespace, go, done, flushed, cost_ns, paused, appended,
          plan: ClusterPlan | None) -> None:
    """One process's writers: append each step's rows to every writer, paced by wall time; pause while the
    parent reads (``go`` cleared); publish the rows flushed; close them all."""
    os.fsync = lambda fd: None  # type: ignore[assignment]  (see the module's docstring)
    writers = [RunWriter(run, rank=r, role=_role(r, a), world_size=a.writers,
                         flush_secs=a.flush_s, seal_secs=a.seal_s, fold=True,
                         node=f"node{r // a.node}" if a.node > 1 else False) for r in ranks]
    costs: list[int] = []
    t_next = time.monotonic()
    for step in range(a.steps):
        if not go.is_set():
            paused[p] = 1
            go.wait()
            paused[p] = 0
        for w in writers:
            t0 = time.perf_counter_ns()
            for r in range(w.rank, w.rank + a.per_writer):  # --per-writer: the ranks after its own too
                if plan is None:
                    cols: dict = {"step": step, "phase": PHASES, "dur_us": DUR_US, "category": ["phase", "phase", "phase", "step"]}
                else:  # the synthetic cluster's phases: what the timing analyses read
                    cols = trainer_timings(plan, r, step) if r < a.trainers else worker_timings(plan, r - a.trainers, step)
                if a.per_writer > 1:
                    cols.update(rank=r, role=_role(r, a))
                w.append("timings", cols)
                appended[p] += len(cols["phase"])
            if step % a.event_every == 0:
                w.append("events", {"step": [step], "event": ["bench"], "severity": ["info"], "message": ["live"]})
            costs.append(time.perf_counter_ns() - t0)
        flushed[p] = sum(w.rows_written for w in writers)  # every table's, the writer's own events too
        done[p] = step + 1
        t_next = max(t_next + a.step_s, time.monotonic() - a.step_s)  # a late step does not make a burst
        time.sleep(max(t_next - time.monotonic(), 0))
    closers = [threading.Thread(target=w.close, kwargs={"timeout_s": 120}) for w in writers]  # as ranks do: at once
    for t in closers:
        t.start()
    for t in closers:
        t.join(180)
    cost_ns[p] = int(statistics.median(costs))
    os._exit(0)


def _role(rank: int, a: argparse.Namespace) -> str:
    return "trainer" if rank < a.trainers else "rollout"


def _call(name: str, run: Path, spec: dict, env: dict | None = None) -> dict:
    """One round of ``cluster_scale``'s call ``name`` (or ``report``: ``dynascope report``) in a fresh process
    (``env``: the baseline's), its seconds (import, open and the call) and its peak MB."""
    if name.startswith("report"):  # "report-per-query": the report with no table read once (``pin``), to compare
        unpinned = "import dynascope.store.reader as r; r.PIN_MIN_FILES = 1 << 62; " if name == "report-per-query" else ""
        # the CLI's own path; click returns instead of exiting, and the report's text precedes the figures' line
        COUNT[name] = unpinned + "from dynascope.cli import app; n = app(['report', {path!r}], standalone_mode=False) or 0"
        return _open_count(name, run, 1, env)[0]
    from cluster_scale import CALLS
    code = (f"import dynascope.analyses as A; from pathlib import Path; from dynascope.store import open_store; "
            f"store = open_store({str(run)!r}); run = Path({str(run)!r}); SPEC = {spec!r}; PLANTED = {{}}; "
            f"n = len(eval({CALLS[name]!r}))")
    COUNT[f"call:{name}"] = code.replace("{", "{{").replace("}", "}}")  # _open_count formats it with the path
    return _open_count(f"call:{name}", run, 1, env)[0]


def _calls(a: argparse.Namespace, run: Path, spec: dict, arms: list[tuple[str, dict | None]]) -> dict[str, list[dict]]:
    """``--rounds`` rounds of each of ``--calls`` in each arm (a suffix to its name, its environment), the
    order of calls and arms alternating round by round."""
    order = [(name, suffix, env) for name in a.calls for suffix, env in arms]
    calls: dict[str, list[dict]] = {name + suffix: [] for name, suffix, _ in order}
    for r in range(a.rounds):
        for name, suffix, env in order[::1 if r % 2 == 0 else -1]:
            calls[name + suffix].append(_call(name, run, spec, env))
    return calls


def _rested(run: Path, rest: Path) -> Path:
    """A copy of the stopped run brought to rest by ``dynascope compact``: its writers will never write again,
    so their heartbeats are dated an hour back and compaction folds them as finished."""
    shutil.rmtree(rest, ignore_errors=True)
    shutil.copytree(run, rest, symlinks=True)
    old = time.time() - 3600
    for beat in (rest / "_writers").glob("*.json"):
        os.utime(beat, (old, old))
    subprocess.run([sys.executable, "-c", "from dynascope.cli import app; app()", "compact", str(rest), "--grace-s", "0", "--wait"],
                   check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    return rest


def _sample(run: Path) -> dict[str, tuple[int, ...]]:
    """Per table: the most Parquet files, journals and live segments any one writer holds now, and the
    Parquet files and journals of all of them (what a query's glob lists and opens)."""
    live = _live_peak(run)  # per table, the most live segments of one writer
    out = {}
    for table in TABLES:
        files: collections.Counter = collections.Counter()
        journals: collections.Counter = collections.Counter()
        for wdir in (run / table).glob("writer=*"):
            if wdir.name in ("writer=_schema", "writer=_merged"):
                continue
            try:
                names = os.listdir(wdir)
            except FileNotFoundError:  # folded away at close
                continue
            files[wdir.name] = sum(n.endswith(".parquet") for n in names)
            journals[wdir.name] = sum(n.endswith(".jsonl") for n in names)
        out[table] = (max(files.values(), default=0), max(journals.values(), default=0), live[table],
                      sum(files.values()), sum(journals.values()))
    return out


def _at_rest(run: Path) -> dict[str, int]:
    return {t: sum(n.endswith((".parquet", ".jsonl")) for _, _, names in os.walk(run / t) for n in names)
            for t in TABLES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--writers", type=int, default=1280)
    ap.add_argument("--trainers", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=0.6)
    ap.add_argument("--flush-s", type=float, default=10.0)
    ap.add_argument("--seal-s", type=float, default=60.0)
    ap.add_argument("--event-every", type=int, default=50)
    ap.add_argument("--node", type=int, default=1, help="ranks a node writer (store.node); 1: a writer per rank")
    ap.add_argument("--per-writer", type=int, default=1, help="ranks whose rows one writer writes, each with its own "
                    "rank and role, as a node writer writes its node's (store.node) without its senders' sockets: the "
                    "files, seals and folds a query meets are a node writer's (this machine cannot carry 1,280 senders)")
    ap.add_argument("--reads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, help="where the run goes (default: a temporary directory, removed)")
    ap.add_argument("--baseline", type=Path, help="another checkout of dynascope: each read also opens and counts "
                    "with its reader and times --calls with it, the arms alternating round by round, on the same files")
    ap.add_argument("--cluster", action="store_true", help="each step's timings from the synthetic cluster "
                    "(demo.synthetic: start times, a slow node, rollout workers' phases), for --calls")
    ap.add_argument("--calls", nargs="*", default=[], help="at each read, also time these calls of cluster_scale.py "
                    "(open + call, a fresh process each, --rounds rounds), 'report' (dynascope report) and "
                    "'report-per-query' (the same with no table read once)")
    ap.add_argument("--at-rest", action="store_true", help="at each read, also time --calls on a compacted copy "
                    "of the stopped run: the same rows at rest")
    ap.add_argument("--keep", type=Path, help="at each read, copy the stopped run to KEEP/step-<n>: a mid-run "
                    "layout to study or compact afterwards (its writers never close, so nothing folds it)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    spec = ClusterSpec(ranks=a.trainers, rollout_workers=a.writers - a.trainers, steps=a.steps) if a.cluster else None
    plan = ClusterPlan(spec) if spec else None
    base = a.dir or Path(tempfile.mkdtemp(prefix="live-scale-"))
    run = base / "run"
    shutil.rmtree(run, ignore_errors=True)
    ctx = mp.get_context("fork")
    go, n = ctx.Event(), a.procs
    done, flushed, cost_ns, paused, appended = (ctx.Array("q", n, lock=False) for _ in range(5))
    go.set()
    if a.per_writer < 1 or (a.per_writer > 1 and (a.node > 1 or a.trainers % a.per_writer or a.writers % a.per_writer)):
        raise SystemExit("--per-writer: at least 1, not with --node, and it must divide --trainers and --writers")
    chunks = [list(range(0, a.writers, a.per_writer))[p::n] for p in range(n)]
    procs = [ctx.Process(target=_host, args=(str(run), p, chunks[p], a, go, done, flushed, cost_ns, paused,
                                                    appended, plan))
             for p in range(n)]
    t0 = time.monotonic()
    for proc in procs:
        proc.start()
    at = [a.steps * (k + 1) // (a.reads + 1) for k in range(a.reads)]
    peak: dict[str, list[int]] = {t: [0] * 5 for t in TABLES}
    reads, samples, last = [], 0, 0.0
    while any(proc.is_alive() for proc in procs) and min(done) < a.steps:
        if time.monotonic() - last > 2 and (run / MARKER).exists():
            for t, got in _sample(run).items():
                peak[t] = [max(x, y) for x, y in zip(peak[t], got, strict=True)]
            samples, last = samples + 1, time.monotonic()
        if at and min(done) >= at[0]:
            go.clear()
            wait = time.monotonic() + 60
            while not all(paused[p] or done[p] == a.steps for p in range(n)) and time.monotonic() < wait:
                time.sleep(0.05)  # every host between two steps
            for proc in procs:
                os.kill(proc.pid, signal.SIGSTOP)
            lo = sum(flushed)
            try:
                got, before = [], []
                for r in range(a.rounds):  # the arms alternate, and which goes first
                    arms = [(got, None)] + ([(before, {"PYTHONPATH": str(a.baseline)})] if a.baseline else [])
                    for out, env in arms[::1 if r % 2 == 0 else -1]:
                        out += _open_count("dynascope", run, 1, env)
                rows, twice = (_open_count(arm, run, 1)[0]["rows"] for arm in ("live-all", "live-twice"))
                arms = [("", None)] + ([(" (baseline)", {"PYTHONPATH": str(a.baseline)})] if a.baseline else [])
                calls = _calls(a, run, spec.as_dict() if spec else {}, arms)
                files = _sample(run)
                if a.keep:
                    kept = a.keep / f"step-{at[0]}"
                    shutil.copytree(run, kept, symlinks=True, dirs_exist_ok=True)
                    if spec:  # what cluster_scale.py's calls read beside the run (row_groups.py, copies_ab.py)
                        (kept / "planted.json").write_text(json.dumps({"spec": spec.as_dict(), "planted": {}}))
                rest: dict = {}
                if a.at_rest and a.calls:  # the same rows at rest: what of each call's time is files, what rows
                    rested = _rested(run, base / "rest")
                    rest = {"files": _at_rest(rested), "timings": _open_count("dynascope", rested, 1)[0]["rows"]}
                    calls.update(_calls(a, rested, spec.as_dict() if spec else {}, [(" (at rest)", None)]))
                    shutil.rmtree(rested, ignore_errors=True)
            finally:
                for proc in procs:
                    os.kill(proc.pid, signal.SIGCONT)
            reads.append({"step": at.pop(0), "s": [x["s"] for x in got], "rss_mb": [x["rss_mb"] for x in got],
                          "timings": got[0]["rows"], "rows": rows, "flushed": lo, "twice": twice, "files": files,
                          "base_s": [x["s"] for x in before], "base_rss_mb": [x["rss_mb"] for x in before],
                          "base_timings": [x["rows"] for x in before], "calls": calls, "rest": rest})
            print(json.dumps(reads[-1]), flush=True)
            go.set()
        time.sleep(0.2)
    wall = time.monotonic() - t0
    for proc in procs:
        proc.join(timeout=900)
    closed = time.monotonic()
    total = sum(appended)
    rest = _at_rest(run)
    while max(rest.values()) > 4 and time.monotonic() - closed < 600:  # the run folds itself at close
        time.sleep(1)
        rest = _at_rest(run)
    rest_s = time.monotonic() - closed
    final = _open_count("dynascope", run, 1)[0]
    fallbacks = _open_count("live-fallback", run, 1)[0]["rows"]  # senders that wrote their own files
    res = {"node": a.node, "per_writer": a.per_writer, "fallbacks": fallbacks, "writers": a.writers, "steps": a.steps, "seal_s": a.seal_s, "flush_s": a.flush_s, "wall_s": wall,
           "samples": samples, "peak": peak, "reads": reads, "append_us": [c / 1e3 for c in cost_ns],
           "at_rest": rest, "rest_s": rest_s, "rows": final["rows"], "expected": total}
    print(json.dumps(res))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    bad = [r for r in reads if r["rows"] < r["flushed"] or r["twice"] or any(b != r["timings"] for b in r["base_timings"])
           or r["rest"].get("timings", r["timings"]) != r["timings"]]
    print(f"\n{a.writers} ranks, {a.writers // a.per_writer} writers × {a.steps} steps, {wall:.0f} s of writing, {samples} samples")
    for t, (files, journals, live, all_files, all_journals) in peak.items():
        print(f"  {t}: most per writer: {files} Parquet files and {journals} journals on disk, {live} live segments;"
              f" most in all: {all_files:,} Parquet files, {all_journals:,} journals")
    for r in reads:
        print(f"  step {r['step']}: files {r['files']['timings']}; open + count {statistics.median(r['s']):.2f} s ({min(r['s']):.2f}–{max(r['s']):.2f}),"
              f" {statistics.median(r['rss_mb']):.0f} MB; {r['timings']:,} timings rows; all tables {r['rows']:,}"
              f" (flushed before: {r['flushed']:,}); read twice: {r['twice']}")
        if r["rest"]:
            print(f"    at rest (a compacted copy): files {r['rest']['files']}, {r['rest']['timings']:,} timings rows")
        for name, runs in r["calls"].items():
            secs = [x["s"] for x in runs]
            print(f"    {name}: {statistics.median(secs):.2f} s ({min(secs):.2f}–{max(secs):.2f}) open + call,"
                  f" {statistics.median([x['rss_mb'] for x in runs]):.0f} MB")
        if r["base_s"]:
            b = r["base_s"]
            print(f"    baseline: {statistics.median(b):.2f} s ({min(b):.2f}–{max(b):.2f}),"
                  f" {statistics.median(r['base_rss_mb']):.0f} MB; ratio {statistics.median(r['s']) / statistics.median(b):.2f}")
    print(f"  append: {statistics.median(res['append_us']):.1f} µs (processes' medians"
          + (f"; a writer's {a.per_writer} appends a step)" if a.per_writer > 1 else ")"))
    print(f"  at rest {rest_s:.0f} s after the last close: {rest}; rows {final['rows']:,} of {total:,}")
    if a.node > 1:
        print(f"  {a.node} ranks a node writer: {fallbacks} senders fell back to their own files")
    if a.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    if bad or final["rows"] != total:
        raise SystemExit(f"rows wrong: {bad or (final['rows'], total)}")


if __name__ == "__main__":
    main()
