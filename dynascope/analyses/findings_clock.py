"""Findings from the ranks' measured clock offsets (``analyses.clocks``).

- ``clock_offset``: the rank whose wall clock is furthest from its reference rank's, raised from
  ``MIN_CLOCK_OFFSET_MS`` (NTP keeps nodes within a few ms; beyond that, cross-rank timelines built from the
  raw ``*_us`` columns misplace that rank's spans), a warning from ``WARN_CLOCK_OFFSET_MS``.
"""

from __future__ import annotations

from typing import Any

from dynascope.analyses._findings import Finding, first_row, found, rnd
from dynascope.store import quote_literal
from dynascope.store.clock_offsets import OFFSETS_SQL

__all__: list[str] = []  # generators for ``findings.GENERATORS``, not public analyses

MIN_CLOCK_OFFSET_MS = 10.0
WARN_CLOCK_OFFSET_MS = 1000.0


def clock_offset_sql(run: str) -> str:
    """The furthest rank's offset, and how many ranks were measured."""
    return f"""SELECT count(*) AS ranks, arg_max(rank, abs(offset_us)) AS worst_rank,
        arg_max(role, abs(offset_us)) AS worst_role, arg_max(offset_us, abs(offset_us)) / 1000.0 AS offset_ms,
        arg_max(spread_us, abs(offset_us)) / 2000.0 AS uncertainty_ms,
        arg_max(reference_rank, abs(offset_us)) AS reference_rank
        FROM ({OFFSETS_SQL}) WHERE run_id = {quote_literal(run)}"""


def clock_offset(con: Any, run: str) -> list[Finding]:
    """One finding when a rank's clock was measured far enough from its reference rank's to mislead."""
    sql = clock_offset_sql(run)
    r = first_row(con, sql)
    if not r or not r["ranks"] or r["offset_ms"] is None or abs(r["offset_ms"]) < MIN_CLOCK_OFFSET_MS:
        return []
    n = {k: rnd(v, 3) for k, v in r.items()}
    return [found(run, "clock_offset", "warning" if abs(r["offset_ms"]) >= WARN_CLOCK_OFFSET_MS else "info", n, sql)]
