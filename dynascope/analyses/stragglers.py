"""Stragglers: which rank is slow in which phase, and how much time is at stake.

``straggler_scores`` follows NVIDIA's straggler detection (nvidia-resiliency-ext): within a window of steps
a rank's *relative performance score* for a phase is the baseline's median time divided by this rank's
median time (1.0 = as fast as the baseline, 0.5 = twice as slow); the baseline is the fastest rank
(NVIDIA's default) or the cross-rank median. A rank is flagged in a window when its score is below
``threshold``; flagged in more than ``persistent_frac`` of the windows it is a *persistent* straggler, in
fewer a *transient* one.

Two floors keep false stragglers out (one rule, here, for the report, the dashboard and the CLI): a rank
whose median is at or below the cross-rank median is never a straggler, however far it trails the fastest
rank; and a rank is one only when its median exceeds the cross-rank median by more than the phase's noise,
``noise_k`` times ``noise_ms``, and by at least ``min_effect_ms``. The noise is measured step by step against
the same step's cross-rank median (each rank's 1.4826 · MAD of its time minus that median; ``noise_ms`` is
the median over ranks), so work that varies from step to step on every rank alike (longer responses in one
rollout) cancels, and only the ranks' disagreement counts. A phase too short or too jittery to measure a
difference in is then ``ok`` on every rank.

What a straggler costs the step, if it ran as fast as the others, is ``what_if_rank.what_if``.
"""

from __future__ import annotations

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.analyses.probe_time import PROBE_PHASE
from dynascope.store import quote_literal

__all__ = ["straggler_scores"]


def phase_times_sql(run: str | None, where: str = "") -> str:
    """Per (run, role, rank, step, phase): the rank's time in the phase that step (``dur_us``), phases named
    by their place (``backward`` at the top level, ``train/forward`` nested); ``where``: AND-conditions."""
    return f"""
        SELECT run_id, coalesce(role, '') AS role, rank, step,
               CASE WHEN coalesce(parent, '') IN ('', 'step') THEN phase ELSE parent || '/' || phase END AS phase,
               SUM(dur_us) AS dur_us
        FROM timings
        WHERE step IS NOT NULL AND phase IS NOT NULL AND phase <> 'step' AND stream IS NULL
          AND coalesce(category, 'phase') = 'phase'{where}{run_clause(run)}
        GROUP BY ALL"""


def straggler_phases_sql(run: str | None, where: str = "") -> str:
    """``phase_times_sql`` less the probe's own phase: the phases a straggler is judged in, here and by the
    live rule. The probe's time is ``probe_cost``'s and the alert ``probe_pct``'s: rank 0 runs the live
    monitor, so on a busy host its probe phase is slower for a reason no straggler search should report."""
    return f"SELECT * FROM ({phase_times_sql(run, where)}) WHERE phase <> {quote_literal(PROBE_PHASE)}"


NOISE_K, MIN_EFFECT_MS = 2.0, 0.5  # the false-straggler floors' defaults, shared with the live alert


