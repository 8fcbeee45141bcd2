"""Parameter dynamics aggregates: layer × step heat maps, stage overlays, spectra and gradient health.

Ratios are pooled (√Σ‖ΔW‖² / √Σ‖W‖², Σ changed / Σ numel) rather than averaged, so a layer's value is
the value of the layer as one tensor and FSDP shards combine exactly.
"""

from __future__ import annotations

import polars as pl

from dynascope.dashboard.queries import BUCKET, MAX_POINTS, bounds_cte, frame, in_list
from dynascope.store import StoreConnection

# Heat-map metrics: label → pooled SQL over the rows of one (layer, step bucket) cell.
HEAT_METRICS = {
    "update ratio ‖ΔW‖/‖W‖": "sqrt(sum(dw_norm * dw_norm)) / nullif(sqrt(sum(w_norm * w_norm)), 0)",
    "step-changed fraction": "sum(changed_count) / nullif(sum(CASE WHEN changed_count IS NOT NULL THEN numel END), 0)",
    "drift vs θ₀ ‖W−θ₀‖/‖W‖": "sqrt(sum(drift_norm * drift_norm)) / "
                               "nullif(sqrt(sum(CASE WHEN drift_norm IS NOT NULL THEN w_norm * w_norm END)), 0)",
}


def _where(runs: tuple[str, ...], stages: tuple[str, ...] | None, kinds: tuple[str, ...] | None) -> str:
    parts = [in_list("run_id", runs), "step IS NOT NULL"]
    if stages is not None:
        parts.append(in_list("coalesce(stage, '')", stages))
    if kinds is not None:
        parts.append(in_list("kind", kinds))
    return " AND ".join(parts)


def stages_and_kinds(store: StoreConnection, runs: tuple[str, ...]) -> pl.DataFrame:
    """Distinct (stage, kind) pairs with their step range, for the page's filters."""
    return frame(store, f"""
        SELECT coalesce(stage, '') AS stage, kind, min(step) AS first_step, max(step) AS last_step
        FROM tensor_stats WHERE {in_list('run_id', runs)} GROUP BY ALL ORDER BY first_step, kind""")


def layer_heatmap(store: StoreConnection, run: str, stages: tuple[str, ...], kinds: tuple[str, ...],
                  max_points: int = MAX_POINTS) -> pl.DataFrame:
    """Layer × step-bucket cells with every heat metric; layer −1 holds tensors outside the blocks."""
    where = _where((run,), stages, kinds)
    metrics = ",\n               ".join(f'{sql} AS "{name}"' for name, sql in HEAT_METRICS.items())
    return frame(store, f"""
        WITH {bounds_cte('tensor_stats', where, max_points)}
        SELECT coalesce(layer, -1) AS layer, {BUCKET} AS step,
               {metrics}
        FROM tensor_stats, bounds WHERE {where}
        GROUP BY ALL ORDER BY layer, step""")


def stage_overlay(store: StoreConnection, runs: tuple[str, ...], kinds: tuple[str, ...],
                  max_points: int = MAX_POINTS) -> pl.DataFrame:
    """Per run and stage, pooled update ratio and changed fraction against steps since the stage began.

    Each step is pooled over all selected tensors first, then buckets keep mean/min/max of those steps.
    """
    where = _where(runs, None, kinds)
    return frame(store, f"""
        WITH per_step AS (
            SELECT run_id, coalesce(stage, '') AS stage, step,
                   sqrt(sum(dw_norm * dw_norm)) / nullif(sqrt(sum(w_norm * w_norm)), 0) AS ratio,
                   sum(changed_count) / nullif(sum(CASE WHEN changed_count IS NOT NULL THEN numel END), 0) AS changed
            FROM tensor_stats WHERE {where} GROUP BY ALL
        ), rel AS (
            SELECT *, step - min(step) OVER (PARTITION BY run_id, stage) AS step_in_stage FROM per_step
        ), b AS (
            SELECT run_id, stage,
                   greatest(1, CAST(ceil((max(step_in_stage) + 1) / {int(max_points)}.0) AS BIGINT)) AS w
            FROM rel GROUP BY ALL
        )
        SELECT run_id, stage, (step_in_stage // w) * w AS step_in_stage, min(step) AS step,
               avg(ratio) AS ratio, min(ratio) AS ratio_lo, max(ratio) AS ratio_hi,
               avg(changed) AS changed, min(changed) AS changed_lo, max(changed) AS changed_hi
        FROM rel JOIN b USING (run_id, stage)
        GROUP BY ALL ORDER BY run_id, stage, step_in_stage""")


