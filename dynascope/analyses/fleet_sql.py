"""The fleet summary's SQL, in the dialect DuckDB and Spark SQL share, so one text runs on both engines.

What the shared dialect rules out, and what is written instead: ``QUALIFY`` (a subquery on
``row_number()``), ``GROUP BY ALL`` (the keys spelled out), ``//`` and ``::`` (``floor`` and ``CAST``),
decimal literals in arithmetic (Spark would compute in DECIMAL: every ratio is ``CAST(... AS DOUBLE)``),
default NULL ordering (Spark puts NULLs first in ascending order, DuckDB last: every ``ORDER BY`` says
``NULLS LAST``), JSON functions (``regexp_extract`` reads a writer id), and arrays (``sigma[1]`` is 1-based
in DuckDB, 0-based in Spark: the rank-1 energy is weighted back from each tensor's ``rank1_energy``).
Identifiers are quoted by the caller's ``quote`` where they could be keywords.

Each figure follows the package's analysis of the same name (``tests/test_fleet.py`` holds them equal):
``straggler_scores`` with its defaults (the slowest rank is its first row: most time at stake), PULSE S₁
as ``delta_sync_bytes`` counts it (steps where every tensor has it), ``phase_shares``' step-time shares,
and ``rank1_dominance``'s energy-weighted rank-1 share. Tensor figures read the ``tensor_stats_by_kind``
rollup (pooled sums, its rows counted by the canonical view's rule: ``store.pooling.counted_rollup_sql``) and fall back to the canonical ``tensor_stats_global`` for runs that have none.
"""

from __future__ import annotations

from collections.abc import Callable

from dynascope.analyses.probe_time import PROBE_PHASE
from dynascope.analyses.rollouts import ROLLOUT_PHASES
from dynascope.analyses.steps import STEP_ROW, TOP_LEVEL
from dynascope.store import quote_literal
from dynascope.store.catalog import steps_sql
from dynascope.store.pooling import counted_rollup_sql

# straggler_scores' defaults
WINDOW, THRESHOLD, MIN_MEDIAN_MS = 10, 0.75, 5.0
RL_STAGE = "rl"

Quote = Callable[[str], str]


def pooled_sql(q: Quote) -> str:
    """Per (run, stage, step): the tensor sums every tensor figure needs, from the rollup or the rows."""
    return f"""
    rolled AS (SELECT DISTINCT run_id FROM {q('tensor_stats_by_kind')} WHERE run_id IS NOT NULL),
    pooled AS (
        SELECT run_id, stage, step, SUM(update_sq) AS update_sq,
               SUM(CASE WHEN update_sq IS NOT NULL THEN coalesce(update_w_sq, w_sq) END) AS update_w_sq,
               SUM(bf16_unchanged_count) AS s1_count, SUM(bf16_unchanged_numel) AS s1_numel,
               SUM(drift_unchanged_count) AS mk_count, SUM(drift_numel) AS mk_numel, SUM(numel) AS numel
        FROM ({counted_rollup_sql(q('tensor_stats_by_kind'), 'step IS NOT NULL', quote=q)}) c
        GROUP BY run_id, stage, step
        UNION ALL
        SELECT run_id, stage, step, SUM(update_norm * update_norm),
               SUM(CASE WHEN update_norm IS NOT NULL THEN w_norm * w_norm END),
               SUM(bf16_unchanged_count), SUM(CASE WHEN bf16_unchanged_count IS NOT NULL THEN numel END),
               SUM(drift_unchanged_count), SUM(CASE WHEN drift_norm IS NOT NULL THEN numel END), SUM(numel)
        FROM {q('tensor_stats_global')} WHERE run_id NOT IN (SELECT run_id FROM rolled)
        GROUP BY run_id, stage, step)"""


