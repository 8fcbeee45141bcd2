"""What watching cost: the probe's own time on the training thread, beside how much it recorded.

The timing probe times the probes' work inside each step as the phase ``PROBE_PHASE``. Its share of step
time depends on what the run asked for: a run recording every statistic of every tensor at every step
(``memory_budget=None, time_budget=None``, as the demos do on their tiny or single models) pays the full
per-tensor cost each step, while ``watch()``'s defaults run the windowed statistics on a rotating window
under a 1% time budget. ``coverage_pct`` tells the two apart from the data: the share of (step, tensor)
rows of the recorded steps that carry an update statistic.
"""

from __future__ import annotations

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.analyses.steps import KEYS, TOP_LEVEL, step_rows_sql
from dynascope.store import quote_literal
from dynascope.store.pooling import GLOBAL

__all__ = ["DEFAULT_PROBE_COST", "PROBE_PHASE", "probe_cost"]

PROBE_PHASE = "dynascope"  # probes.timing.PROBE_PHASE (analyses do not import probes; a test holds them equal)
# What watching costs at the reference workload, by the A/B step-time ratios of README's Figures table
# (a test holds these equal to it): watch()'s defaults, and full coverage (every statistic of every tensor at
# every step, what the demos record).
DEFAULT_STEP_X, FULL_COVERAGE_STEP_X = "1.015×", "1.082×"
DEFAULT_PROBE_COST = (f"{DEFAULT_STEP_X} the unprobed step time at the reference workload (full coverage, every "
                      f"statistic of every tensor at every step: {FULL_COVERAGE_STEP_X})")

_SCHEMA = {"run_id": pl.String, "steps": pl.Int64, "probe_ms": pl.Float64, "step_ms": pl.Float64,
           "probe_pct": pl.Float64, "recorded_steps": pl.Int64, "coverage_pct": pl.Float64}


def probe_cost(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """Per run: the probe's time inside timed steps and its share of their step time, and its coverage.

    Columns: run_id, steps (steps with a step row), probe_ms, step_ms (every rank's, summed), probe_pct,
    recorded_steps (steps with tensor_stats rows), coverage_pct (tensors of those steps with ``update_norm``
    over all of them, in tensor_stats_global: 100 when every tensor's update statistics were computed at every recorded step).
    Runs without a ``PROBE_PHASE`` row inside a timed step are left out.
    """
    con = as_store(store)
    # Summed in DuckDB over the probe's own rows: step_breakdown's row per rank, step and phase is millions of
    # rows at a thousand ranks, none of which but the probe's is needed here.
    spent = frame(con, f"""
        WITH probe AS (SELECT run_id, coalesce(role, '') AS role, rank, step, SUM(dur_us) AS probe_us FROM timings
                       WHERE {TOP_LEVEL} AND phase = {quote_literal(PROBE_PHASE)}{run_clause(run)} GROUP BY ALL),
        -- step rows of the probed runs only: a run without the probe's phase costs one filtered scan
        st AS (SELECT * FROM ({step_rows_sql(run)}) WHERE run_id IN (SELECT DISTINCT run_id FROM probe))
        SELECT st.run_id, COUNT(DISTINCT st.step) AS steps, SUM(p.probe_us) / 1000.0 AS probe_ms,
               SUM(st.step_us) / 1000.0 AS step_ms
        FROM st LEFT JOIN probe p USING ({KEYS}) GROUP BY st.run_id HAVING COUNT(p.probe_us) > 0""")
    if spent.is_empty():
        return pl.DataFrame(schema=_SCHEMA)
    recorded = frame(con, f"""
        SELECT run_id, COUNT(DISTINCT step) AS recorded_steps,
               100.0 * COUNT(update_norm) / COUNT(*) AS coverage_pct
        FROM {GLOBAL} WHERE true{run_clause(run)} GROUP BY run_id""")
    out = (spent.join(recorded, on="run_id", how="left")
           .with_columns((100 * pl.col("probe_ms") / pl.col("step_ms")).alias("probe_pct")))
    return out.select([pl.col(c).cast(t) for c, t in _SCHEMA.items()]).sort("run_id")
