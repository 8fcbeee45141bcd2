"""How the store, the analyses, the report and the dashboard scale with ranks: 8 to 1,024 ranks × 500 steps.

For each size, a synthetic run (``cluster_run.py``: trainers plus rollout workers, FSDP shards, planted
faults) written through the real RunWriter, one writer per rank; then:

1. as written: files, bytes and rows per table, and a fresh process opening the store and counting the
   timing rows (what every query pays to list and open the segments);
2. ``dynascope compact`` (a child process, timed, peak RSS), then the same census: a finished run's
   writers are folded together, so a table keeps its schema file plus one file per 4M rows;
3. each analysis, the report and the dashboard's server-side queries, each call in a fresh process (open
   time, call time, peak RSS from ``wait4``), ``--rounds`` rounds taken round-robin, medians and spreads;
4. with ``--dashboard``: each page's first visit in the app (a sidebar click on a fresh server, as in
   ``dashboard_render.py``), and the server's peak RSS.

Steps 1-2 run once per size and are kept in ``<run>/scale.json``; re-running measures step 3 (and 4) again,
so a change to an analysis is re-measured with ``python benchmarks/cluster_scale.py`` alone. Analyses are
called by their public names (``dynascope.analyses.<name>``); one that fails or is renamed is reported, the
others still run. The table goes to stdout and, with ``--doc``, between the markers of docs/scale.md.

    flock /tmp/dynascope-bench.lock python benchmarks/cluster_scale.py --ranks 8 64 256 1024 --rounds 3 --doc
    python benchmarks/cluster_scale.py --ranks 256 --rounds 5 --only idle_time --baseline ../dynascope-before

The second times each call against another checkout's code on the same files, alternating round by round,
and prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cluster_run import census  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

REPO = Path(__file__).resolve().parents[1]
GOALS = {"report": 15.0, "analysis": 3.0, "page": 4.0, "rss_mb": 4096.0}
# name -> code run in the child with ``A`` (dynascope.analyses), ``store`` (open), ``run`` (its path), ``SPEC``
# (the run's synthetic.ClusterSpec as a dict) and ``PLANTED`` (its planted faults).
CALLS = {
    "open + count(timings)": "store.rows('SELECT count(*) FROM timings')",
    "straggler_scores": "A.straggler_scores(store)",
    "what_if": "A.what_if(store)",
    # two trainer ranks per device, so the shared-device replay runs (one rank per device is what_if_steps)
    "what_if_shared": "A.what_if_shared(store, devices=max(1, SPEC['ranks'] // 2))",
    "schedule_what_if": "A.schedule_what_if(store)",
    "cluster_outliers": "A.cluster_outliers(store)",
    # the report prices each slow node it names: one host's replay (every host is one replay each)
    "what_if_node": "A.what_if_node(store, hosts=[PLANTED.get('slow_node', {}).get('host', 'node-0000')])",
    "step_breakdown": "A.step_breakdown(store)",
    "idle_time": "A.idle_time(store)",
    "critical_path": "A.critical_path(store)",
    "phase_shares": "A.phase_shares(store)",
    "rollout_long_tail": "A.rollout_long_tail(store)",
    "tail_wait_share": "A.tail_wait_share(store)",
    "delta_sync_summary": "A.delta_sync_summary(store)",
    "sparsity_over_training": "A.sparsity_over_training(store)",
    "sparsity_over_training (reference)": "A.sparsity_over_training(store, against='reference')",
    "dashboard: param_cube": "__import__('dynascope.dashboard.queries.params', fromlist=['x']).param_cube(store, run.name)",
    "dashboard: cluster straggler_table":
        "__import__('dynascope.dashboard.queries.cluster', fromlist=['x']).straggler_table(store, run.name)",
    "catalog (dynascope runs)": "__import__('dynascope.store.catalog', fromlist=['x']).list_runs(run)",
}
REPORT = "dynascope report"
PAGES = ["runs", "dynamics", "cluster", "rollouts", "events", "sql"]
NOT_TABLES = ("(other)", "(commits)")  # census rows that are no table: heartbeats, markers; commit records
DOC_BEGIN, DOC_END = "<!-- cluster_scale: begin -->", "<!-- cluster_scale: end -->"


def child(name: str, run: str) -> None:
    """Runs in a fresh process: one call, its timings as a JSON line on stdout."""
    t0 = time.perf_counter()
    import dynascope.analyses as A  # noqa: F401,N812  (used by the code in CALLS)
    from dynascope.store import open_store

    t1 = time.perf_counter()
    store = open_store(run)
    t2 = time.perf_counter()
    planted = json.loads((Path(run) / "planted.json").read_text())
    out = eval(CALLS[name], {"A": A, "store": store, "run": Path(run), "SPEC": planted["spec"],  # noqa: S307 - our own table
                             "PLANTED": planted["planted"]})
    t3 = time.perf_counter()
    rows = getattr(out, "height", None) or (len(out) if isinstance(out, list) else None)
    print(json.dumps({"import_s": t1 - t0, "open_s": t2 - t1, "call_s": t3 - t2, "rows": rows}))


# address space of each child: twice the goal, so one call cannot take the shared machine down (--mem-limit-gb)
LIMITS = {"mem_gb": 8.0}


def _limit_memory() -> None:
    limit = int(LIMITS["mem_gb"] * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def measure(cmd: list[str], timeout_s: float, code: Path = REPO) -> dict:
    """Run ``cmd`` with the dynascope of ``code`` (its address space capped at ``LIMITS["mem_gb"]``); wall
    seconds, peak RSS (MB, from wait4) and its JSON line, or the error."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryFile() as fout, tempfile.TemporaryFile() as ferr:  # files: a full pipe would stall it
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=fout, stderr=ferr, cwd=REPO, env={**os.environ, "PYTHONPATH": str(code)},
                                preexec_fn=_limit_memory)
        deadline = time.monotonic() + timeout_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                _, status, usage = os.wait4(proc.pid, 0)
                return {"error": f"timeout after {timeout_s:.0f} s", "wall_s": timeout_s,
                        "rss_mb": usage.ru_maxrss / 1024}
            time.sleep(0.02)
        wall = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        fout.seek(0)
        ferr.seek(0)
        out, err = fout.read().decode(errors="replace"), ferr.read().decode(errors="replace")
    res = {"wall_s": wall, "rss_mb": usage.ru_maxrss / 1024, "load": load}
    if os.waitstatus_to_exitcode(status) != 0:
        res["error"] = (err.strip().splitlines() or ["exit " + str(status)])[-1][:200]
        return res
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if lines:
        res.update(json.loads(lines[-1]))
    return res


