"""First render of each dashboard page over a large run, in a real browser, against a naive baseline.

Builds (once, cached in --dir) a run with --rows tensor_stats rows written straight into the store layout
with pyarrow (plus spectra, 8 ranks of timings, samples, scalars and events), starts the real dashboard
server, and times each page in headless Chromium from navigation until the script has finished and every
plotly chart has drawn — each page in a fresh tab, first visit (cold query cache). The peer column times
the naive way to feed the heat maps: pull the needed tensor_stats columns into polars and aggregate there.
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

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from screenshots import CHROMIUM, wait_rendered  # benchmarks/ is on sys.path when run as a script

from dynascope.dashboard.server import serving
from dynascope.store import RunWriter, open_store
from dynascope.store._columns import parquet_options
from dynascope.store.layout import segment_name, writer_dir
from dynascope.store.rollup import ROLLUPS
from dynascope.store.schema import TABLES

LAYERS, RANKS, SPEC_DIM = 32, 8, 128
PER_LAYER = [("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v"),
             ("self_attn.o_proj", "o"), ("mlp.gate_proj", "mlp"), ("mlp.up_proj", "mlp"), ("mlp.down_proj", "mlp"),
             ("input_layernorm", "norm"), ("post_attention_layernorm", "norm")]
PAGES = [("runs", ""), ("dynamics", "dynamics"), ("cluster", "cluster"), ("rollouts", "rollouts"),
         ("events", "events"), ("sql", "sql")]
T0 = 1_750_000_000_000_000


# ---- building the run ---------------------------------------------------------------------------------
def _tensors() -> tuple[list[str], np.ndarray, list[str], np.ndarray]:
    names, layers, kinds, numel = ["model.embed_tokens.weight"], [-1], ["embed"], [32000 * 2048]
    for i in range(LAYERS):
        for suffix, kind in PER_LAYER:
            names.append(f"model.layers.{i}.{suffix}.weight")
            layers.append(i)
            kinds.append(kind)
            numel.append(2048 if kind == "norm" else 2048 * (5632 if kind == "mlp" else 2048))
    names += ["model.norm.weight", "lm_head.weight"]
    layers += [-1, -1]
    kinds += ["norm", "head"]
    numel += [2048, 32000 * 2048]
    return names, np.array(layers), kinds, np.array(numel, dtype=np.int64)


def _table(name: str, cols: dict) -> pa.Table:
    schema = TABLES[name]
    n = len(next(iter(cols.values())))
    arrays = []
    for f in schema:
        v = cols.get(f.name)
        arrays.append(pa.nulls(n, f.type) if v is None else pa.array(v, type=f.type) if not isinstance(v, pa.Array)
                      else v.cast(f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _write(run: Path, name: str, writer: str, seq: int, cols: dict) -> int:
    d = writer_dir(run, name, writer)
    d.mkdir(parents=True, exist_ok=True)
    t = _table(name, cols)
    # The writer's own encodings, and the rollups it keeps beside each tensor_stats segment.
    pq.write_table(t, d / segment_name(seq, seq), **parquet_options(t.schema))
    for rollup, roll in ROLLUPS.get(name, ()):
        rolled = roll(t)
        rd = writer_dir(run, rollup, writer)
        rd.mkdir(parents=True, exist_ok=True)
        pq.write_table(rolled, rd / segment_name(seq, seq), **parquet_options(rolled.schema))
    return t.num_rows


def _strings(idx: np.ndarray, values: list[str]) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(idx.astype(np.int32)), pa.array(values)).cast(pa.string())


def build(run: Path, rows: int) -> dict:
    """Write the run; returns row counts per table."""
    RunWriter(run, world_size=RANKS, run_name="bench-dashboard").close()  # marker, typed empty segments, runs row
    rng = np.random.default_rng(0)
    names, layer_of, kind_of, numel_of = _tensors()
    nt = len(names)
    steps = max(10, rows // nt)
    sft_end = steps // 5
    counts = {t: 0 for t in ("tensor_stats", "spectra", "timings", "samples", "scalars", "events")}
    chunk = max(1, 1_000_000 // nt)
    kinds_u = sorted(set(kind_of))
    kind_idx = np.array([kinds_u.index(k) for k in kind_of])
    for seq, s0 in enumerate(range(1, steps + 1, chunk)):
        st = np.arange(s0, min(steps + 1, s0 + chunk))
        step = np.repeat(st, nt)
        ti = np.tile(np.arange(nt), len(st))
        n = len(step)
        sft = step <= sft_end
        numel = numel_of[ti]
        w = np.sqrt(numel) * 0.02 * (1 + 1e-5 * step)
        noise = rng.random(n, dtype=np.float32).astype(np.float64)
        dw = w * np.where(sft, 1e-3, 1e-4) * (0.5 + noise)
        changed = np.where(sft, 0.9 + 0.1 * noise, 0.05 + 0.3 * noise)
        gzero = np.where(sft, 0.01 * noise, 0.2 + 0.4 * noise)
        drift = w * np.where(sft, 1e-3 * np.sqrt(step), 1e-3 * np.sqrt(sft_end) + 1e-4 * np.sqrt(np.maximum(step - sft_end, 0)))
        nan = np.where(rng.random(n) < 2e-6, 1, 0)
        counts["tensor_stats"] += _write(run, "tensor_stats", "bench-r0", seq, {
            "run_id": [run.name] * n, "rank": np.zeros(n, np.int32), "role": _strings(np.zeros(n), ["trainer"]),
            "step": step, "time_us": T0 + step * 1_000_000, "stage": _strings(np.where(sft, 0, 1), ["sft", "rl"]),
            "tensor": _strings(ti, names), "layer": np.where(layer_of[ti] < 0, None, layer_of[ti]).astype(object),
            "kind": _strings(kind_idx[ti], kinds_u), "dtype": _strings(np.zeros(n), ["bfloat16"]), "numel": numel,
            "w_norm": w, "dw_norm": dw, "update_ratio": dw / w, "changed_count": (changed * numel).astype(np.int64),
            "changed_frac": changed, "w_nan": np.zeros(n, np.int64), "w_inf": np.zeros(n, np.int64),
            "drift_norm": drift, "drift_ratio": drift / w, "grad_norm": dw * 40,
            "grad_zero_count": (gzero * numel).astype(np.int64), "grad_zero_frac": gzero,
            "grad_near_zero_count": (gzero * 1.3 * numel).astype(np.int64), "grad_near_zero_frac": gzero * 1.3,
            "grad_nan": nan, "grad_inf": np.zeros(n, np.int64),
        })
    _build_rest(run, rng, steps, sft_end, names, layer_of, kind_of, counts)
    return counts


def _build_rest(run: Path, rng, steps: int, sft_end: int, names, layer_of, kind_of, counts: dict) -> None:
    # spectra: every 100 steps, 2-D tensors, with 128-d singular vectors drifting slowly
    mats = [i for i, k in enumerate(kind_of) if k not in ("norm",)]
    rec = np.arange(100, steps + 1, 100) if steps >= 200 else np.arange(2, steps + 1, 2)
    u0 = rng.normal(size=(len(mats), SPEC_DIM)).astype(np.float32)
    rows = []
    for r in rec:
        u = u0 + 0.001 * r
        u = u / np.linalg.norm(u, axis=1, keepdims=True)
        for j, ti in enumerate(mats):
            s1 = 0.01 * r * (1 + 0.05 * rng.random())
            sig = [s1, s1 * 0.3, s1 * 0.1, s1 * 0.05]
            fro2 = float(np.square(sig).sum() * 1.04)  # ‖ΔW‖²_F, a little beyond the top 4
            rows.append((int(r), names[ti], None if layer_of[ti] < 0 else int(layer_of[ti]), kind_of[ti], sig,
                         sig[0] ** 2 / fro2, fro2 / sig[0] ** 2, u[j].tolist(), fro2 ** 0.5))
    cols = list(zip(*rows, strict=True))
    n = len(rows)
    counts["spectra"] += _write(run, "spectra", "bench-r0", 0, {
        "run_id": [run.name] * n, "rank": [0] * n, "step": cols[0], "stage": ["sft" if s <= sft_end else "rl"
                                                                          for s in cols[0]],
        "tensor": cols[1], "layer": cols[2], "kind": cols[3], "rows": [SPEC_DIM] * n, "cols": [SPEC_DIM] * n,
        "k": [4] * n, "dw_fro": cols[8], "sigma": cols[4],
        "rank1_energy": cols[5], "stable_rank": cols[6], "u1": cols[7], "v1": cols[7]})
    # timings: 8 ranks, a step row and 6 phases per step; rank 5 is 30 % slower in backward
    phases = [("rollout", "phase", 900.0), ("reward", "phase", 40.0), ("forward", "phase", 120.0),
              ("backward", "phase", 240.0), ("allreduce", "comm", 50.0), ("optimizer", "phase", 30.0)]
    for rank in range(RANKS):
        st = np.arange(1, steps + 1)
        durs = np.stack([np.full(steps, ms) * (1.3 if rank == 5 and p == "backward" else 1.0)
                         * (0.9 + 0.2 * rng.random(steps)) for p, _, ms in phases], 1) * 1000
        step_us = durs.sum(1) + 5000
        start = T0 + np.concatenate([[0], np.cumsum(step_us)[:-1]])
        offs = np.concatenate([np.zeros((steps, 1)), np.cumsum(durs, 1)[:, :-1]], 1)
        k = len(phases)
        cols = {"run_id": [run.name] * (steps * (k + 1)), "rank": np.full(steps * (k + 1), rank, np.int32),
                "step": np.concatenate([np.repeat(st, k), st]),
                "phase": [p for _ in range(steps) for p, _, _ in phases] + ["step"] * steps,
                "category": [c for _ in range(steps) for _, c, _ in phases] + ["step"] * steps,
                "start_us": np.concatenate([(start[:, None] + offs).ravel(), start]).astype(np.int64),
                "dur_us": np.concatenate([durs.ravel(), step_us]).astype(np.int64), "device": ["cpu"] * (steps * (k + 1))}
        counts["timings"] += _write(run, "timings", f"bench-r{rank}", 0, cols)
    per = 32
    st = np.repeat(np.arange(sft_end + 1, steps + 1), per)
    n = len(st)
    lens = np.minimum(4096, rng.lognormal(5, 0.8, n)).astype(np.int64)
    gstart = T0 + st * 1_000_000
    counts["samples"] += _write(run, "samples", "bench-r0", 0, {
        "run_id": [run.name] * n, "rank": np.zeros(n, np.int32), "step": st, "sample_id": np.arange(n),
        "group_id": np.arange(n) // 8, "prompt_len": np.full(n, 128), "response_len": lens,
        "reward": (rng.random(n) < 0.4).astype(float), "gen_start_us": gstart, "gen_end_us": gstart + lens * 200,
        "policy_version": st - rng.integers(0, 3, n), "trainer_version": st})
    keys = ["loss", "grad_norm", "lr", "reward_mean", "kl"]
    st = np.repeat(np.arange(1, steps + 1), len(keys))
    n = len(st)
    counts["scalars"] += _write(run, "scalars", "bench-r0", 0, {
        "run_id": [run.name] * n, "rank": np.zeros(n, np.int32), "step": st, "time_us": T0 + st * 1_000_000,
        "stage": np.where(st <= sft_end, "sft", "rl"), "key": keys * (n // len(keys)),
        "value": 2.0 * np.exp(-st / steps) + 0.05 * rng.random(n)})
    ev = [("checkpoint_save", s, "info") for s in range(0, steps, max(1, steps // 10))] + [("fault", steps // 2, "error"),
                                                                                          ("restart", steps // 2, "info")]
    counts["events"] += _write(run, "events", "bench-r0", 0, {
        "run_id": [run.name] * len(ev), "rank": [0] * len(ev), "step": [e[1] for e in ev],
        "time_us": [T0 + e[1] * 1_000_000 for e in ev], "kind": [e[0] for e in ev], "severity": [e[2] for e in ev],
        "message": [f"{e[0]} at step {e[1]}" for e in ev], "dur_us": [2_000_000 if e[0] == "checkpoint_save" else None
                                                                     for e in ev]})


# ---- measuring ----------------------------------------------------------------------------------------
def render(browser, url: str) -> tuple[float, int, int]:
    """Seconds from navigation until the page is fully drawn; charts; exception blocks shown."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        t = time.perf_counter()
        page.goto(url)
        charts = wait_rendered(page)
        return time.perf_counter() - t, charts, page.locator('[data-testid="stException"]').count()
    finally:
        page.close()


