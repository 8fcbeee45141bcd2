"""Each rank-step's top-level rows cut into segments at its sync rows: what ``what_if`` and the schedule
what-if read (the model is in ``stragglers``' docstring).

A run of 8 ranks × 34k steps holds 1.65M top-level rows, so the SQL is shaped for few passes over them:

- run_id, role and phase are read as ENUMs of the names present (``vocabulary``), so every GROUP BY, join
  and materialised CTE over these rows works on small integers instead of strings;
- one aggregate (``ks``) over the top-level rows and the step rows together gives everything per rank-step:
  the step row's span, the covered time, the sync rows' start times, and whether a phase repeats;
- the rows of a rank-step where no phase repeats (the usual case) are already one row per (segment,
  phase): only the rank-steps with a repeat go through the GROUP BY that sums them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, TypeVar

import duckdb
import polars as pl

from dynascope.analyses._common import frame, run_clause
from dynascope.analyses.steps import REMAINDER, STEP_ROW, SYNC, TOP_LEVEL
from dynascope.store import StoreConnection, quote_literal

KEYS = "run_id, role, rank, step"
T = TypeVar("T")


class Vocabulary(NamedTuple):
    """ENUM types of the run ids, roles and phases of the timing rows (REMAINDER is always a phase)."""

    run_ids: str
    roles: str
    phases: str


def _enum(values: list[str]) -> str:
    return "ENUM(" + ", ".join(quote_literal(v) for v in sorted(set(values))) + ")"


def vocabulary(store: StoreConnection, run: str | None) -> Vocabulary:
    """The names the ENUMs need, read from the step-bearing timing rows."""
    run_ids = "NULL" if run is not None else "list(DISTINCT run_id) FILTER (WHERE run_id IS NOT NULL)"
    runs, roles, phases = store.rows(f"""
        SELECT {run_ids}, list(DISTINCT coalesce(role, '')), list(DISTINCT phase) FILTER (WHERE phase IS NOT NULL)
        FROM timings WHERE step IS NOT NULL{run_clause(run)}""")[0]
    if run is not None:  # the rows read are the run's own
        runs = [run]
    return Vocabulary(_enum(runs or [""]), _enum(roles or [""]), _enum([*(phases or []), REMAINDER]))


def with_vocabulary(store: StoreConnection, run: str | None, query: Callable[[Vocabulary], T]) -> T:
    """``query(vocabulary)``. A name written between reading the vocabulary and the query (a live run)
    fails the ENUM cast; the query then runs again with the names read anew."""
    for attempt in range(3):
        try:
            return query(vocabulary(store, run))
        except duckdb.ConversionException:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def frame_with_vocabulary(store: StoreConnection, run: str | None,
                          sql: Callable[[Vocabulary], str]) -> pl.DataFrame:
    """``frame(store, sql(vocabulary))``, read again if a name arrives meanwhile (``with_vocabulary``)."""
    return with_vocabulary(store, run, lambda v: frame(store, sql(v)))


def seg_sql(at: str, ks: str = "ks.") -> str:
    """Segment of a row starting at ``at``: how many of its rank-step's sync rows start before it (a row
    at the same start as a sync row precedes it). One sync row, the usual case, needs no list."""
    return (f"(CASE WHEN {ks}syncs = 0 THEN 0 WHEN {ks}syncs = 1 THEN ({at} > {ks}sync1_us)::INTEGER "
            f"ELSE len(list_filter({ks}sync_us, lambda x: x < {at})) END)::BIGINT")


def keyed_sql(run: str | None, v: Vocabulary, columns: str = "", aggregates: str = "",
              having: str = "") -> str:
    """CTEs ``t`` (top-level rows and step rows, ``is_step`` marking the latter; ``columns`` adds columns,
    computed from timings' own columns) and ``ks`` (one row per rank-step with a step row: step_us,
    covered, last_us, syncs, sync1_us, sync_us, plus ``aggregates``; ``having`` narrows it
    further)."""
    top = "FILTER (WHERE NOT is_step)"
    return f"""
        t AS MATERIALIZED (
            SELECT run_id::{v.run_ids} AS run_id, coalesce(role, '')::{v.roles} AS role, rank, step,
                   phase::{v.phases} AS phase, ({STEP_ROW}) AS is_step, {SYNC} AS sync, start_us, dur_us{columns}
            FROM timings WHERE (({TOP_LEVEL}) OR ({STEP_ROW})){run_clause(run)}),
        ks AS MATERIALIZED (
            SELECT {KEYS}, MAX(dur_us) FILTER (WHERE is_step)::DOUBLE AS step_us,
                   SUM(dur_us) {top} AS covered, MAX(start_us) {top} AS last_us,
                   COUNT(*) FILTER (WHERE sync) AS syncs, MIN(start_us) FILTER (WHERE sync) AS sync1_us,
                   list(start_us) FILTER (WHERE sync) AS sync_us{aggregates}
            FROM t GROUP BY ALL HAVING bool_or(is_step){having})"""


def rows_sql(run: str | None, v: Vocabulary, materialized: bool = False) -> str:
    """CTEs of ``keyed_sql`` and ``rows``: top-level rows summed per (rank, step, segment, phase), plus each
    rank's remainder row (step time not covered by top-level rows, busy time in its last segment), with
    the cross-rank median of each busy (step, segment, phase) as ``med_us`` (``materialized``: for a
    query that reads ``rows`` more than once)."""
    cols = f"t.run_id, t.role, t.rank, t.step, {seg_sql('t.start_us')} AS seg, t.phase, t.sync"
    # A phase repeats in a rank-step when it has more top-level rows than distinct phase bits; ids beyond
    # 64 share bits, which can only flag a repeat that is not there (and send the rank-step the exact way).
    repeats = (", COUNT(*) FILTER (WHERE NOT is_step) > coalesce(bit_count("
               "bit_or(1::UBIGINT << (enum_code(phase) % 64)) FILTER (WHERE NOT is_step)), 0) AS repeats")
    return f"""{keyed_sql(run, v, aggregates=repeats)},
        segs AS MATERIALIZED (
            SELECT {cols}, t.dur_us::DOUBLE AS dur_us
            FROM t JOIN ks USING ({KEYS}) WHERE NOT t.is_step AND NOT ks.repeats
            UNION ALL
            SELECT {cols}, SUM(t.dur_us)::DOUBLE
            FROM t JOIN (SELECT * FROM ks WHERE repeats) ks USING ({KEYS}) WHERE NOT t.is_step GROUP BY ALL
            UNION ALL
            SELECT {KEYS}, {seg_sql('ks.last_us')}, {quote_literal(REMAINDER)}, false, step_us - coalesce(covered, 0.0)
            FROM ks),
        rows AS {'MATERIALIZED ' if materialized else ''}(
            SELECT segs.*, med.med_us FROM segs LEFT JOIN (
                SELECT run_id, role, step, seg, phase, median(dur_us) AS med_us FROM segs WHERE NOT sync GROUP BY ALL
            ) med USING (run_id, role, step, seg, phase))"""
