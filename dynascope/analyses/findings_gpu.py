"""Findings from GPU activity (imported profiler traces): how much of their busy span the GPUs sat idle.

- ``gpu_idle``: HTA's temporal breakdown (``gpu_timeline.temporal_breakdown``) per rank, summed: the mean
  rank's idle share of the span from its first kernel's start to its last kernel's end, the rank that
  idles most, and the idle time. Raised from ``MIN_GPU_IDLE_PCT``, a warning from ``WARN_GPU_IDLE_PCT``.

Numbers and query as in ``findings``: the numbers are the first row of the finding's own SQL.
"""

from __future__ import annotations

from typing import Any

from dynascope.analyses._findings import Finding, first_row, found, rnd
from dynascope.analyses.gpu_timeline import temporal_breakdown_sql
from dynascope.store import quote_literal

__all__: list[str] = []  # generators for ``findings.GENERATORS``, not public analyses

MIN_GPU_IDLE_PCT = 5.0  # a GPU idle under 5% of its span is launch gaps, not a bottleneck
WARN_GPU_IDLE_PCT = 30.0


def gpu_idle_sql(run: str) -> str:
    """The GPU-idle finding's numbers, over ``temporal_breakdown``'s rows of the run."""
    return f"""SELECT count(*) AS ranks, avg(idle_time_pct) AS mean_idle_pct,
        arg_max(rank, idle_time_pct) AS worst_rank, max(idle_time_pct) AS worst_rank_idle_pct,
        sum(idle_time_us) / 1000.0 AS idle_ms, sum(kernel_time_us) / 1000.0 AS kernel_span_ms
        FROM ({temporal_breakdown_sql(run)}) WHERE run_id = {quote_literal(run)}"""


def gpu_idle(con: Any, run: str) -> list[Finding]:
    """One finding when the run's GPUs sat idle a large share of their busy span."""
    has_gpu = con.rows(f"SELECT count(*) FROM timings WHERE run_id = {quote_literal(run)} AND stream IS NOT NULL "
                       "AND stream >= 0 LIMIT 1")[0][0]
    if not has_gpu:
        return []
    sql = gpu_idle_sql(run)
    r = first_row(con, sql)
    if not r or r["mean_idle_pct"] is None or r["mean_idle_pct"] < MIN_GPU_IDLE_PCT:
        return []
    n = {k: rnd(v, 2) for k, v in r.items()}
    stake = r["idle_ms"] / max(r["ranks"], 1)  # wall time: the mean rank's idle time
    return [found(run, "gpu_idle", "warning" if r["mean_idle_pct"] >= WARN_GPU_IDLE_PCT else "info", n, sql,
                  stake, r["mean_idle_pct"])]
