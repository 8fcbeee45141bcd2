"""Stragglers: which rank is slow in which phase, and what it costs.

``straggler_scores`` follows NVIDIA's straggler detection (nvidia-resiliency-ext): within a window of steps
a rank's *relative performance score* for a phase is the reference rank's median time divided by this
rank's median time (1.0 = as fast as the reference, 0.5 = twice as slow). A rank is flagged in a window when
its score is below ``threshold``; flagged in more than ``persistent_frac`` of the windows it is a
*persistent* straggler, in fewer a *transient* one.

``what_if`` follows ByteDance's what-if analysis (OSDI'25, "Understanding Stragglers in Large Model Training
Using What-if Analysis"): re-simulate each step with some ranks' phase durations replaced by the cross-rank
median and report the step time saved. The simulation model, per ``(run_id, role, step)``:

    Each rank's top-level rows (see ``steps``) are ordered by start time and cut into segments at its sync
    rows (category wait/comm): segment k holds the busy rows after the k-th sync and before the (k+1)-th,
    and ends with that sync row. The rank's un-instrumented remainder (step row − all top-level rows) is
    busy time in its last segment. Then

        step_time = Σ_k ( max_r busy[r, k] + min_r sync[r, k] )

    i.e. every segment lasts as long as its slowest rank's busy time, plus the collective's own cost, which
    is what the least-waiting rank (the one that arrived last) spent in it. A replaced rank's busy rows take
    the median over ranks of the same (step, segment, phase). With nothing replaced this reproduces the
    measured step time (the longest step row) whenever the slowest rank is also the one that waits least,
    which holds for synchronous steps; ``reproduction_error_pct`` reports how far off it is otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.analyses._rank_steps import rank_steps
from dynascope.analyses._timing_rows import Vocabulary, frame_with_vocabulary, rows_sql
from dynascope.analyses._what_if_frames import what_if_frame, what_if_steps_frame
from dynascope.analyses.steps import REMAINDER as REMAINDER  # stragglers_shared reads it here
from dynascope.store import quote_literal

__all__ = ["straggler_scores", "what_if", "what_if_steps"]

_G = ["run_id", "role", "step"]


def straggler_scores(store: StoreLike, run: str | None = None, *, window: int = 10, threshold: float = 0.75,
                     reference: str = "fastest", persistent_frac: float = 0.5,
                     min_median_ms: float = 5.0) -> pl.DataFrame:
    """Per rank and phase: relative performance score over windows of ``window`` steps.

    ``reference`` is ``"fastest"`` (NVIDIA's default: the fastest rank's median) or ``"median"`` (the
    cross-rank median). Columns: run_id, role, rank, phase, steps, windows, flagged_windows, score (median
    over windows), median_ms, cross_rank_median_ms, slowdown_x (1 / score: how many times slower than the
    reference), slow_steps_pct (steps whose per-step score is below threshold), excess_ms (time at stake:
    per window, the rank's median beyond the cross-rank median times the window's steps, summed over the
    run), status (persistent | transient | ok). Rows come most time at stake first.
    A phase whose median is under ``min_median_ms`` on every rank is left out: a 1 ms phase twice as slow
    on one rank scores like a real straggler but costs nothing worth chasing.
    Phases are all ``category='phase'`` rows at any nesting level, summed per step and named by their
    place: ``backward`` at the top level, ``train/forward`` for a forward inside train (a forward in
    rollout is different work). Only phases seen on at least two ranks in a step are compared.
    """
    if reference not in ("fastest", "median"):
        raise ValueError(f"reference must be 'fastest' or 'median', not {reference!r}")
    if window < 1 or not 0 < threshold <= 1:
        raise ValueError("window must be ≥ 1 and threshold in (0, 1]")
    if not min_median_ms >= 0:
        raise ValueError("min_median_ms must be ≥ 0")
    agg = "MIN" if reference == "fastest" else "median"
    thr = float(threshold)
    con = as_store(store)
    return frame(con, f"""
        WITH d AS (
            SELECT run_id, coalesce(role, '') AS role, rank, step,
                   CASE WHEN coalesce(parent, '') IN ('', 'step') THEN phase ELSE parent || '/' || phase END AS phase,
                   SUM(dur_us) AS dur_us
            FROM timings
            WHERE step IS NOT NULL AND phase IS NOT NULL AND phase <> 'step' AND stream IS NULL
              AND coalesce(category, 'phase') = 'phase'{run_clause(run)}
            GROUP BY ALL),
        g AS (
            SELECT *, (step - MIN(step) OVER (PARTITION BY run_id, role)) // {int(window)} AS win,
                   COUNT(*) OVER (PARTITION BY run_id, role, step, phase) AS nranks,
                   {agg}(dur_us) OVER (PARTITION BY run_id, role, step, phase) AS step_ref_us
            FROM d),
        wm AS (
            SELECT run_id, role, rank, phase, win, median(dur_us) AS rank_med_us, COUNT(*) AS n,
                   SUM(CASE WHEN step_ref_us / nullif(dur_us, 0) < {thr} THEN 1 ELSE 0 END) AS slow_steps
            FROM g WHERE nranks >= 2 GROUP BY ALL),
        ws AS (
            SELECT *, {agg}(rank_med_us) OVER w / nullif(rank_med_us, 0) AS score,
                   median(rank_med_us) OVER w AS cross_med_us
            FROM wm WINDOW w AS (PARTITION BY run_id, role, phase, win)),
        agg AS (
            SELECT run_id, role, rank, phase, SUM(n)::BIGINT AS steps, COUNT(*) AS windows,
                   SUM(CASE WHEN score < {thr} THEN 1 ELSE 0 END)::BIGINT AS flagged_windows,
                   median(score) AS score, median(rank_med_us) / 1000.0 AS median_ms,
                   median(cross_med_us) / 1000.0 AS cross_rank_median_ms,
                   100.0 * SUM(slow_steps) / SUM(n) AS slow_steps_pct,
                   SUM(greatest(rank_med_us - cross_med_us, 0) * n) / 1000.0 AS excess_ms
            FROM ws GROUP BY ALL)
        SELECT run_id, role, rank, phase, steps, windows, flagged_windows, score, median_ms,
               cross_rank_median_ms, 1.0 / nullif(score, 0) AS slowdown_x, slow_steps_pct, excess_ms,
               CASE WHEN flagged_windows > {float(persistent_frac)} * windows THEN 'persistent'
                    WHEN flagged_windows > 0 THEN 'transient' ELSE 'ok' END AS status
        FROM agg
        QUALIFY MAX(median_ms) OVER (PARTITION BY run_id, role, phase) >= {float(min_median_ms)}
        ORDER BY excess_ms DESC, score ASC NULLS LAST, run_id, role, rank, phase""")


def _in(col: str, values: Iterable[str | int] | None) -> str:
    """SQL truth value of ``col IN values`` (TRUE for None: no restriction)."""
    if values is None:
        return "TRUE"
    vals = [quote_literal(v) if isinstance(v, str) else str(int(v)) for v in values]
    return f"{col} IN ({', '.join(vals)})" if vals else "FALSE"


def _per_rank_sql(rows: str, replace: str) -> str:
    """Busy and sync µs per (step, segment, rank), and ``new_busy`` with the rows where ``replace`` holds
    set to their median (SQL over the relation ``rows``)."""
    return f"""
        SELECT run_id, role, step, seg, rank,
               coalesce(SUM(dur_us) FILTER (WHERE NOT sync), 0.0) AS busy,
               coalesce(SUM(CASE WHEN {replace} THEN med_us ELSE dur_us END) FILTER (WHERE NOT sync), 0.0) AS new_busy,
               coalesce(SUM(dur_us) FILTER (WHERE sync), 0.0) AS sync
        FROM {rows} GROUP BY ALL"""


def _segments_sql(per_rank: str) -> str:
    """Per (step, segment): the two largest busy times (``top``), the largest replaced busy time and the
    least sync time; a segment lasts top[1] + min_sync as measured, max_new + min_sync replaced."""
    return f"""
        SELECT run_id, role, step, seg, max(busy, 2) AS top, MAX(new_busy) AS max_new, MIN(sync) AS min_sync
        FROM {per_rank} GROUP BY ALL"""


def _simulate_sql(segments: str) -> str:
    """Simulated step time (µs) per step, as measured (``sim_us``) and replaced (``new_us``)."""
    return f"""
        SELECT run_id, role, step, SUM(top[1] + min_sync) AS sim_us, SUM(max_new + min_sync) AS new_us
        FROM {segments} GROUP BY ALL"""


_STEP_SCHEMA = {"run_id": pl.String, "role": pl.String, "step": pl.Int64, "ranks": pl.UInt32,
                "measured_ms": pl.Float64, "simulated_base_ms": pl.Float64, "simulated_ms": pl.Float64,
                "saved_ms": pl.Float64}


def what_if_steps(store: StoreLike, run: str | None = None, *, ranks: Iterable[int] | str | None = None,
                  phases: Iterable[str] | None = None) -> pl.DataFrame:
    """Per step: measured step time, the simulated time as measured, and simulated with replacement.

    ``ranks``: None replaces nothing, ``"all"`` every rank, or a list of ranks; ``phases``: None means every
    busy phase including the un-instrumented remainder. Columns: run_id, role, step, ranks, measured_ms,
    simulated_base_ms, simulated_ms, saved_ms.
    """
    con = as_store(store)
    if (rs := rank_steps(con, run)) is not None:
        return what_if_steps_frame(rs, ranks, phases, _STEP_SCHEMA)
    if ranks is None:
        replace = "FALSE"
    else:
        replace = f"{'TRUE' if ranks == 'all' else _in('rank', ranks)} AND {_in('phase', phases)}"

    def sql(v: Vocabulary) -> str:
        return f"""
        WITH {rows_sql(run, v)},
        pr AS ({_per_rank_sql('rows', replace)}),
        sg AS ({_segments_sql('pr')}),
        sim AS ({_simulate_sql('sg')}),
        measured AS (SELECT run_id, role, step, COUNT(*) AS ranks, MAX(step_us) AS step_us FROM ks GROUP BY ALL)
        SELECT run_id::VARCHAR AS run_id, role::VARCHAR AS role, step, ranks, step_us / 1e3 AS measured_ms,
               sim_us / 1e3 AS simulated_base_ms, new_us / 1e3 AS simulated_ms, (sim_us - new_us) / 1e3 AS saved_ms
        FROM measured JOIN sim USING (run_id, role, step)
        ORDER BY run_id, role, step"""
    df = frame_with_vocabulary(con, run, sql)
    return df.cast(_STEP_SCHEMA) if not df.is_empty() else pl.DataFrame(schema=_STEP_SCHEMA)


_WHAT_IF_SCHEMA = {"run_id": pl.String, "role": pl.String, "scenario": pl.String, "rank": pl.Int64,
                   "phase": pl.String, "steps": pl.UInt32, "measured_ms": pl.Float64,
                   "simulated_base_ms": pl.Float64, "simulated_ms": pl.Float64, "saved_ms": pl.Float64,
                   "saved_pct": pl.Float64, "reproduction_error_pct": pl.Float64}


def what_if(store: StoreLike, run: str | None = None, *, ranks: Iterable[int] | None = None,
            phases: Iterable[str] | None = None, by_phase: bool = False) -> pl.DataFrame:
    """Step time saved if a rank (each rank in turn, and all ranks at once) ran at the cross-rank median.

    One scenario per rank (``ranks`` limits which) plus ``"all ranks"``; with ``by_phase`` also one per
    (rank, phase). ``phases`` limits which phases are replaced (None: all busy phases and the remainder).
    Totals are over all steps: saved_pct = saved_ms / simulated_base_ms; reproduction_error_pct compares
    the unreplaced simulation with the measured step times (see the module docstring for the model).

    With only rank r replaced, a segment's slowest busy time is max(slowest other rank, r's replaced
    busy), and the slowest other rank is the segment's top value, or its second one when r alone holds the
    top; so every one-rank scenario is priced in one pass. ``_what_if_frames`` does it over the rows read
    once and sorted (``_rank_steps``); the SQL below, the same model, runs for rows it does not take.
    """
    con = as_store(store)
    if (rs := rank_steps(con, run)) is not None:
        return what_if_frame(rs, ranks, phases, by_phase, _WHAT_IF_SCHEMA)
    chosen = _in("rank", ranks)
    by_phase_sql = "" if not by_phase else f"""
        UNION ALL
        SELECT k.run_id, k.role, k.rank, 'rank ' || k.rank || ' ' || ph.phase, ph.phase::VARCHAR,
               coalesce(bp.saved_us, 0.0)
        FROM (SELECT DISTINCT run_id, role, rank FROM pr WHERE {chosen}) k
        CROSS JOIN (SELECT DISTINCT phase FROM rows WHERE NOT sync AND {_in('phase', phases)}) ph
        LEFT JOIN (
            SELECT d.run_id, d.role, d.rank, d.phase,
                   SUM(o.max1 - greatest(o.other, o.busy + d.delta)) AS saved_us
            FROM (SELECT run_id, role, step, seg, rank, phase, SUM(med_us - dur_us) AS delta
                  FROM rows WHERE NOT sync GROUP BY ALL) d
            JOIN other o USING (run_id, role, step, seg, rank)
            GROUP BY ALL) bp USING (run_id, role, rank, phase)"""

    def sql(v: Vocabulary) -> str:
        return f"""
        WITH {rows_sql(run, v, materialized=by_phase)},
        pr AS MATERIALIZED ({_per_rank_sql('rows', _in('phase', phases))}),
        sg AS MATERIALIZED ({_segments_sql('pr')}),
        sim AS ({_simulate_sql('sg')}),
        measured AS (SELECT run_id, role, step, MAX(step_us) AS step_us FROM ks GROUP BY ALL),
        tot AS (SELECT run_id, role, COUNT(*) AS steps, SUM(step_us) AS step_us, SUM(sim_us) AS sim_us,
                       SUM(sim_us - new_us) AS all_saved_us
                FROM measured JOIN sim USING (run_id, role, step) GROUP BY ALL),
        -- the slowest other rank: top[2] for the rank holding top[1] (equal to it on a tie), else top[1]
        other AS (
            SELECT pr.run_id, pr.role, pr.step, pr.seg, pr.rank, pr.busy, pr.new_busy, sg.top[1] AS max1,
                   coalesce(CASE WHEN pr.busy = sg.top[1] THEN sg.top[2] ELSE sg.top[1] END, 0.0) AS other
            FROM pr JOIN sg USING (run_id, role, step, seg)),
        res AS (
            SELECT run_id, role, rank, 'rank ' || rank AS scenario, NULL::VARCHAR AS phase,
                   SUM(max1 - greatest(other, new_busy)) AS saved_us
            FROM other WHERE {chosen} GROUP BY ALL{by_phase_sql}
            UNION ALL
            SELECT run_id, role, NULL, 'all ranks', NULL, all_saved_us FROM tot)
        SELECT res.run_id::VARCHAR AS run_id, res.role::VARCHAR AS role, scenario, rank::BIGINT AS rank, phase, steps,
               step_us / 1e3 AS measured_ms, sim_us / 1e3 AS simulated_base_ms,
               (sim_us - saved_us) / 1e3 AS simulated_ms, saved_us / 1e3 AS saved_ms,
               100 * saved_us / sim_us AS saved_pct, 100 * abs(sim_us - step_us) / step_us AS reproduction_error_pct
        FROM res JOIN tot USING (run_id, role)
        ORDER BY run_id, role, saved_ms DESC, scenario"""
    df = frame_with_vocabulary(con, run, sql)
    return df.cast(_WHAT_IF_SCHEMA) if not df.is_empty() else pl.DataFrame(schema=_WHAT_IF_SCHEMA)
