"""Slow ranks and slow nodes: which rank, or which host's ranks together, run a phase slower than the others
by more than healthy ranks differ.

Per step, each rank's time in a phase is divided by the step's cross-rank median for that phase (``ratio``);
a rank's ``slowdown_x`` is the median of its ratios over the steps. What healthy ranks differ by is measured,
not assumed: per (role, phase), the robust spread (1.4826 × the median absolute deviation) of the ranks'
slowdowns and of the single (rank, step) ratios. A rank is

- ``persistent`` when its slowdown is above 1 by more than ``k`` spreads of the ranks' slowdowns (and at
  least ``min_excess``);
- ``intermittent`` when it is not, but at least ``min_slow_steps`` of its steps are above 1 by more than
  ``k`` spreads of the single ratios (and ``min_step_excess``): slow every k-th step, say.

A host is a slow *node* in a phase when at least ``node_share`` of its ranks of a role are persistent in it
(the default, half: the median of its ranks is above the threshold)
(a host with one rank of that role is never a node): its ranks are then reported as the node, not one by one.
Hosts come from the ``runs`` rows (each rank's ``host``); a rank without one is its own host.
"""

from __future__ import annotations

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.analyses.stragglers import phase_times_sql

__all__ = ["cluster_outliers"]

_MAD = 1.4826  # the median absolute deviation of a normal distribution, in standard deviations
_SCHEMA = {"run_id": pl.String, "role": pl.String, "kind": pl.String, "host": pl.String, "rank": pl.Int64,
           "ranks_count": pl.Int64, "phase": pl.String, "status": pl.String, "slowdown_x": pl.Float64,
           "min_slowdown_x": pl.Float64, "max_slowdown_x": pl.Float64, "slow_steps_count": pl.Int64,
           "steps": pl.Int64, "threshold_x": pl.Float64, "excess_ms": pl.Float64}


def _per_rank(con, run: str | None, k: float, min_step_excess: float) -> pl.DataFrame:
    """Per (run, role, phase, rank, host): over the steps the rank ran the phase with at least two other
    ranks, slowdown_x (the median of its ``ratio``: its time over the step's cross-rank median), steps,
    excess_ms (its time beyond that median, summed) and slow_steps_count (steps whose ratio is above 1 by
    more than ``k`` spreads of every (rank, step) ratio of the phase, and ``min_step_excess``); and the
    phase's median time ``med_us``. A rank without a host in ``runs`` is its own host.

    Aggregated here, not over the ratios as a frame: that frame holds a row per rank, step and phase (1.8M
    at 1,024 ranks × 500 steps), and building it took longer than every sum over it."""
    return frame(con, f"""
        WITH d AS MATERIALIZED ({phase_times_sql(run, " AND rank IS NOT NULL")}),
        -- the step's cross-rank median and rank count, grouped and joined back (as straggler_scores does)
        m AS (SELECT d.*, c.med_us, c.nranks FROM d
              JOIN (SELECT run_id, role, step, phase, median(dur_us) AS med_us, COUNT(*) AS nranks
                    FROM d GROUP BY ALL) c
                ON d.run_id IS NOT DISTINCT FROM c.run_id AND d.role = c.role AND d.step = c.step
                   AND d.phase = c.phase),
        h AS (SELECT run_id, coalesce(role, '') AS role, rank, any_value(host) AS host FROM runs
              WHERE rank IS NOT NULL{run_clause(run)} GROUP BY ALL),
        r AS (SELECT m.run_id, m.role, m.rank, m.phase, dur_us, dur_us / med_us AS ratio,
                     greatest(dur_us - med_us, 0) / 1000.0 AS excess_ms, coalesce(h.host, 'rank ' || m.rank) AS host
              FROM m LEFT JOIN h USING (run_id, role, rank) WHERE nranks >= 3 AND med_us > 0),
        g AS (SELECT run_id, role, phase, median(ratio) AS ratio_med, median(dur_us) AS med_us FROM r GROUP BY ALL),
        s AS (SELECT run_id, role, phase, any_value(g.med_us) AS med_us,
                     1 + greatest({float(k)} * {_MAD} * median(abs(ratio - ratio_med)), {float(min_step_excess)}) AS cut
              FROM r JOIN g USING (run_id, role, phase) GROUP BY ALL)
        SELECT run_id, role, phase, rank, host, median(ratio) AS slowdown_x, COUNT(*) AS steps,
               SUM(excess_ms) AS excess_ms, COUNT(*) FILTER (ratio > cut) AS slow_steps_count,
               any_value(s.med_us) AS med_us
        FROM r JOIN s USING (run_id, role, phase) GROUP BY ALL""")