def _stragglers_sql(q: Quote) -> str:
    """``straggler_scores``' CTEs, then each run's first row (most time at stake, then lowest score)."""
    return f"""
    d AS (
        SELECT run_id, role, {q('rank')}, step, phase, SUM(dur_us) AS dur_us FROM (
            SELECT run_id, coalesce(role, '') AS role, {q('rank')}, step, dur_us,
                   CASE WHEN coalesce(parent, '') IN ('', 'step') THEN phase ELSE concat(parent, '/', phase) END AS phase
            FROM {q('timings')} WHERE step IS NOT NULL AND phase IS NOT NULL AND phase <> 'step' AND stream IS NULL
              AND coalesce(category, 'phase') = 'phase') p
        WHERE phase <> {quote_literal(PROBE_PHASE)}  -- straggler_phases_sql: the probe's time is probe_cost's
        GROUP BY run_id, role, {q('rank')}, step, phase),
    g AS (
        SELECT d.*, CAST(floor(CAST(step - MIN(step) OVER (PARTITION BY run_id, role) AS DOUBLE) / {WINDOW})
                         AS BIGINT) AS win,
               COUNT(*) OVER (PARTITION BY run_id, role, step, phase) AS nranks,
               MIN(dur_us) OVER (PARTITION BY run_id, role, step, phase) AS step_ref_us
        FROM d),
    wm AS (
        SELECT run_id, role, {q('rank')}, phase, win, median(dur_us) AS rank_med_us, COUNT(*) AS n
        FROM g WHERE nranks >= 2 GROUP BY run_id, role, {q('rank')}, phase, win),
    ws AS (
        SELECT wm.*, MIN(rank_med_us) OVER (PARTITION BY run_id, role, phase, win) / nullif(rank_med_us, 0) AS score,
               median(rank_med_us) OVER (PARTITION BY run_id, role, phase, win) AS cross_med_us
        FROM wm),
    sagg AS (
        SELECT run_id, role, {q('rank')}, phase, median(score) AS score, median(rank_med_us) / 1000 AS median_ms,
               SUM(greatest(rank_med_us - cross_med_us, 0) * n) / 1000 AS excess_ms
        FROM ws GROUP BY run_id, role, {q('rank')}, phase),
    straggler AS (
        SELECT run_id, {q('rank')} AS slowest_rank, phase AS slowest_phase, score AS straggler_score FROM (
            SELECT k.*, row_number() OVER (PARTITION BY run_id ORDER BY excess_ms DESC NULLS LAST,
                        score ASC NULLS LAST, role ASC NULLS LAST, {q('rank')} ASC NULLS LAST, phase ASC NULLS LAST) AS pick
            FROM (SELECT sagg.*, MAX(median_ms) OVER (PARTITION BY run_id, role, phase) AS phase_ms FROM sagg) k
            WHERE phase_ms >= {MIN_MEDIAN_MS}) r
        WHERE pick = 1)"""


