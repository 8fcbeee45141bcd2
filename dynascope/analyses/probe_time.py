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
from dynascope.analyses.steps import step_breakdown

__all__ = ["DEFAULT_PROBE_COST", "PROBE_PHASE", "probe_cost"]

PROBE_PHASE = "dynascope"  # probes.timing.PROBE_PHASE (analyses do not import probes; a test holds them equal)
# watch()'s default configuration by the probe's own clock, windows included (README, benchmarks table).
DEFAULT_PROBE_COST = "~1.5–2% of a step at the reference workload"

_SCHEMA = {"run_id": pl.String, "steps": pl.Int64, "probe_ms": pl.Float64, "step_ms": pl.Float64,
           "probe_pct": pl.Float64, "recorded_steps": pl.Int64, "coverage_pct": pl.Float64}


def probe_cost(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """Per run: the probe's time inside timed steps and its share of their step time, and its coverage.

    Columns: run_id, steps (steps with a step row), probe_ms, step_ms (every rank's, summed), probe_pct,
    recorded_steps (steps with tensor_stats rows), coverage_pct (rows of those steps with ``update_norm``
    over all their rows: 100 when every tensor's update statistics were computed at every recorded step).
    Runs without a ``PROBE_PHASE`` row inside a timed step are left out.
    """
    con = as_store(store)
    b = step_breakdown(con, run).filter(pl.col("step_ms").is_not_null())
    probe = b.filter(pl.col("phase") == PROBE_PHASE)
    if probe.is_empty():
        return pl.DataFrame(schema=_SCHEMA)
    steps = b.unique(["run_id", "role", "rank", "step"]).group_by("run_id").agg(
        pl.col("step").n_unique().alias("steps"), pl.col("step_ms").sum())
    spent = probe.group_by("run_id").agg(pl.col("dur_ms").sum().alias("probe_ms"))
    recorded = frame(con, f"""
        SELECT run_id, COUNT(DISTINCT step) AS recorded_steps,
               100.0 * COUNT(update_norm) / COUNT(*) AS coverage_pct
        FROM tensor_stats WHERE step IS NOT NULL{run_clause(run)} GROUP BY run_id""")
    out = (spent.join(steps, on="run_id").join(recorded, on="run_id", how="left")
           .with_columns((100 * pl.col("probe_ms") / pl.col("step_ms")).alias("probe_pct")))
    return out.select([pl.col(c).cast(t) for c, t in _SCHEMA.items()]).sort("run_id")
