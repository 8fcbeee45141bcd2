"""Runs, row counts, scalars and events: the small tables behind the Runs and Events pages."""

from __future__ import annotations

import polars as pl

from dynascope.dashboard.queries import BUCKET, bounds_cte, in_list
from dynascope.store import StoreConnection, quote_literal
from dynascope.store.catalog import list_runs
from dynascope.store.schema import TABLE_NAMES


def run_list(store: StoreConnection) -> pl.DataFrame:
    """run_id, status, steps, ranks, size_bytes, last_write_us: the store catalog (``list_runs``)."""
    return list_runs(store.path)


def table_rows(store: StoreConnection, runs: tuple[str, ...]) -> pl.DataFrame:
    """Rows per table per run (a run_id column scan each, so cheap even for large runs)."""
    parts = [f"SELECT {quote_literal(t)} AS tbl, run_id, count(*) AS n FROM {t} WHERE {in_list('run_id', runs)} "
             "GROUP BY run_id" for t in TABLE_NAMES if t != "runs"]
    return store.frame(" UNION ALL ".join(parts) + " ORDER BY tbl, run_id")


def scalar_keys(store: StoreConnection, runs: tuple[str, ...]) -> pl.DataFrame:
    """Every scalar key of the runs with how many distinct steps it was logged at (key order)."""
    return store.frame(f"SELECT key, count(DISTINCT step) AS steps FROM scalars WHERE {in_list('run_id', runs)} "
                        "GROUP BY key ORDER BY key")


# What a chart of one scalar shows first: the first of these logged at two or more steps, else the key
# logged at the most steps (a key logged once, such as a final eval, draws a single dot).
PREFERRED_SCALARS = ("loss", "train/loss", "reward_mean", "train/reward", "rl/reward", "sft/loss")


def default_scalar(keys: pl.DataFrame, preferred: tuple[str, ...] = PREFERRED_SCALARS) -> str:
    """The key a scalar picker starts on (see ``PREFERRED_SCALARS``); ``keys`` is ``scalar_keys``'s frame."""
    steps = dict(keys.select("key", "steps").iter_rows())
    for k in preferred:
        if steps.get(k, 0) >= 2:
            return k
    return keys.sort(["steps", "key"], descending=[True, False])["key"][0]


def scalar_series(store: StoreConnection, runs: tuple[str, ...], key: str) -> pl.DataFrame:
    """One scalar over steps per run and stage: mean, min and max per step bucket."""
    where = f"{in_list('run_id', runs)} AND key = {quote_literal(key)} AND step IS NOT NULL"
    return store.frame(f"""
        WITH {bounds_cte('scalars', where, partition='run_id')}
        SELECT s.run_id, coalesce(stage, '') AS stage, {BUCKET} AS step,
               avg(value) AS mean, min(value) AS lo, max(value) AS hi
        FROM scalars s JOIN bounds b USING (run_id) WHERE {where}
        GROUP BY ALL ORDER BY s.run_id, stage, step""")


def events(store: StoreConnection, runs: tuple[str, ...], limit: int = 5000) -> pl.DataFrame:
    """The newest events (instability, faults, checkpoints, restarts...) with their step."""
    return store.frame(f"""
        SELECT run_id, step, rank, event, severity, message, dur_us / 1000.0 AS dur_ms,
               make_timestamp(time_us) AS time, fields_json
        FROM events WHERE {in_list('run_id', runs)}
        ORDER BY time_us DESC NULLS LAST LIMIT {int(limit)}""")


def step_context(store: StoreConnection, run: str, step: int) -> dict[str, pl.DataFrame]:
    """What the store holds about one step: scalars, phase times per rank, and its worst tensors."""
    r, s = quote_literal(run), int(step)
    return {
        "scalars": store.frame(f"SELECT stage, key, avg(value) AS value FROM scalars "
                                f"WHERE run_id = {r} AND step = {s} GROUP BY ALL ORDER BY key"),
        "phases": store.frame(f"SELECT rank, phase, sum(dur_us) / 1000.0 AS ms FROM timings "
                               f"WHERE run_id = {r} AND step = {s} AND category <> 'kernel' "
                               "GROUP BY ALL ORDER BY rank, ms DESC"),
        "tensors": store.frame(f"SELECT tensor, update_ratio, grad_norm, grad_nan_count + grad_inf_count AS grad_nonfinite, "
                                f"w_nan_count + w_inf_count AS w_nonfinite FROM tensor_stats_global WHERE run_id = {r} AND step = {s} "
                                "ORDER BY (grad_nan_count + grad_inf_count + w_nan_count + w_inf_count) DESC, update_ratio DESC NULLS LAST "
                                "LIMIT 10"),
    }


def alerts(store: StoreConnection, runs: tuple[str, ...], limit: int = 500) -> pl.DataFrame:
    """The alerts fired in the runs (``dynascope.alerts``: ``alert`` events), newest first, with the rule,
    the series (role, rank) and the value that fired it."""
    return store.frame(f"""
        SELECT make_timestamp(time_us) AS time, run_id, step, severity,
               json_extract_string(fields_json, '$.rule') AS rule,
               json_extract_string(fields_json, '$.role') AS role,
               TRY_CAST(json_extract_string(fields_json, '$.rank') AS INTEGER) AS rank,
               TRY_CAST(json_extract_string(fields_json, '$.value') AS DOUBLE) AS value,
               TRY_CAST(json_extract_string(fields_json, '$.threshold') AS DOUBLE) AS threshold, message
        FROM events WHERE event = 'alert' AND {in_list('run_id', runs)}
        ORDER BY time_us DESC LIMIT {int(limit)}""")
