"""Where step time went, per training stage: the one definition the report and the demo both show.

A stage (``sft``, ``rl`` …) is the label a process gave the rows of a step (``scope.set_stage``): the
most frequent ``stage`` of that process's ``tensor_stats`` rows at that step, else of its ``scalars``.
Shares are over the step rows of the same (run, role, stage): every rank's phase time summed, over every
rank's step time summed, so SFT steps do not dilute the RL rollout share and vice versa.
"""

from __future__ import annotations

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.analyses.steps import step_breakdown

__all__ = ["phase_shares"]

_KEYS = ["run_id", "role", "rank", "step"]


def _stages(con, run: str | None) -> pl.DataFrame:
    """(run_id, role, rank, step) → stage, from the process's own labelled rows."""
    return frame(con, f"""
        WITH labelled AS (
            SELECT run_id, coalesce(role, '') AS role, rank, step, stage, 0 AS pref FROM tensor_stats
            WHERE stage IS NOT NULL AND step IS NOT NULL{run_clause(run)}
            UNION ALL
            SELECT run_id, coalesce(role, '') AS role, rank, step, stage, 1 AS pref FROM scalars
            WHERE stage IS NOT NULL AND step IS NOT NULL{run_clause(run)})
        SELECT run_id, role, rank, step, arg_min(stage, (pref, -n)) AS stage FROM (
            SELECT run_id, role, rank, step, stage, pref, COUNT(*) AS n FROM labelled GROUP BY ALL)
        GROUP BY run_id, role, rank, step""")


def phase_shares(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """Share of step time per top-level phase (and the un-instrumented remainder), per run, role and stage.

    Columns: run_id, role, stage (NULL for steps no row labelled), steps, phase, dur_ms (all ranks
    summed), step_ms (all ranks' step time summed), share_pct. Steps without a step row are left out.
    Rows come per (run, role, stage) in step order of the stage, largest share first.
    """
    con = as_store(store)
    b = step_breakdown(con, run).filter(pl.col("step_ms").is_not_null())
    cols = {"run_id": pl.String, "role": pl.String, "stage": pl.String, "steps": pl.UInt32, "phase": pl.String,
            "dur_ms": pl.Float64, "step_ms": pl.Float64, "share_pct": pl.Float64}
    if b.is_empty():
        return pl.DataFrame(schema=cols)
    b = b.join(_stages(con, run), on=_KEYS, how="left")
    groups = ["run_id", "role", "stage"]
    totals = b.unique([*_KEYS]).group_by(groups).agg(
        pl.col("step").n_unique().alias("steps"), pl.col("step_ms").sum(), pl.col("step").min().alias("_first"))
    per = b.group_by([*groups, "phase"]).agg(pl.col("dur_ms").sum())
    return (per.join(totals, on=groups, how="left", nulls_equal=True)
            .with_columns((100 * pl.col("dur_ms") / pl.col("step_ms")).alias("share_pct"))
            .sort(["run_id", "role", "_first", "share_pct"], descending=[False, False, False, True])
            .select(*cols).cast(cols))
