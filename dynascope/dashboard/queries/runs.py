"""Runs, row counts, scalars and events: the small tables behind the Runs and Events pages."""

from __future__ import annotations

import os
import time
from pathlib import Path

import polars as pl

from dynascope.dashboard.queries import BUCKET, bounds_cte, frame, in_list
from dynascope.store import StoreConnection, quote_literal
from dynascope.store.layout import locate
from dynascope.store.schema import TABLE_NAMES

# A run whose newest segment is younger than this is shown as live (the writer flushes every ~2 s).
LIVE_WINDOW_S = 60.0
_CRASH_KINDS = ("crash", "fault", "exception", "killed", "oom")


def run_list(store: StoreConnection) -> pl.DataFrame:
    """run_id, status, steps, ranks, size_bytes, last_write_us — the catalog's columns.

    Uses ``dynascope.store.catalog.list_runs`` when it exists; otherwise derives the same from the store.
    """
    try:
        from dynascope.store.catalog import list_runs
    except ImportError:
        list_runs = None
    if list_runs is not None:
        return list_runs(store.path)
    disk = pl.DataFrame([_disk_usage(d) for d in locate(store.path).run_dirs],
                        schema={"run_id": pl.String, "size_bytes": pl.Int64, "last_write_us": pl.Int64}, orient="row")
    stats = frame(store, f"""
        WITH s AS (SELECT run_id, step, rank FROM timings UNION ALL SELECT run_id, step, rank FROM tensor_stats
                   UNION ALL SELECT run_id, step, rank FROM scalars UNION ALL SELECT run_id, step, rank FROM samples)
        SELECT s.run_id, max(step) AS steps, count(DISTINCT rank) AS ranks,
               (SELECT count(*) FROM events e WHERE e.run_id = s.run_id AND e.severity IN ('error', 'critical')
                  AND {in_list('e.event', _CRASH_KINDS)}) AS crash_events,
               (SELECT count(*) FROM events e WHERE e.run_id = s.run_id AND e.event IN ('run_end', 'finished')) AS ends
        FROM s GROUP BY s.run_id""")
    out = disk.join(stats, on="run_id", how="left")
    now = time.time() * 1e6
    status = [
        "crashed" if (c or 0) > 0 and not (e or 0)
        else "live" if (now - (w or 0)) / 1e6 < LIVE_WINDOW_S and not (e or 0)
        else "finished"
        for c, e, w in zip(out["crash_events"], out["ends"], out["last_write_us"], strict=True)
    ]
    return out.with_columns(pl.Series("status", status)).select(
        "run_id", "status", pl.col("steps").fill_null(0), pl.col("ranks").fill_null(0), "size_bytes", "last_write_us")


def _disk_usage(run_dir: Path) -> tuple[str, int, int]:
    """(run_id, bytes, newest mtime in µs) from one walk over the run directory."""
    from dynascope.store.layout import read_marker, safe_id

    size, newest = 0, 0
    for dirpath, _, files in os.walk(run_dir):
        for f in files:
            try:
                st = os.stat(os.path.join(dirpath, f))
            except OSError:  # a segment renamed or compacted away mid-walk
                continue
            size += st.st_size
            newest = max(newest, st.st_mtime_ns // 1000)
    run_id = str(read_marker(run_dir).get("run_id", safe_id(run_dir.name)))
    return run_id, size, newest


def table_rows(store: StoreConnection, runs: tuple[str, ...]) -> pl.DataFrame:
    """Rows per table per run (a run_id column scan each, so cheap even for large runs)."""
    parts = [f"SELECT {quote_literal(t)} AS tbl, run_id, count(*) AS n FROM {t} WHERE {in_list('run_id', runs)} "
             "GROUP BY run_id" for t in TABLE_NAMES if t != "runs"]
    return frame(store, " UNION ALL ".join(parts) + " ORDER BY tbl, run_id")


def scalar_keys(store: StoreConnection, runs: tuple[str, ...]) -> list[str]:
    df = frame(store, f"SELECT DISTINCT key FROM scalars WHERE {in_list('run_id', runs)} ORDER BY key")
    return df["key"].to_list()


def scalar_series(store: StoreConnection, runs: tuple[str, ...], key: str) -> pl.DataFrame:
    """One scalar over steps per run and stage: mean, min and max per step bucket."""
    where = f"{in_list('run_id', runs)} AND key = {quote_literal(key)} AND step IS NOT NULL"
    return frame(store, f"""
        WITH {bounds_cte('scalars', where, partition='run_id')}
        SELECT s.run_id, coalesce(stage, '') AS stage, {BUCKET} AS step,
               avg(value) AS mean, min(value) AS lo, max(value) AS hi
        FROM scalars s JOIN bounds b USING (run_id) WHERE {where}
        GROUP BY ALL ORDER BY s.run_id, stage, step""")


def events(store: StoreConnection, runs: tuple[str, ...], limit: int = 5000) -> pl.DataFrame:
    """The newest events (instability, faults, checkpoints, restarts...) with their step."""
    return frame(store, f"""
        SELECT run_id, step, rank, event, severity, message, dur_us / 1000.0 AS dur_ms,
               make_timestamp(time_us) AS time, fields_json
        FROM events WHERE {in_list('run_id', runs)}
        ORDER BY time_us DESC NULLS LAST LIMIT {int(limit)}""")


def step_context(store: StoreConnection, run: str, step: int) -> dict[str, pl.DataFrame]:
    """What the store holds about one step: scalars, phase times per rank, and its worst tensors."""
    r, s = quote_literal(run), int(step)
    return {
        "scalars": frame(store, f"SELECT stage, key, avg(value) AS value FROM scalars "
                                f"WHERE run_id = {r} AND step = {s} GROUP BY ALL ORDER BY key"),
        "phases": frame(store, f"SELECT rank, phase, sum(dur_us) / 1000.0 AS ms FROM timings "
                               f"WHERE run_id = {r} AND step = {s} AND category <> 'kernel' "
                               "GROUP BY ALL ORDER BY rank, ms DESC"),
        "tensors": frame(store, f"SELECT tensor, update_ratio, grad_norm, grad_nan_count + grad_inf_count AS grad_nonfinite, "
                                f"w_nan_count + w_inf_count AS w_nonfinite FROM tensor_stats WHERE run_id = {r} AND step = {s} "
                                "ORDER BY (grad_nan_count + grad_inf_count + w_nan_count + w_inf_count) DESC, update_ratio DESC NULLS LAST "
                                "LIMIT 10"),
    }