def cluster_outliers(store: StoreLike, run: str | None = None, *, k: float = 4.0, min_excess: float = 0.03,
                     min_step_excess: float = 0.15, min_slow_steps: int = 2, node_share: float = 0.5,
                     min_median_ms: float = 5.0) -> pl.DataFrame:
    """Slow ranks (``kind`` rank: persistent or intermittent) and slow nodes (``kind`` node) per phase.

    Columns: run_id, role, kind, host, rank (null for a node), ranks_count (1, or the node's ranks of that
    role), phase, status, slowdown_x (median over steps of the rank's time / the step's cross-rank median;
    a node: the median of its ranks'), min_slowdown_x / max_slowdown_x (a node's ranks), slow_steps_count
    (steps above the per-step threshold; a node: its ranks' median), steps, threshold_x (the slowdown above
    which a rank is persistent in that phase), excess_ms (time beyond the cross-rank median over the run; a
    node: its slowest rank's). Rows come most excess first. Phases whose median is under ``min_median_ms``
    are left out; a phase needs three ranks of a role in a step to be compared.
    """
    per = _per_rank(as_store(store), run, k, min_step_excess)
    if per.is_empty():
        return pl.DataFrame(schema=_SCHEMA)
    grp = ["run_id", "role", "phase"]
    per = per.with_columns(
        threshold_x=1 + pl.max_horizontal(
            k * _MAD * (pl.col("slowdown_x") - pl.col("slowdown_x").median().over(grp)).abs().median().over(grp),
            pl.lit(min_excess)))
    per = per.with_columns(status=pl.when(pl.col("slowdown_x") > pl.col("threshold_x")).then(pl.lit("persistent"))
                           .when(pl.col("slow_steps_count") >= min_slow_steps).then(pl.lit("intermittent")))
    per = per.filter(pl.col("med_us") >= 1000 * min_median_ms).drop("med_us")
    # nodes: hosts whose ranks of a role are slow together in a phase
    hosts = (per.group_by([*grp, "host"])
             .agg(ranks_count=pl.len(), slow=(pl.col("status") == "persistent").sum(),
                  slowdown=pl.col("slowdown_x").median(), lo=pl.col("slowdown_x").min(),
                  hi=pl.col("slowdown_x").max(), slow_steps=pl.col("slow_steps_count").median(),
                  steps=pl.col("steps").max(), threshold_x=pl.col("threshold_x").first(),
                  excess_ms=pl.col("excess_ms").max()))
    nodes = hosts.filter((pl.col("ranks_count") >= 2) & (pl.col("slow") >= node_share * pl.col("ranks_count")))
    node_rows = nodes.select(
        *grp, pl.lit("node").alias("kind"), "host", pl.lit(None, pl.Int64).alias("rank"), "ranks_count",
        pl.lit("persistent").alias("status"), pl.col("slowdown").alias("slowdown_x"),
        pl.col("lo").alias("min_slowdown_x"), pl.col("hi").alias("max_slowdown_x"),
        pl.col("slow_steps").round().cast(pl.Int64).alias("slow_steps_count"), "steps", "threshold_x", "excess_ms")
    ranks = per.filter(pl.col("status").is_not_null()).join(nodes.select(*grp, "host"), on=[*grp, "host"], how="anti")
    rank_rows = ranks.select(
        *grp, pl.lit("rank").alias("kind"), "host", "rank", pl.lit(1, pl.Int64).alias("ranks_count"), "status",
        "slowdown_x", pl.col("slowdown_x").alias("min_slowdown_x"), pl.col("slowdown_x").alias("max_slowdown_x"),
        "slow_steps_count", "steps", "threshold_x", "excess_ms")
    out = pl.concat([node_rows.cast(_SCHEMA), rank_rows.cast(_SCHEMA)]).select(list(_SCHEMA))  # type: ignore[arg-type]
    return out.sort(["excess_ms", "run_id", "role", "phase"], descending=[True, False, False, False])
