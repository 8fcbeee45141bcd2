"""Rollout aggregates: mean reward and the zero-variance share of groups per step bucket."""

from __future__ import annotations

import polars as pl

from dynascope.dashboard.queries import BUCKET, MAX_POINTS, bounds_cte, in_list
from dynascope.store import StoreConnection


def rewards(store: StoreConnection, runs: tuple[str, ...], max_points: int = MAX_POINTS) -> pl.DataFrame:
    """Mean reward and the share of groups whose rewards are all equal (no GRPO advantage signal)."""
    where = f"{in_list('run_id', runs)} AND step IS NOT NULL AND reward IS NOT NULL"
    return store.frame(f"""
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