def fleet_sql(q: Quote) -> str:
    """One row per run: the fleet summary's figures (see ``fleet.fleet_summary`` for the columns)."""
    rollout = ", ".join(quote_literal(p) for p in ROLLOUT_PHASES)
    return f"""
    WITH steps AS ({steps_sql(q)}),
    meta AS (
        SELECT run_id, name, config_json FROM (
            SELECT run_id, name, config_json, row_number() OVER (PARTITION BY run_id
                   ORDER BY start_us ASC NULLS LAST, {q('rank')} ASC NULLS LAST, name ASC NULLS LAST) AS pick
            FROM {q('runs')} WHERE name IS NOT NULL) m
        WHERE pick = 1),
    st AS (
        SELECT run_id, coalesce(role, '') AS role, {q('rank')}, step, MAX(dur_us) AS step_us FROM {q('timings')}
        WHERE {STEP_ROW} GROUP BY run_id, coalesce(role, ''), {q('rank')}, step),
    step_ms AS (
        SELECT run_id, median(CAST(step_us AS DOUBLE) / 1000) AS median_step_ms FROM (
            SELECT run_id, step, MAX(step_us) AS step_us FROM st GROUP BY run_id, step) s
        GROUP BY run_id),
    ro_rows AS (
        SELECT run_id, coalesce(role, '') AS role, {q('rank')}, step, SUM(dur_us) AS dur_us FROM {q('timings')}
        WHERE {TOP_LEVEL} AND phase IN ({rollout}) GROUP BY run_id, coalesce(role, ''), {q('rank')}, step),
    rollout AS (
        SELECT st.run_id, 100 * CAST(coalesce(SUM(ro_rows.dur_us), 0) AS DOUBLE) / nullif(SUM(st.step_us), 0) AS all_steps_rollout_pct
        FROM st LEFT JOIN ro_rows ON st.run_id = ro_rows.run_id AND st.role = ro_rows.role
                              AND st.{q('rank')} = ro_rows.{q('rank')}
                              AND st.step = ro_rows.step
        GROUP BY st.run_id),
    {_stragglers_sql(q).strip()},
    {pooled_sql(q).strip()},
    s1 AS (
        SELECT run_id, median(CAST(s1_count AS DOUBLE) / s1_numel) AS median_bf16_unchanged_frac_rl FROM pooled
        WHERE stage = {quote_literal(RL_STAGE)} AND s1_count IS NOT NULL AND s1_numel = numel AND numel > 0
        GROUP BY run_id),
    mk_step AS (
        SELECT run_id, step, SUM(mk_count) AS mk_count, SUM(mk_numel) AS mk_numel, SUM(numel) AS numel
        FROM pooled GROUP BY run_id, step),
    mk AS (
        SELECT run_id, CAST(mk_count AS DOUBLE) / mk_numel AS last_drift_unchanged_frac FROM (
            SELECT mk_step.*, row_number() OVER (PARTITION BY run_id ORDER BY step DESC NULLS LAST) AS pick
            FROM mk_step WHERE mk_count IS NOT NULL AND mk_numel = numel AND numel > 0) m
        WHERE pick = 1),
    sp AS (
        SELECT run_id, step, rank1_energy, drift_norm, row_number() OVER (PARTITION BY run_id, step, tensor
               ORDER BY {q('rank')} ASC NULLS LAST, time_us ASC NULLS LAST) AS pick
        FROM {q('spectra')} WHERE drift_norm > 0 AND rank1_energy IS NOT NULL AND step IS NOT NULL),
    sp_last AS (SELECT run_id, MAX(step) AS step FROM sp GROUP BY run_id),
    r1 AS (
        SELECT sp.run_id, SUM(rank1_energy * drift_norm * drift_norm) / SUM(drift_norm * drift_norm) AS last_rank1_energy
        FROM sp JOIN sp_last ON sp.run_id = sp_last.run_id AND sp.step = sp_last.step
        WHERE sp.pick = 1 GROUP BY sp.run_id),
    ids AS (SELECT run_id FROM meta UNION SELECT run_id FROM steps)
    SELECT ids.run_id, meta.name, steps.steps, step_ms.median_step_ms, rollout.all_steps_rollout_pct,
           straggler.slowest_rank, straggler.slowest_phase, straggler.straggler_score,
           s1.median_bf16_unchanged_frac_rl, mk.last_drift_unchanged_frac, r1.last_rank1_energy, meta.config_json
    FROM ids
    LEFT JOIN meta ON ids.run_id = meta.run_id LEFT JOIN steps ON ids.run_id = steps.run_id
    LEFT JOIN step_ms ON ids.run_id = step_ms.run_id LEFT JOIN rollout ON ids.run_id = rollout.run_id
    LEFT JOIN straggler ON ids.run_id = straggler.run_id LEFT JOIN s1 ON ids.run_id = s1.run_id
    LEFT JOIN mk ON ids.run_id = mk.run_id LEFT JOIN r1 ON ids.run_id = r1.run_id
    ORDER BY ids.run_id ASC NULLS LAST"""


def update_ratio_sql(q: Quote) -> str:
    """Per run and stage: the median over steps of ‖ΔW‖/‖W‖ pooled over tensors and ranks."""
    return f"""
    WITH {pooled_sql(q).strip()}
    SELECT run_id, stage, median(sqrt(update_sq / update_w_sq)) AS median_update_ratio FROM pooled
    WHERE update_sq IS NOT NULL AND update_w_sq > 0 GROUP BY run_id, stage
    ORDER BY run_id ASC NULLS LAST, stage ASC NULLS LAST"""


def ended_sql(q: Quote) -> str:
    """The writers that closed (their ``run_end`` event), per run: half of ``catalog.run_status``."""
    return f"""
    SELECT DISTINCT run_id, regexp_extract(fields_json, '"writer_id": "([^"]+)"', 1) AS writer_id
    FROM {q('events')} WHERE event = 'run_end' AND fields_json IS NOT NULL"""
