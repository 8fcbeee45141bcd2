"""Rollout aggregates: response-length distribution, tail wait, rewards, zero-variance groups, staleness."""

from __future__ import annotations

import polars as pl

from dynascope.dashboard.queries import BUCKET, MAX_POINTS, bounds_cte, frame, in_list
from dynascope.store import StoreConnection


def lengths(store: StoreConnection, runs: tuple[str, ...], max_points: int = MAX_POINTS) -> pl.DataFrame:
    """Response-length quantiles per run and step bucket, and the tail-wait share of generation time.

    Tail-wait share of a step: time from the moment 90 % of its samples had finished to the last one,
    over the step's whole generation span — how long the batch idles on its longest responses.
    """
    where = f"{in_list('run_id', runs)} AND step IS NOT NULL"
    return frame(store, f"""
        WITH {bounds_cte('samples', where, max_points, partition='run_id')},
        per_step AS (
            SELECT run_id, step, median(response_len) AS p50, quantile_cont(response_len, 0.9) AS p90,
                   max(response_len) AS max_len, count(*) AS n,
                   (max(gen_end_us) - quantile_cont(gen_end_us, 0.9))
                     / nullif(max(gen_end_us) - min(gen_start_us), 0) AS tail_share
            FROM samples WHERE {where} GROUP BY ALL)
        SELECT p.run_id, {BUCKET} AS step, avg(p50) AS p50, avg(p90) AS p90, max(max_len) AS max_len,
               100.0 * avg(tail_share) AS tail_pct, 100.0 * min(tail_share) AS tail_pct_lo,
               100.0 * max(tail_share) AS tail_pct_hi, CAST(sum(n) AS BIGINT) AS samples
        FROM per_step p JOIN bounds USING (run_id) GROUP BY ALL ORDER BY p.run_id, step""")


def rewards(store: StoreConnection, runs: tuple[str, ...], max_points: int = MAX_POINTS) -> pl.DataFrame:
    """Mean reward and the share of groups whose rewards are all equal (no GRPO advantage signal)."""
    where = f"{in_list('run_id', runs)} AND step IS NOT NULL AND reward IS NOT NULL"
    return frame(store, f"""
        WITH grp AS (
            SELECT run_id, step, group_id, avg(reward) AS r, count(*) AS n,
                   CASE WHEN count(*) > 1 AND max(reward) = min(reward) THEN 1 ELSE 0 END AS zero_var
            FROM samples WHERE {where} GROUP BY ALL),
        per_step AS (SELECT run_id, step, sum(r * n) / sum(n) AS reward, 100.0 * avg(zero_var) AS zero_var_pct,
                            count(*) AS groups FROM grp GROUP BY ALL),
        {bounds_cte('per_step', 'TRUE', max_points, partition='run_id')}
        SELECT p.run_id, {BUCKET} AS step, avg(reward) AS reward, min(reward) AS reward_lo,
               max(reward) AS reward_hi, avg(zero_var_pct) AS zero_var_pct, CAST(sum(groups) AS BIGINT) AS groups
        FROM per_step p JOIN bounds USING (run_id) GROUP BY ALL ORDER BY p.run_id, step""")


def staleness(store: StoreConnection, runs: tuple[str, ...]) -> pl.DataFrame:
    """Histogram of trainer_version − policy_version per run (empty for synchronous runs without versions)."""
    return frame(store, f"""
        SELECT run_id, trainer_version - policy_version AS staleness, count(*) AS samples
        FROM samples WHERE {in_list('run_id', runs)}
          AND trainer_version IS NOT NULL AND policy_version IS NOT NULL
        GROUP BY ALL ORDER BY run_id, staleness""")