def prepare(run: Path, ranks: int, steps: int, timeout_s: float) -> dict:
    """Generate (if missing), census as written, compact, census again: once per run, kept in scale.json."""
    meta = run / "scale.json"
    if meta.exists():
        return json.loads(meta.read_text())
    if not (run / "planted.json").exists():
        print(f"generating {run} ...", flush=True)
        subprocess.run([sys.executable, str(REPO / "benchmarks/cluster_run.py"), str(run), "--ranks", str(ranks),
                        "--steps", str(steps)], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    planted = json.loads((run / "planted.json").read_text())
    out: dict = {"generate_s": planted["generate_s"], "processes": planted["processes"],
                 "writers": planted["spec"]["ranks"] + planted["spec"]["rollout_workers"], "raw": census(run)}
    print(f"{run.name}: measuring the run as written ...", flush=True)
    out["raw_count"] = measure([sys.executable, __file__, "--child", "open + count(timings)", str(run)], timeout_s)
    code = ("import json,time; from dynascope.store.compact import compact_store as c; t=time.perf_counter(); "
            f"s=c({str(run)!r}, grace_s=1.0, wait=True); "
            "print(json.dumps({'call_s': time.perf_counter()-t, 'merged': s.merged_segments, "
            "'folded': s.writers_folded, 'new': s.new_segments, 'removed': s.removed_segments, 'skipped': s.skipped}))")
    rows = footer_rows(run)  # as written; the views' count of a raw store takes GBs (see raw_count)
    print(f"{run.name}: compacting ...", flush=True)
    out["compact"] = measure([sys.executable, "-c", code], max(4 * timeout_s, 6 * 3600))
    out["compacted"] = census(run)
    # Exact, as every engine reads it: the files ``live_files`` hands another engine before and after, and the
    # views' counts after.
    out["rows_exact"] = {"raw": rows, "compacted": rows_per_table(run), "live_files": footer_rows(run)}
    if not rows == out["rows_exact"]["compacted"] == out["rows_exact"]["live_files"]:
        raise SystemExit(f"{run.name}: rows differ across compaction or engines: {out['rows_exact']}")
    meta.write_text(json.dumps(out, indent=1))
    return out


def rows_per_table(run: Path) -> dict[str, int]:
    from dynascope.store import open_store
    from dynascope.store.schema import TABLES

    with open_store(run) as s:
        return {t: s.rows(f"SELECT count(*) FROM {t}")[0][0] for t in TABLES}


def footer_rows(run: Path) -> dict[str, int]:
    """Rows per table in the files ``live_files`` hands another engine (Spark, Trino), from their footers."""
    import pyarrow.parquet as pq

    from dynascope.store import live_files
    from dynascope.store.schema import TABLES

    return {t: sum(pq.ParquetFile(f).metadata.num_rows for f in live_files(run, t)) for t in TABLES}


def pages(run: Path, rounds: int) -> dict[str, list]:
    """Each page's first visit in the app on a fresh server, ``rounds`` times; and the server's peak RSS."""
    import psutil
    from dashboard_render import CHROMIUM, navigate_all
    from playwright.sync_api import sync_playwright

    from dynascope.dashboard.serve import serving

    out: dict[str, list] = {p: [] for p in PAGES} | {"server rss_mb": []}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        for _ in range(rounds):
            with serving(run, log=run.parent / "streamlit.log") as base:
                for name, (secs, _, exc) in zip(PAGES, navigate_all(browser, base), strict=True):
                    out[name].append(secs if exc == 0 else None)
                out["server rss_mb"].append(_server_peak_mb(psutil))
        browser.close()
    return out


def _server_peak_mb(psutil) -> float:
    """Peak RSS (VmHWM) of the dashboard server among this process's children."""
    peak = 0
    for c in psutil.Process().children(recursive=True):
        try:
            if "dynascope.dashboard" not in " ".join(c.cmdline()):
                continue
            status = Path(f"/proc/{c.pid}/status").read_text()
        except (psutil.Error, OSError):  # exited meanwhile, or a zombie
            continue
        peak = max([peak, *(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmHWM"))])
    return peak / 1024


def summary(values: list[float]) -> str:
    if not values:
        return "—"
    med = statistics.median(values)
    return f"{med:.2f} ({min(values):.2f}–{max(values):.2f})" if len(values) > 1 else f"{med:.2f}"


def fit(sizes: list[int], secs: list[float]) -> str:
    """Exponent b of time ∝ ranks^b between the two largest sizes (fixed costs dominate the small ones)."""
    import math

    pts = [(r, s) for r, s in zip(sizes, secs, strict=True) if s and s > 0]
    if len(pts) < 2:
        return "—"
    (r1, s1), (r2, s2) = pts[-2], pts[-1]
    return f"{math.log(s2 / s1) / math.log(r2 / r1):.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=REPO / "runs/cluster-scale")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per call before it counts as failed")
    ap.add_argument("--mem-limit-gb", type=float, default=LIMITS["mem_gb"], help="address space per call (it fails above)")
    ap.add_argument("--only", nargs="*", help="measure only these calls (names as in the table)")
    ap.add_argument("--baseline", type=Path, help="another checkout of dynascope: each call also runs with its code, "
                    "alternating, and the ratios are printed (nothing saved)")
    ap.add_argument("--dashboard", action="store_true", help="also time each dashboard page's first visit")
    ap.add_argument("--doc", nargs="?", const=REPO / "docs/scale.md", type=Path, help="write the tables into this file")
    ap.add_argument("--tables-only", action="store_true", help="print (and --doc) the tables of the saved results")
    ap.add_argument("--prepare-only", action="store_true",
                    help="generate, census and compact the runs (kept in each run's scale.json), measure no call")
    ap.add_argument("--child", nargs=2, metavar=("CALL", "RUN"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)
    LIMITS["mem_gb"] = args.mem_limit_gb
    calls = [c for c in [*CALLS, REPORT] if not args.only or c in args.only]
    print(f"cores {len(os.sched_getaffinity(0))}, load average {os.getloadavg()}", flush=True)
    for ranks in [] if args.tables_only else args.ranks:
        run = args.dir / f"r{ranks}-s{args.steps}"
        prep = prepare(run, ranks, args.steps, args.timeout)
        if args.prepare_only:
            continue
        res: dict = {"prep": prep, "rows": rows_per_table(run), "calls": {c: [] for c in calls}}
        arms = [("", REPO)] + ([(" (baseline)", args.baseline.resolve())] if args.baseline else [])
        for i in range(args.rounds):
            for name in calls if i % 2 == 0 else reversed(calls):
                cmd = ([sys.executable, "-c", "from dynascope.cli import app; app()", "report", str(run)] if name == REPORT else
                       [sys.executable, __file__, "--child", name, str(run)])
                for tag, code in arms if i % 2 == 0 else reversed(arms):
                    r = measure(cmd, args.timeout, code)
                    res["calls"].setdefault(name + tag, []).append(r)
                    took = r.get("call_s", r["wall_s"])
                    print(f"r{ranks} round {i} {name}{tag}: {took:.2f} s, {r['rss_mb']:.0f} MB" +
                          (f"  ERROR {r['error']}" if "error" in r else ""), flush=True)
        if args.baseline:
            _ratios(res["calls"], calls)
            continue  # the tables hold this checkout's figures only
        _save(args.dir, ranks, res)
        if args.dashboard:
            res["pages"] = pages(run, args.rounds)
            _save(args.dir, ranks, res)
    if args.prepare_only or not _load(args.dir):
        return
    text = tables(_load(args.dir), calls)
    print(text)
    print(f"load average after: {os.getloadavg()}")
    if args.doc:
        doc = args.doc.read_text() if args.doc.exists() else f"{DOC_BEGIN}\n{DOC_END}\n"
        head, rest = doc.split(DOC_BEGIN, 1)
        args.doc.write_text(f"{head}{DOC_BEGIN}\n{text}\n{DOC_END}{rest.split(DOC_END, 1)[1]}")


def _ratios(got: dict, calls: list[str]) -> None:
    """Each call against the baseline's: medians (min–max) of the call alone, peak MB, and the ratio."""
    def call_s(rs: list[dict]) -> list[float]:
        return [r.get("call_s", r["wall_s"]) for r in rs if "error" not in r]

    for name in calls:
        new, old = call_s(got[name]), call_s(got[name + " (baseline)"])
        if new and old:
            mb = [max(r["rss_mb"] for r in got[n]) for n in (name, name + " (baseline)")]
            print(f"{name}: {statistics.median(new):.2f} s ({min(new):.2f}–{max(new):.2f}), {mb[0]:.0f} MB; "
                  f"baseline {statistics.median(old):.2f} s ({min(old):.2f}–{max(old):.2f}), {mb[1]:.0f} MB; "
                  f"ratio {statistics.median(new) / statistics.median(old):.2f}")


def _save(d: Path, ranks: int, res: dict) -> None:
    """Keep ``res`` for ``ranks``; dashboard timings from an earlier run stay unless measured again."""
    old = _load(d).get(str(ranks), {})
    res = {**({"pages": old["pages"]} if "pages" in old else {}), **res}
    (d / "scale-results.json").write_text(json.dumps({**_load(d), str(ranks): res}, indent=1))


def _load(d: Path) -> dict:
    f = d / "scale-results.json"
    return json.loads(f.read_text()) if f.exists() else {}


def tables(all_results: dict, calls: list[str]) -> str:
    """The markdown tables: the store per size, then each call's seconds and peak RSS per size."""
    sizes = sorted(int(k) for k in all_results)
    res = [all_results[str(k)] for k in sizes]
    lines = ["| ranks (trainers + rollout) | rows | table files as written | commit records as written → compacted | "
             "bytes as written | generation s | "
             "open + count as written: s (peak MB) | compact s (peak MB) | table files compacted | largest table's "
             "files | bytes compacted | load during the calls |", "|---" * 12 + "|"]
    for k, r in zip(sizes, res, strict=True):
        p = r["prep"]
        raw_files = sum(c["files"] for t, c in p["raw"].items() if t not in NOT_TABLES)
        files = sum(c["files"] for t, c in p["compacted"].items() if t not in NOT_TABLES)
        most = max(c["files"] for t, c in p["compacted"].items() if t not in NOT_TABLES)
        # a run written before commit records existed has none: "—"
        commits = " → ".join(f"{p[k].get('(commits)', {'files': 0})['files']:,}" if "(commits)" in p["raw"] else "—"
                             for k in ("raw", "compacted"))
        rc = p["raw_count"]
        why = "out of memory" if "memory" in rc.get("error", "").lower() else rc.get("error", "")[-60:]
        raw = (f"failed after {rc['wall_s']:.0f} s: {why} ({rc['rss_mb']:.0f})"
               if "error" in rc else f"{rc.get('open_s', 0) + rc.get('call_s', 0):.1f} ({rc['rss_mb']:.0f})")
        loads = [x["load"] for xs in r["calls"].values() for x in xs if "load" in x]
        load = f"{min(loads):.1f}–{max(loads):.1f}" if loads else "—"
        lines.append(
            f"| {k} + {p['writers'] - k} | {sum(r['rows'].values()):,} | {raw_files:,} | "
            f"{commits} | "
            f"{sum(c['bytes'] for c in p['raw'].values()) / 1e9:.2f} GB | {p['generate_s']:.0f} | {raw} | "
            f"{p['compact'].get('call_s', p['compact']['wall_s']):.0f} ({p['compact']['rss_mb']:.0f}) | {files:,} | {most} | "
            f"{sum(c['bytes'] for c in p['compacted'].values()) / 1e9:.2f} GB | {load} |")
    big, bp = sizes[-1], res[-1]["prep"]
    lines += ["", f"Files per table at {big} ranks: as written (one directory per writer per table, one segment per "
              "flush) and after `dynascope compact`.", "",
              "| table | rows | writer dirs as written | files as written | files compacted | MB compacted |",
              "|---|---|---|---|---|---|"]
    for t, c in bp["raw"].items():
        after = bp["compacted"].get(t, {"files": 0, "bytes": 0})
        lines.append(f"| {t} | {res[-1]['rows'].get(t, 0):,} | {c['writer_dirs']:,} | {c['files']:,} | "
                     f"{after['files']:,} | {after['bytes'] / 1e6:.1f} |")
    lines += ["", "Seconds of the call itself (open excluded; the report: the whole command), median (min–max) of "
              "the rounds, and peak RSS of its process in MB (median). Goal at 1,024 ranks: analysis < 3 s, report "
              "< 15 s, < 4 GB.", "",
              "| call | " + " | ".join(f"{k} ranks s" for k in sizes) + " | " + " | ".join(f"{k} MB" for k in sizes)
              + " | growth exponent (last two sizes) | over its goal from |", "|---" * (2 * len(sizes) + 3) + "|"]
    for c in calls:
        secs, mbs, meds, over = [], [], [], "—"
        goal = GOALS["report"] if c == REPORT else GOALS["analysis"]
        for k, r in zip(sizes, res, strict=True):
            runs = [x for x in r["calls"].get(c, []) if "error" not in x]
            errs = [x["error"] for x in r["calls"].get(c, []) if "error" in x]
            vals = [x.get("call_s", x["wall_s"]) if c != REPORT else x["wall_s"] for x in runs]
            secs.append(summary(vals) if vals else (f"error: {errs[0][:60]}" if errs else "—"))
            mbs.append(f"{statistics.median([x['rss_mb'] for x in runs]):.0f}" if runs else "—")
            meds.append(statistics.median(vals) if vals else 0.0)
            rss = statistics.median([x["rss_mb"] for x in runs]) if runs else 0.0
            if over == "—" and (errs or meds[-1] > goal or rss > GOALS["rss_mb"]):
                over = f"{k} ranks" + (" (failed)" if errs and not runs else "")
        lines.append(f"| {c} | " + " | ".join(secs) + " | " + " | ".join(mbs) + f" | {fit(sizes, meds)} | {over} |")
    if any("pages" in r for r in res):
        lines += ["", "Dashboard: each page's first visit in the app (a sidebar click on a fresh server), seconds; "
                  "goal < 4 s.", "", "| page | " + " | ".join(f"{k} ranks s" for k, r in zip(sizes, res, strict=True)
                                                          if "pages" in r) + " |",
                  "|---" * (1 + sum("pages" in r for r in res)) + "|"]
        for pg in [*PAGES, "server rss_mb"]:
            lines.append(f"| {pg} | " + " | ".join(summary([v for v in r["pages"][pg] if v is not None])
                                                   for r in res if "pages" in r) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
