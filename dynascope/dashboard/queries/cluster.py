"""Cluster aggregates: per-rank phase timeline windows, phase breakdown and throughput (the per-rank busy
time, heat map and stragglers are in ``ranks``).

Timings follow the probe's convention: one ``phase='step', category='step'`` row per rank per step
spanning boundary to boundary, phases inside it (``parent`` NULL or 'step' for top-level phases).
"""

from __future__ import annotations

import polars as pl

from dynascope.dashboard.queries import BUCKET, MAX_POINTS, bounds_cte
from dynascope.dashboard.queries.ranks import straggler_table  # the per-rank table, also under its old home
from dynascope.store import StoreConnection, quote_literal

# Categories drawn on the Gantt unless the user asks for kernels; trace imports can hold millions.
_COARSE = "('phase', 'wait', 'comm', 'annotation')"


__all__ = ["gantt", "phase_breakdown", "ranks_clause", "straggler_table", "throughput", "timing_span"]

RECENT_STEPS = 50
Ranks = tuple[tuple[str, int], ...]  # (role, rank) pairs; roles may number their ranks from 0 each


def ranks_clause(ranks: Ranks | None) -> str:
    """`` AND`` a filter on (role, rank) pairs, or nothing when ``ranks`` is None (every rank)."""
    if ranks is None:
        return ""
    pairs = [f"(coalesce(role, '') = {quote_literal(role)} AND rank = {int(rank)})" for role, rank in ranks]
    return f" AND ({' OR '.join(pairs) or 'FALSE'})"


def timing_span(store: StoreConnection, run: str) -> pl.DataFrame:
    """First and last step with timings, whether fine-grained (kernel) rows exist, and
    ``typical_step``: the last step whose set of top-level phases is the most common one among the last
    ``RECENT_STEPS`` steps (the last step is often an evaluation or checkpoint step, a poor first view of the
    timeline; counting only recent steps keeps an earlier, longer stage such as SFT from winning), and
    ``phases``: every top-level phase of the run (one colour each on every chart of the page)."""
    from dynascope.analyses.steps import TOP_LEVEL

    r = f"run_id = {quote_literal(run)}"
    return store.frame(f"""
        WITH sp AS (SELECT DISTINCT step, phase FROM timings WHERE {r} AND {TOP_LEVEL}),  -- a list per row: slow
             sets AS (SELECT step, list_sort(list(phase)) AS phases FROM sp GROUP BY step),
             recent AS (SELECT * FROM sets ORDER BY step DESC LIMIT {RECENT_STEPS}),
             common AS (SELECT phases FROM recent GROUP BY phases ORDER BY count(*) DESC, max(step) DESC LIMIT 1)
        SELECT min(step) AS first_step, max(step) AS last_step, count(*) FILTER (WHERE category IN ('kernel', 'memcpy', 'cpu_op')) AS fine_rows,
               (SELECT max(step) FROM sets WHERE phases = (SELECT phases FROM common)) AS typical_step,
               (SELECT list_sort(list_distinct(flatten(list(phases)))) FROM sets) AS phases
        FROM timings WHERE {r} AND step IS NOT NULL""")


def gantt(store: StoreConnection, run: str, lo: int, hi: int, fine: bool = False, limit: int = 4000,
          ranks: Ranks | None = None) -> pl.DataFrame:
    """Phase intervals of steps lo..hi for ``ranks`` (every rank when None), in ms since the window's first start.

    When more than ``limit`` intervals fall in the window the longest are kept (``total`` says how many).
    """
    cats = "category <> 'step'" if fine else f"category IN {_COARSE}"
    where = (f"run_id = {quote_literal(run)} AND step BETWEEN {int(lo)} AND {int(hi)} AND start_us IS NOT NULL"
             + ranks_clause(ranks))
    return store.frame(f"""
        WITH w AS (SELECT coalesce(role, '') AS role, rank, step, phase, category, parent, start_us, dur_us
                   FROM timings WHERE {where} AND {cats}),
             t0 AS (SELECT min(start_us) AS t0, count(*) AS total FROM w)
        SELECT role, rank, step, phase, category, parent, (start_us - t0) / 1000.0 AS start_ms,
               dur_us / 1000.0 AS dur_ms, total
        FROM w, t0 ORDER BY dur_us DESC LIMIT {int(limit)}""")


