"""Where each synchronous step's time goes: per-phase breakdown, idle/wait time, and the critical path.

Definitions shared by the cluster analyses (stragglers, what-if, throughput import them from here):

- A *step row* is the probe's ``phase='step', category='step'`` row spanning one rank's step boundary to
  boundary. Trace imports have none, so step-level results are simply empty for trace-only runs.
- A *top-level row* is a timing row directly inside the step: ``parent`` NULL, empty or ``'step'``,
  category ``phase`` (or NULL), ``wait`` or ``comm``. Nested phases (``forward`` inside ``train``) are left
  out of sums so nothing is counted twice. Rows with a ``stream`` are GPU activity imported from a trace
  (kernels, NCCL, CUDA syncs) and annotations are profiler ranges: neither is ever a step phase.
- *Sync rows* are top-level rows of category ``wait`` or ``comm``: collectives and barriers, where a rank
  blocks for its peers. *Busy* time is the sum of the other top-level rows.
- Ranks are compared within a ``(run_id, role)`` group: trainers with trainers, rollout workers with
  rollout workers.
"""

from __future__ import annotations

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.store import quote_literal

__all__ = ["critical_path", "idle_time", "step_breakdown"]

KEYS = "run_id, role, rank, step"
TOP_LEVEL = (
    "step IS NOT NULL AND phase IS NOT NULL AND phase <> 'step' AND stream IS NULL "
    "AND coalesce(parent, '') IN ('', 'step') "
    "AND coalesce(category, 'phase') IN ('phase', 'wait', 'comm')"
)
STEP_ROW = "step IS NOT NULL AND stream IS NULL AND (category = 'step' OR (category IS NULL AND phase = 'step'))"
SYNC = "coalesce(category, 'phase') IN ('wait', 'comm')"
# The phase name of a step's time outside its top-level rows (what no row covers).
REMAINDER = "(uninstrumented)"


def _run_key(run: str | None, with_run: bool) -> str:
    """The run_id key of a per-run grouping: left out when asked for one run's rows only (a constant key
    costs the group-bys and joins over millions of rows a quarter of their time)."""
    if not with_run and run is None:
        raise ValueError("only one run's rows can be grouped without run_id")
    return "run_id, " if with_run else ""


# The columns every per-rank step query reads, the role NULL-coalesced so roles group and join as ''.
_COLS = f"coalesce(role, '') AS role, rank, step, phase, {SYNC} AS sync, dur_us, start_us"


def _phases(r: str, rows: str) -> str:
    return f"""SELECT {r}role, rank, step, phase, bool_or(sync) AS sync, SUM(dur_us) AS dur_us,
                      MIN(start_us) AS start_us
               FROM {rows} GROUP BY {r}role, rank, step, phase"""


def _steps(r: str, rows: str) -> str:
    return f"""SELECT {r}role, rank, step, MAX(dur_us) AS step_us, MIN(start_us) AS start_us
               FROM {rows} GROUP BY {r}role, rank, step"""


def top_level_sql(run: str | None, with_run: bool = True) -> str:
    """Top-level phase rows summed per rank, step and phase (``dur_us``; ``sync`` marks wait/comm);
    ``with_run=False`` (``run`` given): without the run_id column."""
    r = _run_key(run, with_run)
    return _phases(r, f"(SELECT {r}{_COLS} FROM timings WHERE {TOP_LEVEL}{run_clause(run)})")


def step_rows_sql(run: str | None, with_run: bool = True) -> str:
    """One row per rank and step: ``step_us`` (the probe's boundary-to-boundary span) and ``start_us``;
    ``with_run`` as in ``top_level_sql``."""
    r = _run_key(run, with_run)
    return _steps(r, f"(SELECT {r}{_COLS} FROM timings WHERE {STEP_ROW}{run_clause(run)})")


def scan_sql(run: str | None, with_run: bool = True) -> str:
    """CTEs for a ``WITH``: ``ph`` (as ``top_level_sql``) and ``st`` (as ``step_rows_sql``), both from one
    materialized scan of timings, ``scan``. A query that needs both uses these: on a live run each scan lists
    and opens every writer's files, which costs more than the rows (at rest, holding the rows costs a few
    percent; docs/scale.md)."""
    r = _run_key(run, with_run)
    # IS TRUE: STEP_ROW is NULL, not false, on a top-level row whose category is NULL
    return f"""
        scan AS MATERIALIZED (
            SELECT {r}{_COLS}, ({STEP_ROW}) IS TRUE AS is_step
            FROM timings WHERE (({TOP_LEVEL}) OR ({STEP_ROW})){run_clause(run)}),
        ph AS ({_phases(r, "scan WHERE NOT is_step")}),
        st AS ({_steps(r, "scan WHERE is_step")})"""


