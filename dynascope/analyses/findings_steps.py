"""Findings about where step time goes: ranks waiting for their peers, and step time no phase covers.

- ``idle``: ranks spend a share of step time waiting in collectives and barriers (``steps.idle_time``),
  named beside the rank the others waited for (``findings_sql.waited_for_sql``);
- ``uninstrumented``: step time outside every top-level phase (``steps.step_breakdown``'s remainder rows).

Both read one query's per-rank sums of the rank-steps (``_per_rank``) rather than those analyses' frames:
a row per rank and step (640k at 1,024 ranks × 500 steps), or per rank, step and phase (4.2M), built only
to be summed per rank, cost seconds of the report where the sums cost a fraction of one. The sums are the
analyses' own, term for term. Numbers and query as in ``findings``.
"""

from __future__ import annotations

import polars as pl

from dynascope.analyses import findings_sql as S
from dynascope.analyses._common import frame, once
from dynascope.analyses._findings import Finding, first_row, found, rnd
from dynascope.analyses.steps import KEYS, scan_sql

__all__: list[str] = []  # generators for ``findings.GENERATORS``, not public analyses

MIN_IDLE_PCT = 2.0
WARN_IDLE_PCT = 10.0
MIN_UNINSTRUMENTED_PCT = 10.0  # the probe's own boundaries leave a few percent outside any phase
_KEYS = KEYS.removeprefix("run_id, ")  # within one run (``with_run=False``)


def _per_rank_sql(run: str) -> str:
    """Per rank (over its roles, as the findings count ranks): ``idle_time``'s idle and step µs summed over
    the rank-steps that have both top-level rows and a step row, and ``step_breakdown``'s remainder and
    step µs summed over the rank-steps with a step row."""
    # one run's rows: grouped and joined without the run_id key
    return f"""
        WITH {scan_sql(run, with_run=False)},
        per AS (
            SELECT {_KEYS}, SUM(CASE WHEN sync THEN 0 ELSE dur_us END) AS busy_us,
                   SUM(CASE WHEN sync THEN dur_us ELSE 0 END) AS wait_us, SUM(dur_us) AS phases_us, true AS top
            FROM ph GROUP BY ALL),
        w AS (SELECT *, MAX(busy_us) OVER (PARTITION BY role, step) - busy_us AS sync_us FROM per)
        SELECT rank,
               SUM(greatest(wait_us, sync_us)) FILTER (step_us IS NOT NULL AND top)::DOUBLE AS idle_us,
               SUM(step_us) FILTER (top)::DOUBLE AS idle_step_us,
               SUM(greatest(step_us - coalesce(phases_us, 0), 0)) FILTER (step_us IS NOT NULL)::DOUBLE AS rem_us,
               SUM(step_us)::DOUBLE AS rem_step_us
        FROM st FULL JOIN w USING ({_KEYS})
        GROUP BY rank"""


def _per_rank(con, run: str) -> pl.DataFrame:
    return once((con, "per_rank_step_sums", run), lambda: frame(con, _per_rank_sql(run)))


def idle(con, run: str) -> list[Finding]:
    """Ranks waiting for their peers, beside the rank they waited for."""
    per = _per_rank(con, run).filter(pl.col("idle_step_us").is_not_null()).select(
        "rank", idle_ms=pl.col("idle_us") / 1000.0, step_ms=pl.col("idle_step_us") / 1000.0)
    if per.height < 2:
        return []
    per = per.with_columns(pct=100 * pl.col("idle_ms") / pl.col("step_ms")).sort(
        ["pct", "rank"], descending=[True, False])
    pct = 100 * per["idle_ms"].sum() / per["step_ms"].sum()
    if pct < MIN_IDLE_PCT:
        return []
    stake = per["idle_ms"].sum() / per.height  # wall time: the mean rank's idle time
    # the rank that waits most is a victim: name the rank the others' wait is charged to (findings_sql)
    cause = first_row(con, S.waited_for_sql(run))  # idle_sql returns it beside the idle numbers
    n = {"idle_pct": rnd(pct, 2), "worst_rank": per["rank"][0], "worst_rank_idle_pct": rnd(per["pct"][0], 2),
         **{k: rnd(cause.get(k)) for k in ("waited_for_role", "waited_for_rank", "waited_for_host",
                                            "waited_for_phase", "waited_for_ms", "waited_for_pct")}}
    return [found(run, "idle", "warning" if pct >= WARN_IDLE_PCT else "info", n, S.idle_sql(run), stake, pct)]


def remainder(con, run: str) -> list[Finding]:
    """Step time outside every top-level phase, when it is a large share."""
    rem = _per_rank(con, run).filter(pl.col("rem_step_us").is_not_null())
    if rem.is_empty():
        return []
    rem_ms = rem["rem_us"].sum() / 1000.0
    pct = 100 * rem_ms / (rem["rem_step_us"].sum() / 1000.0)
    if pct < MIN_UNINSTRUMENTED_PCT:
        return []
    stake = rem_ms / rem.height
    return [found(run, "uninstrumented", "info", {"uninstrumented_pct": rnd(pct, 2), "uninstrumented_ms": rnd(rem_ms)},
                  S.uninstrumented_sql(run), stake, pct)]
