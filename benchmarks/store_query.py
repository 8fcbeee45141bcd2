"""Dashboard-style aggregations over a large tensor_stats run: the store's views vs raw read_parquet.

Builds (once, cached in --dir) a run of --rows tensor_stats rows written by 4 rank writers, then times the
heaviest queries the dashboard issues, each through the store view (live-segment filter, schema union) and
through a bare ``read_parquet`` over the same files (no filter: the floor DuckDB can do). Goal: every view
query < 1 s on 2 threads, view/raw ratio near 1.

    python3 benchmarks/store_query.py            # 50M rows (builds ~2 GB once)
    python3 benchmarks/store_query.py --quick    # 2M rows, < 1 minute
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np

from dynascope.dashboard.queries.params import param_cube
from dynascope.store import RunWriter, open_store
from dynascope.store.schema import ROLLUP_BLOCK_STEPS

KINDS = ["attn_q", "attn_k", "attn_v", "attn_o", "mlp_up", "mlp_gate", "mlp_down", "norm1", "norm2", "embed"]
RANKS = 4

QUERIES = {
    # The layer x step heat map two ways: from every tensor row, and from the writer's rollup of 16-step blocks
    # (tensor_stats_by_layer; {bucket} is a whole number of blocks), which is what the dashboard reads.
    "heat map layer x step": """
        SELECT layer, step // {bucket} AS step_bin, sqrt(sum(update_norm * update_norm)) / sqrt(sum(w_norm * w_norm)) AS ratio,
               sum(changed_count) AS changed
        FROM {src} WHERE kind = 'attn_q' GROUP BY ALL""",
    "heat map, rollup": """
        SELECT layer, step // {bucket} AS step_bin, sqrt(sum(update_sq)) / sqrt(sum(w_sq)) AS ratio,
               sum(changed_count) AS changed
        FROM {layer_rollup} WHERE kind = 'attn_q' GROUP BY ALL""",
    # The same per-step, per-kind series two ways: from every tensor row, and from the rollup the writer keeps
    # (tensor_stats_by_kind), which is what the dashboard reads. main() checks that each pair gives the same numbers.
    "per-kind series": """
        SELECT step, kind, sqrt(sum(update_norm * update_norm)) / sqrt(sum(w_norm * w_norm)) AS update_ratio,
               max(grad_max_abs) AS grad_max_abs, sum(changed_count) AS changed
        FROM {src} GROUP BY ALL""",
    "per-kind series, rollup": """
        SELECT step, kind, sqrt(sum(update_sq)) / sqrt(sum(w_sq)) AS update_ratio,
               max(grad_max_abs) AS grad_max_abs, sum(changed_count) AS changed
        FROM {rollup} GROUP BY ALL""",
    "top tensors": """
        SELECT tensor, max(update_ratio) AS peak, avg(update_norm) AS mean_dw
        FROM {src} GROUP BY tensor ORDER BY peak DESC LIMIT 20""",
    "one tensor's history": """
        SELECT step, rank, update_ratio, grad_norm FROM {src} WHERE tensor = 'layers.7.attn_q.weight' ORDER BY step""",
    "count rows": "SELECT count(*) FROM {src}",
}


REPLACED = ("heat map layer x step", "per-kind series")  # each followed by its rollup twin in QUERIES


def build(run_dir: Path, rows: int, layers: int = 50) -> None:
    tensors = [f"layers.{i}.{k}.weight" for i in range(layers) for k in KINDS]
    layer_of = np.repeat(np.arange(layers, dtype=np.int32), len(KINDS))
    kind_of = KINDS * layers
    steps = rows // (RANKS * len(tensors))
    rng = np.random.default_rng(0)
    # max_block_s: the build waits for the disk instead of dropping rows (a benchmark needs them all)
    writers = [RunWriter(run_dir, rank=r, world_size=RANKS, flush_rows=2_000_000, flush_secs=60, max_block_s=3600)
               for r in range(RANKS)]
    n = len(tensors)
    for step in range(steps):
        for w in writers:
            w.append("tensor_stats", {
                "step": step, "time_us": 1_700_000_000_000_000 + step * 1000, "stage": "rl",
                "tensor": tensors, "layer": layer_of, "kind": kind_of, "numel": 4096, "dtype": "bfloat16",
                "w_norm": rng.random(n), "update_norm": rng.random(n), "update_ratio": rng.random(n) * 1e-3,
                "changed_count": rng.integers(0, 4096, n), "changed_frac": rng.random(n),
                "grad_norm": rng.random(n), "grad_max_abs": rng.random(n),
            })
    for w in writers:
        w.close()
        assert w.rows_dropped == 0, "the build dropped rows"


def timed(con, sql: str, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        con.sql(sql).pl()  # into polars, as the dashboard does (Python tuples would time the conversion)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2M rows instead of 50M")
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dynascope-bench-query"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = args.rows or (2_000_000 if args.quick else 50_000_000)
    run_dir = args.dir / f"tensor_stats_{rows}"
    layout = "3"  # bump when the build changes (3: the tensor_stats_by_layer rollup)
    done = run_dir / ".complete"
    if not (run_dir / "dynascope.json").exists() or not done.exists() or done.read_text() != layout:
        shutil.rmtree(run_dir, ignore_errors=True)
        t0 = time.perf_counter()
        build(run_dir, rows)
        done.write_text(layout)
        print(f"built {rows:,} rows in {time.perf_counter() - t0:.1f} s -> {run_dir}")
    store = open_store(run_dir, threads=args.threads)
    con = store._con
    total = con.sql("SELECT count(*), max(step) FROM tensor_stats").fetchall()[0]
    # ~200 heat-map columns, each a whole number of the layer rollup's blocks
    bucket = max(1, -(-(total[1] + 1) // 200 // ROLLUP_BLOCK_STEPS)) * ROLLUP_BLOCK_STEPS
    names = {"src": "tensor_stats", "rollup": "tensor_stats_by_kind", "layer_rollup": "tensor_stats_by_layer"}
    raw = {k: f"read_parquet('{run_dir}/{v}/*/*.parquet', union_by_name = true)" for k, v in names.items()}
    counts = {v: con.sql(f"SELECT count(*) FROM {v}").fetchall()[0][0] for v in names.values()}
    print(f"\n{total[0]:,} rows ({counts['tensor_stats_by_kind']:,} in the by-kind rollup, "
          f"{counts['tensor_stats_by_layer']:,} in the by-layer rollup), {total[1] + 1} steps, "
          f"threads={args.threads}, best of {args.repeat}\n")
    print(f"{'query':<26} {'view s':>8} {'raw s':>8} {'view/raw':>9}  goal < 1 s (reference: over every row, "
          "what the next row's rollup replaces)")
    for name, sql in QUERIES.items():
        t_view = timed(con, sql.format(**names, bucket=bucket), args.repeat)
        t_raw = timed(con, sql.format(**raw, bucket=bucket), args.repeat)
        # The two queries a rollup replaces are timed for reference: the dashboard issues their rollup twins.
        ok = "reference" if name in REPLACED else "ok" if t_view < 1.0 else "SLOW"
        print(f"{name:<26} {t_view:>8.3f} {t_raw:>8.3f} {t_view / t_raw:>9.2f}  {ok}")
    # A rollup must give what the raw rows give, or its speed means nothing.
    for pair in (("per-kind series", "per-kind series, rollup"), ("heat map layer x step", "heat map, rollup")):
        got = [con.sql(QUERIES[q].format(**names, bucket=bucket) + " ORDER BY ALL").fetchnumpy() for q in pair]
        for col in got[0]:
            a, b = got[0][col], got[1][col]
            same = np.allclose(a, b, rtol=1e-9) if a.dtype.kind == "f" else bool((a == b).all())
            assert same, f"{pair[1]} differs from the raw rows in {col}"
    print("\nrollup results == raw results (checked for both rollups)")
    run_id = con.sql("SELECT any_value(run_id) FROM runs").fetchall()[0][0]
    for attempt in ("first", "again"):
        t0 = time.perf_counter()
        cube = param_cube(store, run_id)
        took = time.perf_counter() - t0
        print(f"dashboard param_cube (whole Parameter-dynamics page), {attempt}: {took:.3f} s, "
              f"{cube.height:,} rows  {'ok' if took < 1.0 else 'SLOW'}")
    store.close()


if __name__ == "__main__":
    main()
