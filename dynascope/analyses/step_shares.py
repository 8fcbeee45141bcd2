"""Where step time went, per training stage: the one definition the report and the demo both show.

A stage (``sft``, ``rl`` …) is the label a process gave the rows of a step (``scope.set_stage``): the
most frequent ``stage`` of that process's ``tensor_stats`` rows at that step, else of its ``scalars``.
Shares are over the step rows of the same (run, role, stage): every rank's phase time summed, over every
rank's step time summed, so SFT steps do not dilute the RL rollout share and vice versa.

Summed in DuckDB, not over ``step_breakdown``'s rows: that frame holds a row per rank, step and phase
(4.2M at 1,024 ranks × 500 steps), and building it took seconds where the sums take a fraction of one.
The rows per stage come from the ``tensor_stats_by_kind`` rollup (its ``tensors`` count the rows it
pools) for runs that have it.
"""

from __future__ import annotations

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.analyses.steps import KEYS, REMAINDER, scan_sql
from dynascope.store import quote_literal

__all__ = ["phase_shares"]

_SCHEMA = {"run_id": pl.String, "role": pl.String, "stage": pl.String, "steps": pl.UInt32, "phase": pl.String,
           "dur_ms": pl.Float64, "step_ms": pl.Float64, "share_pct": pl.Float64}


def stages_sql(con, run: str | None) -> str:
    """(run_id, role, rank, step) → stage, from the process's own labelled rows."""
    rolled = [r for (r,) in con.rows(
        f"SELECT DISTINCT run_id FROM tensor_stats_by_kind WHERE step IS NOT NULL{run_clause(run)}")]
    not_rolled = f" AND run_id NOT IN ({', '.join(quote_literal(r) for r in rolled)})" if rolled else ""
    return f"""
        WITH labelled AS (
            SELECT run_id, coalesce(role, '') AS role, rank, step, stage, 0 AS pref, sum(tensors) AS n
            FROM tensor_stats_by_kind WHERE stage IS NOT NULL AND step IS NOT NULL{run_clause(run)} GROUP BY ALL
            UNION ALL
            SELECT run_id, coalesce(role, '') AS role, rank, step, stage, 0 AS pref, COUNT(*) AS n FROM tensor_stats
            WHERE stage IS NOT NULL AND step IS NOT NULL{run_clause(run)}{not_rolled} GROUP BY ALL
            UNION ALL
            SELECT run_id, coalesce(role, '') AS role, rank, step, stage, 1 AS pref, COUNT(*) AS n FROM scalars
            WHERE stage IS NOT NULL AND step IS NOT NULL{run_clause(run)} GROUP BY ALL)
        SELECT run_id, role, rank, step, arg_min(stage, (pref, -n)) AS stage FROM labelled
        GROUP BY run_id, role, rank, step"""


def phase_shares(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """Share of step time per top-level phase (and the un-instrumented remainder), per run, role and stage.

    Columns: run_id, role, stage (NULL for steps no row labelled), steps, phase, dur_ms (all ranks
    summed), step_ms (all ranks' step time summed), share_pct. Steps without a step row are left out.
    Rows come per (run, role, stage) in step order of the stage, largest share first.
    """
    con = as_store(store)
    # Each phase row joined once to its step row with the step's stage; the remainder and the totals come
    # from the step rows (640k at 1,024 ranks) and the joined rows' per-step sums.
    df = frame(con, f"""
        WITH {scan_sql(run)},
        stages AS ({stages_sql(con, run)}),
        sts AS (SELECT st.*, s.stage FROM st LEFT JOIN stages s USING ({KEYS})),
        j AS (SELECT {KEYS}, sts.stage, ph.phase, ph.dur_us FROM ph JOIN sts USING ({KEYS})),
        per AS (SELECT run_id, role, stage, phase, sum(dur_us) AS dur_us FROM j GROUP BY ALL),
        tot AS (SELECT {KEYS}, sum(dur_us) AS phases_us FROM j GROUP BY ALL),
        rem AS (SELECT sts.run_id, sts.role, sts.stage, {quote_literal(REMAINDER)} AS phase,
                       sum(greatest(sts.step_us - coalesce(tot.phases_us, 0), 0)) AS dur_us
                FROM sts LEFT JOIN tot USING ({KEYS}) GROUP BY ALL),
        totals AS (SELECT run_id, role, stage, count(DISTINCT step) AS steps, sum(step_us) AS step_us,
                          min(step) AS first_step FROM sts GROUP BY ALL)
        SELECT p.run_id, p.role, p.stage, t.steps, p.phase, p.dur_us / 1000.0 AS dur_ms,
               t.step_us / 1000.0 AS step_ms, 100.0 * p.dur_us / t.step_us AS share_pct
        FROM (SELECT * FROM per UNION ALL SELECT * FROM rem) p
        JOIN totals t ON p.run_id = t.run_id AND p.role = t.role AND p.stage IS NOT DISTINCT FROM t.stage
        ORDER BY p.run_id, p.role, t.first_step, share_pct DESC, p.phase""")
    return df.select([pl.col(c).cast(t) for c, t in _SCHEMA.items()]) if df.height else pl.DataFrame(schema=_SCHEMA)