HEADERS = {"runs": "Runs", "dynamics": "Parameter dynamics", "cluster": "Cluster", "rollouts": "Rollouts",
           "events": "Events", "sql": "SQL"}
NAV_TITLES = {"runs": "Runs", "dynamics": "Parameter dynamics", "cluster": "Cluster", "rollouts": "Rollouts",
              "events": "Events", "sql": "SQL"}


def navigate_all(browser, base: str) -> list[tuple[float, int, int]]:
    """How a user meets each page: open the app once (Runs), then click each page in the sidebar for the
    first time. Each click is timed until that page's script finished and its charts drew; its queries are
    cold (a fresh server), the JavaScript is already loaded (one app, one tab)."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
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
        page.close()
    return out


def naive_heatmap(path: Path) -> float:
    """The peer: pull the heat map's columns for every row into polars and aggregate there."""
    import polars as pl

    with open_store(path) as store:
        t = time.perf_counter()
        df = store.sql("SELECT layer, step, dw_norm, w_norm, changed_count, numel FROM tensor_stats").pl()
        df.group_by("layer", (pl.col("step") // max(1, int(df["step"].max()) // 400)).alias("b")).agg(
            ((pl.col("dw_norm") ** 2).sum().sqrt() / (pl.col("w_norm") ** 2).sum().sqrt()).alias("ratio"),
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
        ("cluster: step stragglers", lambda s: cluster.straggler_fallback(s, rid)),
        ("cluster: throughput", lambda s: cluster.throughput_fallback(s, rid)),
        ("cluster: straggler_scores (on demand)", lambda s: A.straggler_scores(s, run=rid)),
        ("cluster: what_if (on demand)", lambda s: A.what_if(s, run=rid)),
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

    results, nav = [], []
    launch = {"executable_path": CHROMIUM, "headless": True,
              "args": ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]}
    if not Path(CHROMIUM).exists():
        print(f"{CHROMIUM} is missing: browser timings skipped, server-side timings only")
    else:
        with sync_playwright() as p:
            browser = p.chromium.launch(**launch)
            # 1. In one tab, as a user does: each page's first visit by a sidebar click, on a fresh server.
            with serving(run, log=args.dir / "streamlit.log") as base:
                render(browser, f"{base}/sql")  # the server process's own start-up (imports), not the queries
                nav = navigate_all(browser, base)
            # 2. Each page opened in a fresh tab (a bookmark, a reload): JavaScript parsed again, every time.
            with serving(run, log=args.dir / "streamlit.log") as base:
                render(browser, f"{base}/sql")
                for name, url in PAGES:
                    cold = render(browser, f"{base}/{url}")
                    warm = cold if args.quick else render(browser, f"{base}/{url}")  # quick: one visit per page
                    results.append((name, cold, warm))
            browser.close()
    peer = naive_heatmap(run)
    print(f"\n{'page':<10} {'charts':>6} {'first, in app s':>16} {'first, new tab s':>17} {'cached, new tab s':>18} "
          f"{'target s':>9} {'in app/target':>14} {'naive heat-map feed s':>22}")
    for (name, (cold_s, charts, exc), (warm_s, _, _)), (nav_s, _, nav_exc) in zip(results, nav, strict=True):
        flag = "" if exc == 0 and nav_exc == 0 else f"  ({exc + nav_exc} exception blocks!)"
        print(f"{name:<10} {charts:>6} {nav_s:>16.2f} {cold_s:>17.2f} {warm_s:>18.2f} {args.target_s:>9.1f} "
              f"{nav_s / args.target_s:>14.2f} {peer:>22.2f}{flag}")
    print("\nin app: the Runs row is the app's first load in a new tab (JavaScript included); every other row is "
          "a sidebar click to a page not yet visited, queries uncached.")
    print(f"\n{'server-side query (uncached)':<42} {'s':>7} {'rows out':>10}")
    for name, secs, n in ([] if args.no_query_table else time_queries(run, skip_on_demand=args.quick)):
        print(f"{name:<42} {secs:>7.2f} {n:>10,}")
    print(f"\nnaive peer: SELECT the heat map's 6 columns of all {counts['tensor_stats']:,} tensor_stats rows "
          "into polars, then group there (what a dashboard without push-down does for one chart).")


if __name__ == "__main__":
    sys.exit(main())
