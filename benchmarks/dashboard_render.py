"""First render of each dashboard page over a large run, in a real browser, against a naive baseline.

Builds (once, cached in --dir) a run with --rows tensor_stats rows written straight into the store layout
with pyarrow (plus spectra, 8 ranks of timings, samples, scalars and events), starts the real dashboard
server, and times each page in headless Chromium from navigation until the script has finished and every
plotly chart has drawn: on its first visit inside the app (a sidebar click, cold query cache), and in a new
tab, both in a browser that never saw the app and in one that did. The peer column times the naive way to
feed the heat maps: pull the needed tensor_stats columns into polars and aggregate there. The floor rows
(``streamlit_floor.py``) time trivial Streamlit apps the same way: what the framework costs before any data.
Goal: every page < 2 s on 10M rows with 2 cores.

    python3 benchmarks/dashboard_render.py            # 10M rows (builds ~1 GB once)
    python3 benchmarks/dashboard_render.py --quick    # 300k rows, < 1 minute
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dashboard_run import build  # benchmarks/ is on sys.path when run as a script
from screenshots import CHROMIUM, wait_rendered
from streamlit_floor import VIEWPORT, floor

from dynascope.dashboard.serve import serving
from dynascope.store import open_store

PAGES = [("runs", ""), ("dynamics", "dynamics"), ("cluster", "cluster"), ("rollouts", "rollouts"),
         ("events", "events"), ("sql", "sql")]


def render(context, url: str) -> tuple[float, int, int]:
    """Seconds from navigation in a new tab of ``context`` until the page is fully drawn; charts; exception
    blocks shown. ``context`` is a Playwright browser context (its cache is what a new tab shares)."""
    page = context.new_page()
    try:
        t = time.perf_counter()
        page.goto(url)
        charts = wait_rendered(page)
        return time.perf_counter() - t, charts, page.locator('[data-testid="stException"]').count()
    finally:
        page.close()


def render_cold(browser, url: str) -> tuple[float, int, int]:
    """``render`` in a new browser context: no HTTP or compiled-code cache, as on a first visit to the server."""
    context = browser.new_context(viewport=VIEWPORT)
    try:
        return render(context, url)
    finally:
        context.close()


HEADERS = {"runs": "Runs", "dynamics": "Parameter dynamics", "cluster": "Cluster", "rollouts": "Rollouts",
           "events": "Events", "sql": "SQL"}
NAV_TITLES = {"runs": "Runs", "dynamics": "Parameter dynamics", "cluster": "Cluster", "rollouts": "Rollouts",
              "events": "Events", "sql": "SQL"}


def navigate_all(browser, base: str) -> list[tuple[float, int, int]]:
    """How a user meets each page: open the app once (Runs), then click each page in the sidebar for the
    first time. Each click is timed until that page's script finished and its charts drew; its queries are
    cold (a fresh server), the JavaScript is already loaded (one app, one tab)."""
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    out = []
    try:
        t = time.perf_counter()
        page.goto(f"{base}/")
        charts = wait_rendered(page)
        out.append((time.perf_counter() - t, charts, page.locator('[data-testid="stException"]').count()))
        for name, _ in PAGES[1:]:
            t = time.perf_counter()
            page.locator('[data-testid="stSidebarNav"] a', has_text=NAV_TITLES[name]).first.click()
            # The new page's header exists only once its own script run began; READY then waits for the end.
            page.wait_for_function(
                "h => [...document.querySelectorAll('h2')].some(e => e.textContent.trim().startsWith(h))",
                arg=HEADERS[name], polling=20, timeout=300_000)
            charts = wait_rendered(page)
            out.append((time.perf_counter() - t, charts, page.locator('[data-testid="stException"]').count()))
    finally:
        context.close()
    return out


def naive_heatmap(path: Path) -> float:
    """The peer: pull the heat map's columns for every row into polars and aggregate there."""
    import polars as pl

    with open_store(path) as store:
        t = time.perf_counter()
        df = store.sql("SELECT layer, step, update_norm, w_norm, changed_count, numel FROM tensor_stats").pl()
        df.group_by("layer", (pl.col("step") // max(1, int(df["step"].max()) // 400)).alias("b")).agg(
            ((pl.col("update_norm") ** 2).sum().sqrt() / (pl.col("w_norm") ** 2).sum().sqrt()).alias("ratio"),
            (pl.col("changed_count").sum() / pl.col("numel").sum()).alias("changed"))
        return time.perf_counter() - t


def time_queries(run: Path, skip_on_demand: bool = False) -> list[tuple[str, float, int]]:
    """Server-side cost of each query or analysis the pages issue at first render (no Streamlit, no cache)."""
    import dynascope.analyses as A
    from dynascope.dashboard.queries import cluster, params, rollouts, runs

    rid = run.name
    calls = [
        ("runs: catalog", lambda s: runs.run_list(s)), ("runs: rows per table", lambda s: runs.table_rows(s, (rid,))),
        ("runs: scalar series", lambda s: runs.scalar_series(s, (rid,), "loss")),
        ("dynamics: parameter cube", lambda s: params.param_cube(s, rid)),
        ("dynamics: spectra series", lambda s: params.spectra_series(s, (rid,), ("q", "k", "v", "o", "mlp"))),
        ("dynamics: rank1_linear_fit (on demand)", lambda s: A.rank1_linear_fit(s, run=rid)),
        ("cluster: gantt window", lambda s: cluster.gantt(s, rid, 1, 3)),
        ("cluster: phase breakdown", lambda s: cluster.phase_breakdown(s, rid)),
        ("cluster: step stragglers", lambda s: cluster.straggler_table(s, rid)),
        ("cluster: throughput", lambda s: cluster.throughput(s, rid)),
        ("cluster: straggler_scores (on demand)", lambda s: A.straggler_scores(s, run=rid)),
        ("cluster: what_if (on demand)", lambda s: A.what_if(s, run=rid)),
        ("cluster: schedule_what_if (on demand)", lambda s: A.schedule_what_if(s, run=rid)),
        ("rollouts: rollout_long_tail", lambda s: A.rollout_long_tail(s, run=rid)),
        ("rollouts: tail_wait_share", lambda s: A.tail_wait_share(s, run=rid)),
        ("rollouts: rewards", lambda s: rollouts.rewards(s, (rid,))),
        ("events: events", lambda s: runs.events(s, (rid,))),
        ("events: detect_instability (on demand)", lambda s: A.detect_instability(s, run=rid)),
    ]
    out = []
    with open_store(run) as store:
        for name, fn in calls:
            if skip_on_demand and "on demand" in name:
                continue
            t = time.perf_counter()
            try:
                rows = getattr(fn(store), "height", -1)
            except Exception as exc:  # an analysis in flux must not hide the other timings
                print(f"{name}: {type(exc).__name__}: {exc}")
                rows = -1
            out.append((name, time.perf_counter() - t, rows))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--quick", action="store_true",
                    help="300k rows, one visit per page, no on-demand analyses: a smoke run in about a minute")
    ap.add_argument("--dir", type=Path, default=Path("runs/bench-dashboard"))
    ap.add_argument("--target-s", type=float, default=2.0)
    ap.add_argument("--build-only", action="store_true", help="build the run and stop")
    ap.add_argument("--no-query-table", action="store_true", help="skip the per-query server-side timings")
    args = ap.parse_args()
    rows = 300_000 if args.quick else args.rows
    run = args.dir / f"rows-{rows}"
    meta = run / "bench.json"
    layout = 3  # bump when the build changes (2: the writer's encodings and the by_kind rollup; 3: by_layer)
    if not meta.exists() or json.loads(meta.read_text()).get("layout") != layout:
        import shutil

        shutil.rmtree(run, ignore_errors=True)
        t = time.perf_counter()
        counts = build(run, rows)
        meta.write_text(json.dumps({**counts, "layout": layout}))
        print(f"built {run} in {time.perf_counter() - t:.1f} s: {counts}")
    counts = {k: v for k, v in json.loads(meta.read_text()).items() if k != "layout"}
    if args.build_only:
        return
    import os

    print(f"run: {run} — " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))
    print(f"cores available to this process: {len(os.sched_getaffinity(0))}; load average {os.getloadavg()}")

    from playwright.sync_api import sync_playwright

    results, nav, floors = [], [], {}
    launch = {"executable_path": CHROMIUM, "headless": True,
              "args": ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]}
    if not Path(CHROMIUM).exists():
        print(f"{CHROMIUM} is missing: browser timings skipped, server-side timings only")
    else:
        with sync_playwright() as p:
            browser = p.chromium.launch(**launch)
            # 1. In one tab, as a user does: each page's first visit by a sidebar click, on a fresh server.
            with serving(run, log=args.dir / "streamlit.log") as base:
                render_cold(browser, f"{base}/sql")  # the server process's own start-up (imports), not the queries
                nav = navigate_all(browser, base)
            # 2. Each page opened in a new tab (a bookmark, a reload): first in a browser that never saw the
            #    app (its queries cold too), then in one that has loaded the app before (cached JavaScript,
            #    cached queries): the best a new tab can do.
            with serving(run, log=args.dir / "streamlit.log") as base:
                render_cold(browser, f"{base}/sql")
                seen = browser.new_context(viewport=VIEWPORT)
                for _ in range(2):  # V8 caches compiled code from a script's second load on
                    render(seen, f"{base}/sql")
                for name, url in PAGES:
                    cold = render_cold(browser, f"{base}/{url}")
                    warm = cold if args.quick else render(seen, f"{base}/{url}")  # quick: one visit per page
                    results.append((name, cold, warm))
                seen.close()
            # 3. The framework's own floor, same browser, same server options: trivial Streamlit apps.
            floors = floor(browser)
            browser.close()
    peer = naive_heatmap(run)
    print(f"\n{'page':<10} {'charts':>6} {'first, in app s':>16} {'new tab, cold s':>16} {'new tab, warm s':>16} "
          f"{'target s':>9} {'in app/target':>14} {'naive heat-map feed s':>22}")
    for (name, (cold_s, charts, exc), (warm_s, _, _)), (nav_s, _, nav_exc) in zip(results, nav, strict=True):
        flag = "" if exc == 0 and nav_exc == 0 else f"  ({exc + nav_exc} exception blocks!)"
        print(f"{name:<10} {charts:>6} {nav_s:>16.2f} {cold_s:>16.2f} {warm_s:>16.2f} {args.target_s:>9.1f} "
              f"{nav_s / args.target_s:>14.2f} {peer:>22.2f}{flag}")
    for app, (cold_s, warm_s) in floors.items():
        print(f"{'floor: ' + app:<17} {'':>16} {cold_s:>16.2f} {warm_s:>16.2f}   (a trivial Streamlit app)")
    print("\nin app: the Runs row is the app's first load in a new tab (JavaScript included); every other row is "
          "a sidebar click to a page not yet visited, queries uncached. New tab, cold: a browser that never saw "
          "the app, queries uncached; warm: a browser that loaded the app before, queries cached. The floor rows "
          "are Streamlit itself drawing a header (empty) or one 3-point plotly chart, timed the same way.")
    print(f"\n{'server-side query (uncached)':<42} {'s':>7} {'rows out':>10}")
    for name, secs, n in ([] if args.no_query_table else time_queries(run, skip_on_demand=args.quick)):
        print(f"{name:<42} {secs:>7.2f} {n:>10,}")
    print(f"\nnaive peer: SELECT the heat map's 6 columns of all {counts['tensor_stats']:,} tensor_stats rows "
          "into polars, then group there (what a dashboard without push-down does for one chart).")


if __name__ == "__main__":
    sys.exit(main())