def spectra_series(store: StoreConnection, runs: tuple[str, ...], kinds: tuple[str, ...],
                   max_points: int = MAX_POINTS) -> pl.DataFrame:
    """Rank-1 energy and stable rank of cumulative ΔW per run and stage: mean/min/max over tensors and bucket."""
    where = _where(runs, None, kinds)
    return frame(store, f"""
        WITH {bounds_cte('spectra', where, max_points, partition='run_id')}
        SELECT s.run_id, coalesce(stage, '') AS stage, {BUCKET} AS step,
               avg(rank1_energy) AS rank1, min(rank1_energy) AS rank1_lo, max(rank1_energy) AS rank1_hi,
               avg(stable_rank) AS stable_rank, min(stable_rank) AS stable_rank_lo,
               max(stable_rank) AS stable_rank_hi
        FROM spectra s JOIN bounds USING (run_id) WHERE {where}
        GROUP BY ALL ORDER BY s.run_id, stage, step""")


def rank1_fit_fallback(store: StoreConnection, run: str, kinds: tuple[str, ...]) -> pl.DataFrame:
    """Per layer: how linear σ₁ of cumulative ΔW is in the step (R²), and the relative error of
    predicting the last record from a line fitted on the first half of the records."""
    where = _where((run,), None, kinds)
    return frame(store, f"""
        WITH s AS (
            SELECT tensor, coalesce(layer, -1) AS layer, step, sigma[1] AS s1,
                   percent_rank() OVER (PARTITION BY tensor ORDER BY step) AS pos,
                   max(step) OVER (PARTITION BY tensor) AS last_step
            FROM spectra WHERE {where} AND len(sigma) > 0
        ), fit AS (
            SELECT tensor, layer, regr_r2(s1, step) AS r2,
                   regr_slope(s1, step) FILTER (WHERE pos <= 0.5) AS a,
                   regr_intercept(s1, step) FILTER (WHERE pos <= 0.5) AS b,
                   max(s1) FILTER (WHERE step = last_step) AS actual, max(last_step) AS last_step
            FROM s GROUP BY ALL HAVING count(*) >= 3
        )
        SELECT layer, avg(r2) AS r2, avg(abs(a * last_step + b - actual) / nullif(abs(actual), 0)) AS pred_rel_err,
               count(*) AS tensors
        FROM fit GROUP BY layer ORDER BY layer""")


def grad_health(store: StoreConnection, runs: tuple[str, ...], kinds: tuple[str, ...],
                max_points: int = MAX_POINTS) -> pl.DataFrame:
    """Gradient sparsity per run and step bucket (mean/min/max of the per-step pooled fraction)."""
    where = _where(runs, None, kinds) + " AND grad_zero_count IS NOT NULL"
    return frame(store, f"""
        WITH per_step AS (
            SELECT run_id, step, sum(grad_zero_count) / nullif(sum(numel), 0) AS zero,
                   sum(grad_near_zero_count) / nullif(sum(numel), 0) AS near_zero
            FROM tensor_stats WHERE {where} GROUP BY ALL
        ), {bounds_cte('per_step', 'TRUE', max_points, partition='run_id')}
        SELECT p.run_id, {BUCKET} AS step, avg(zero) AS zero, min(zero) AS zero_lo, max(zero) AS zero_hi,
               avg(near_zero) AS near_zero, min(near_zero) AS near_zero_lo, max(near_zero) AS near_zero_hi
        FROM per_step p JOIN bounds USING (run_id) GROUP BY ALL ORDER BY p.run_id, step""")


def nonfinite_steps(store: StoreConnection, runs: tuple[str, ...], limit: int = 500) -> pl.DataFrame:
    """Steps where any weight or gradient held NaN/Inf, with counts and the worst tensor."""
    return frame(store, f"""
        SELECT run_id, step, CAST(sum(coalesce(w_nan, 0) + coalesce(grad_nan, 0)) AS BIGINT) AS nan,
               CAST(sum(coalesce(w_inf, 0) + coalesce(grad_inf, 0)) AS BIGINT) AS inf,
               arg_max(tensor, coalesce(w_nan, 0) + coalesce(w_inf, 0) + coalesce(grad_nan, 0)
                       + coalesce(grad_inf, 0)) AS worst_tensor
        FROM tensor_stats
        WHERE {in_list('run_id', runs)} AND (w_nan > 0 OR w_inf > 0 OR grad_nan > 0 OR grad_inf > 0)
        GROUP BY ALL ORDER BY run_id, step LIMIT {int(limit)}""")