def phase_breakdown(store: StoreConnection, run: str, ranks: Ranks | None = None) -> pl.DataFrame:
    """Mean ms per step per (role, rank) for each top-level phase, plus the step time no phase accounts for;
    of ``ranks`` only (every rank when None: at a thousand ranks a chart shows a few of them).

    Uses the definitions of ``dynascope.analyses.steps`` (top-level rows, step rows) but aggregates in
    DuckDB: ``step_breakdown`` returns one row per rank, step and phase, far more than a chart needs.
    Only time inside a timed step (one with a step row) is averaged over the timed steps, and only for phases
    that recur (in two or more of them): a one-off phase such as an evaluation or a rank-1 check after
    training would read as seconds "per step". Columns: role, rank, phase, ms_per_step (null for one-offs),
    steps (timed steps that had the phase), timed_ms (its time in them), outside_ms (its time in steps
    without a step row), first_step, one_off.
    """
    from dynascope.analyses.steps import REMAINDER, STEP_ROW, TOP_LEVEL

    r = f"run_id = {quote_literal(run)}{ranks_clause(ranks)}"
    return store.frame(f"""
        WITH per_step AS (
            SELECT coalesce(role, '') AS role, rank, step, sum(dur_us) FILTER (WHERE {TOP_LEVEL}) AS phases_us,
                   max(dur_us) FILTER (WHERE {STEP_ROW}) AS step_us
            FROM timings WHERE {r} AND (({TOP_LEVEL}) OR ({STEP_ROW})) GROUP BY ALL),
        n AS (SELECT role, rank, count(step_us) AS n,  -- steps with a step row, the denominator
                     sum(greatest(step_us - coalesce(phases_us, 0), 0)) FILTER (WHERE step_us IS NOT NULL) AS rest_us
              FROM per_step GROUP BY ALL HAVING count(step_us) > 0),
        ph AS (SELECT coalesce(role, '') AS role, rank, step, phase, sum(dur_us) AS dur_us
               FROM timings WHERE {r} AND {TOP_LEVEL} GROUP BY ALL),
        agg AS (SELECT ph.role, ph.rank, ph.phase, count(*) FILTER (WHERE p.step_us IS NOT NULL) AS steps,
                       coalesce(sum(ph.dur_us) FILTER (WHERE p.step_us IS NOT NULL), 0) AS timed_us,
                       coalesce(sum(ph.dur_us) FILTER (WHERE p.step_us IS NULL), 0) AS outside_us,
                       min(ph.step) AS first_step
                FROM ph JOIN per_step p USING (role, rank, step) GROUP BY ALL)
        SELECT role, rank, phase, CASE WHEN steps >= 2 OR n.n = 1 THEN timed_us / 1000.0 / n.n END AS ms_per_step,
               steps, timed_us / 1000.0 AS timed_ms, outside_us / 1000.0 AS outside_ms, first_step,
               NOT (steps >= 2 OR n.n = 1) AS one_off
        FROM agg JOIN n USING (role, rank)
        UNION ALL
        SELECT role, rank, {quote_literal(REMAINDER)}, rest_us / 1000.0 / n, n, rest_us / 1000.0, 0.0, NULL, false
        FROM n
        ORDER BY role, rank, phase""")


def throughput(store: StoreConnection, run: str, max_points: int = MAX_POINTS) -> pl.DataFrame:
    """Tokens/s and samples/s per step bucket: sample tokens over the slowest rank's step time."""
    r = quote_literal(run)
    return store.frame(f"""
        WITH tok AS (SELECT step, sum(coalesce(prompt_len, 0) + coalesce(response_len, 0)) AS tokens,
                            count(*) AS n FROM samples WHERE run_id = {r} GROUP BY step),
             dur AS (SELECT step, max(dur_us) AS d FROM timings WHERE run_id = {r} AND category = 'step'
                     GROUP BY step),
             per_step AS (SELECT step, tokens / (d / 1e6) AS tok_s, n / (d / 1e6) AS samples_s
                          FROM tok JOIN dur USING (step) WHERE d > 0),
             {bounds_cte('per_step', 'TRUE', max_points)}
        SELECT {BUCKET} AS step, avg(tok_s) AS tok_s, min(tok_s) AS tok_s_lo, max(tok_s) AS tok_s_hi,
               avg(samples_s) AS samples_s
        FROM per_step, bounds GROUP BY ALL ORDER BY step""")