def straggler_scores(store: StoreLike, run: str | None = None, *, window: int = 10, threshold: float = 0.75,
                     baseline: str = "fastest", persistent_frac: float = 0.5,
                     min_median_ms: float = 5.0, noise_k: float = NOISE_K,
                     min_effect_ms: float = MIN_EFFECT_MS) -> pl.DataFrame:
    """Per rank and phase: relative performance score over windows of ``window`` steps.

    ``baseline`` is ``"fastest"`` (NVIDIA's default: the fastest rank's median) or ``"median"`` (the
    cross-rank median). Columns: run_id, role, rank, phase, steps, windows, flagged_windows, score (median
    over windows), median_ms, cross_rank_median_ms, slowdown_x (1 / score: how many times slower than the
    baseline), slow_steps_pct (steps whose per-step score is below threshold), excess_ms (time at stake:
    per window, the rank's median beyond the cross-rank median times the window's steps, summed over the
    run), noise_ms (the phase's step-to-step noise), status (persistent | transient | ok: ok too for a rank
    not slower than the cross-rank median by more than ``max(noise_k · noise_ms, min_effect_ms)``). Rows come most time at stake first.
    A phase whose median is under ``min_median_ms`` on every rank is left out: a 1 ms phase twice as slow
    on one rank scores like a real straggler but costs nothing worth chasing.
    Phases are all ``category='phase'`` rows at any nesting level, summed per step and named by their
    place: ``backward`` at the top level, ``train/forward`` for a forward inside train (a forward in
    rollout is different work). Only phases seen on at least two ranks in a step are compared; the probe's
    own phase is ``probe_cost``'s (``straggler_phases_sql``).
    """
    if baseline not in ("fastest", "median"):
        raise ValueError(f"baseline must be 'fastest' or 'median', not {baseline!r}")
    if window < 1 or not 0 < threshold <= 1:
        raise ValueError("window must be ≥ 1 and threshold in (0, 1]")
    if not min_median_ms >= 0:
        raise ValueError("min_median_ms must be ≥ 0")
    if not (noise_k >= 0 and min_effect_ms >= 0):
        raise ValueError("noise_k and min_effect_ms must be ≥ 0")
    agg = "MIN" if baseline == "fastest" else "median"
    thr = float(threshold)
    con = as_store(store)
    return frame(con, f"""
        WITH d AS MATERIALIZED ({straggler_phases_sql(run)}),
        -- each row's (run, role) first step and (run, role, step, phase) rank count and baseline: grouped and
        -- joined back, half the time of the same as windows at a thousand ranks (role and phase are never
        -- NULL here, run_id may be)
        g AS (
            SELECT d.*, (d.step - m.first_step) // {int(window)} AS win, c.nranks, c.step_base_us, c.step_med_us
            FROM d
            JOIN (SELECT run_id, role, step, phase, COUNT(*) AS nranks, {agg}(dur_us) AS step_base_us,
                         median(dur_us) AS step_med_us FROM d GROUP BY ALL) c
              ON d.run_id IS NOT DISTINCT FROM c.run_id AND d.role = c.role AND d.step = c.step AND d.phase = c.phase
            JOIN (SELECT run_id, role, MIN(step) AS first_step FROM d GROUP BY ALL) m
              ON d.run_id IS NOT DISTINCT FROM m.run_id AND d.role = m.role),
        wm AS (
            SELECT run_id, role, rank, phase, win, median(dur_us) AS rank_med_us, COUNT(*) AS n,
                   SUM(CASE WHEN step_base_us / nullif(dur_us, 0) < {thr} THEN 1 ELSE 0 END) AS slow_steps
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
            FROM ws GROUP BY ALL),
        noise AS (
            SELECT run_id AS n_run, role AS n_role, phase AS n_phase, median(rank_sigma_us) / 1000.0 AS noise_ms
            FROM (SELECT run_id, role, rank, phase, 1.4826 * mad(dur_us - step_med_us) AS rank_sigma_us FROM g
                  WHERE nranks >= 2 GROUP BY ALL) GROUP BY ALL)
        SELECT run_id, role, rank, phase, steps, windows, flagged_windows, score, median_ms,
               cross_rank_median_ms, 1.0 / nullif(score, 0) AS slowdown_x, slow_steps_pct, excess_ms, noise_ms,
               CASE WHEN median_ms - cross_rank_median_ms
                         <= greatest({float(noise_k)} * coalesce(noise_ms, 0), {float(min_effect_ms)}) THEN 'ok'
                    WHEN flagged_windows > {float(persistent_frac)} * windows THEN 'persistent'
                    WHEN flagged_windows > 0 THEN 'transient' ELSE 'ok' END AS status
        FROM agg LEFT JOIN noise ON run_id IS NOT DISTINCT FROM n_run AND role = n_role AND phase = n_phase
        QUALIFY MAX(median_ms) OVER (PARTITION BY run_id, role, phase) >= {float(min_median_ms)}
        ORDER BY excess_ms DESC, score ASC NULLS LAST, run_id, role, rank, phase""")