def step_breakdown(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """Time per top-level phase for every rank and step, plus the un-instrumented remainder.

    Columns: run_id, role, rank, step, phase, category, dur_ms, step_ms, share_pct. The remainder is a row
    with phase ``(uninstrumented)`` and category ``remainder``: step time minus the top-level rows (floored
    at 0, since overlapping rows could otherwise make it negative). ``step_ms``/``share_pct`` are NULL for
    steps without a step row. Rows come in no set order: sort them where order matters.
    """
    return frame(as_store(store), f"""
        WITH {scan_sql(run)},
        tot AS (SELECT {KEYS}, SUM(dur_us) AS phases_us FROM ph GROUP BY ALL)
        SELECT ph.run_id, ph.role, ph.rank, ph.step, ph.phase,
               CASE WHEN ph.sync THEN 'wait' ELSE 'phase' END AS category,
               ph.dur_us / 1000.0 AS dur_ms, st.step_us / 1000.0 AS step_ms,
               100.0 * ph.dur_us / nullif(st.step_us, 0) AS share_pct
        FROM ph LEFT JOIN st USING ({KEYS})
        UNION ALL
        SELECT st.run_id, st.role, st.rank, st.step, {quote_literal(REMAINDER)}, 'remainder',
               greatest(st.step_us - coalesce(tot.phases_us, 0), 0) / 1000.0, st.step_us / 1000.0,
               100.0 * greatest(st.step_us - coalesce(tot.phases_us, 0), 0) / nullif(st.step_us, 0)
        FROM st LEFT JOIN tot USING ({KEYS})""")


def idle_time(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """Per rank and step: time spent waiting for peers.

    Columns: run_id, role, rank, step, step_ms, busy_ms, wait_ms, sync_wait_ms, idle_ms, idle_pct.
    ``wait_ms`` is the measured time in top-level collectives/barriers (category wait/comm).
    ``sync_wait_ms`` is the synchronous-step wait implied by the busy times: the slowest rank's busy time in
    that step minus this rank's. When the barrier is instrumented the two measure the same wait, so
    ``idle_ms = max(wait_ms, sync_wait_ms)`` rather than their sum (never double counted).
    """
    con = as_store(store)
    return frame(con, f"""
        WITH {scan_sql(run)},
        per AS (
            SELECT {KEYS},
                   SUM(CASE WHEN sync THEN 0 ELSE dur_us END) AS busy_us,
                   SUM(CASE WHEN sync THEN dur_us ELSE 0 END) AS wait_us
            FROM ph GROUP BY ALL),
        w AS (
            SELECT *, MAX(busy_us) OVER (PARTITION BY run_id, role, step) - busy_us AS sync_us FROM per)
        SELECT w.run_id, w.role, w.rank, w.step, st.step_us / 1000.0 AS step_ms,
               w.busy_us / 1000.0 AS busy_ms, w.wait_us / 1000.0 AS wait_ms, w.sync_us / 1000.0 AS sync_wait_ms,
               greatest(w.wait_us, w.sync_us) / 1000.0 AS idle_ms,
               100.0 * greatest(w.wait_us, w.sync_us) / nullif(st.step_us, 0) AS idle_pct
        FROM w LEFT JOIN st USING ({KEYS})
        ORDER BY run_id, role, step, rank""")


def critical_path(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """Which rank and phase bound each synchronous step.

    The bound rank is the one with the most busy time (the others end up waiting for it). Its bound phase is
    the phase where it exceeds the cross-rank median of that phase by the most; ``longest_phase`` is its
    single longest phase, for steps where no rank stands out.

    Columns: run_id, role, step, ranks, step_ms (longest step row), bound_rank, bound_busy_ms,
    median_busy_ms, bound_phase, bound_phase_ms, phase_median_ms, phase_excess_ms, longest_phase.
    """
    con = as_store(store)
    return frame(con, f"""
        WITH {scan_sql(run)},
        busy AS (
            SELECT {KEYS}, SUM(dur_us) AS busy_us FROM ph WHERE NOT sync GROUP BY ALL),
        bound AS (
            SELECT run_id, role, step, COUNT(*) AS ranks, arg_max(rank, busy_us) AS bound_rank,
                   MAX(busy_us) AS bound_busy_us, median(busy_us) AS median_busy_us
            FROM busy GROUP BY ALL),
        med AS (
            SELECT run_id, role, step, phase, median(dur_us) AS med_us
            FROM ph WHERE NOT sync GROUP BY ALL),
        cand AS (
            SELECT b.run_id, b.role, b.step, ph.phase, ph.dur_us, ph.dur_us - med.med_us AS excess_us, med.med_us
            FROM bound b
            JOIN ph ON ph.run_id = b.run_id AND ph.role = b.role AND ph.step = b.step
                   AND ph.rank = b.bound_rank AND NOT ph.sync
            JOIN med ON med.run_id = b.run_id AND med.role = b.role AND med.step = b.step
                    AND med.phase = ph.phase),
        pick AS (
            SELECT run_id, role, step,
                   arg_max(phase, excess_us * 1e6 + dur_us) AS bound_phase,
                   arg_max(dur_us, excess_us * 1e6 + dur_us) AS phase_us,
                   arg_max(med_us, excess_us * 1e6 + dur_us) AS phase_med_us,
                   MAX(excess_us) AS excess_us, arg_max(phase, dur_us) AS longest_phase
            FROM cand GROUP BY ALL),
        smax AS (SELECT run_id, role, step, MAX(step_us) AS step_us FROM st GROUP BY ALL)
        SELECT b.run_id, b.role, b.step, b.ranks, smax.step_us / 1000.0 AS step_ms, b.bound_rank,
               b.bound_busy_us / 1000.0 AS bound_busy_ms, b.median_busy_us / 1000.0 AS median_busy_ms,
               p.bound_phase, p.phase_us / 1000.0 AS bound_phase_ms, p.phase_med_us / 1000.0 AS phase_median_ms,
               p.excess_us / 1000.0 AS phase_excess_ms, p.longest_phase
        FROM bound b LEFT JOIN pick p USING (run_id, role, step)
        LEFT JOIN smax USING (run_id, role, step)
        ORDER BY b.run_id, b.role, b.step""")
