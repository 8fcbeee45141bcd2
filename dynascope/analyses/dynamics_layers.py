"""Where a stage's update lives: each layer's share of the update energy and of the bf16-visible changes.

For the stage's cumulative update ΔW = W_T − θ₀ (each tensor's last record with drift columns, θ₀ the
stage's reference) and for the sum of its per-step updates W_t − W_{t−1}:

- energy share of layer ℓ: Σ_{tensors in ℓ} ‖ΔW‖²_F / Σ_{all tensors} ‖ΔW‖²_F (``drift_norm``²; per step
  ``update_norm``² summed over the stage's recorded steps);
- bf16-visible share: the layer's count of elements whose bf16 cast changed over the count of the whole
  model (cumulative: numel − ``drift_zero_count``, i.e. bf16(W_T) ≠ bf16(θ₀); per step: numel −
  ``bf16_unchanged_count``, PULSE's 1 − S₁ summed over steps);
- ``numel_pct``: the layer's share of the parameters, what an update spread evenly would give.

Zhang et al. (arXiv 2607.01232) find RL's *gain* concentrated in one or a few middle layers by training
each layer alone ("layer contribution", a measure of accuracy); these shares are the weight-space view
of one run, which says where the update went, not which layer carries the gain. Each tensor counts
once per step, as ``tensor_stats_global`` has it (shards pooled, replicas once).
"""

from __future__ import annotations

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.store import quote_literal
from dynascope.store.pooling import GLOBAL
from dynascope.store.rollup_across import BY_TENSOR, covers

__all__ = ["update_share_by_layer"]

_SCHEMA = {"run_id": pl.String, "stage": pl.String, "layer": pl.Int32, "tensors": pl.Int64, "numel": pl.Int64,
           "numel_pct": pl.Float64, "drift_energy_pct": pl.Float64, "drift_bf16_changed_pct": pl.Float64,
           "update_energy_pct": pl.Float64, "update_bf16_changed_pct": pl.Float64, "steps": pl.Int64,
           "last_step": pl.Int64}


def update_share_by_layer(store: StoreLike, run: str | None = None, stage: str | None = "rl") -> pl.DataFrame:
    """Per run, stage and layer (NULL: tensors outside the transformer blocks, e.g. embeddings and the
    final norm), the percentages described in the module docstring.

    Columns: run_id, stage, layer, tensors, numel, numel_pct, drift_energy_pct, drift_bf16_changed_pct
    (NULL without drift columns), update_energy_pct, update_bf16_changed_pct (NULL without S₁), steps
    (recorded steps summed), last_step (the step of the cumulative figures). Each percentage column sums
    to 100 over a run's layers.
    """
    where = run_clause(run) + ("" if stage is None else f" AND stage = {quote_literal(stage)}")
    con = as_store(store)
    # One row per (step, tensor), the canonical view's: compacted, its pooled sums; else the view itself.
    if covers(con, run):
        source = f"""
            SELECT run_id, stage, step, tensor, layer, numel, update_sq,
                   bf16_unchanged_numel - bf16_unchanged_count AS update_bf16_changed, drift_sq,
                   drift_zero_numel - drift_zero_count AS drift_bf16_changed, drift_numel IS NOT NULL AS has_drift
            FROM {BY_TENSOR}"""
    else:
        source = f"""
            SELECT run_id, stage, step, tensor, layer, numel, update_norm * update_norm AS update_sq,
                   numel - bf16_unchanged_count AS update_bf16_changed, drift_norm * drift_norm AS drift_sq,
                   numel - drift_zero_count AS drift_bf16_changed, drift_norm IS NOT NULL AS has_drift
            FROM {GLOBAL}"""
    df = frame(con, f"""
        WITH one AS (SELECT * FROM ({source}) WHERE step IS NOT NULL AND numel > 0{where}),
        -- One pass over the rows to (step, tensor); everything after reads that small frame.
        per_step AS (
            SELECT run_id, stage, step, tensor, any_value(layer) AS layer, sum(numel) AS numel,
                   sum(update_sq) AS update_sq, sum(update_bf16_changed) AS update_bf16_changed,
                   sum(drift_sq) AS drift_sq, sum(drift_bf16_changed) AS drift_bf16_changed,
                   bool_or(has_drift) AS has_drift
            FROM one GROUP BY run_id, stage, step, tensor),
        per_tensor AS (
            SELECT run_id, stage, tensor, any_value(layer) AS layer, sum(update_sq) AS update_sq,
                   sum(update_bf16_changed) AS update_bf16_changed, count(*) AS steps,
                   max(step) FILTER (WHERE has_drift) AS last_step
            FROM per_step GROUP BY run_id, stage, tensor),
        last AS (
            SELECT s.run_id, s.stage, s.tensor, s.drift_sq, s.drift_bf16_changed
            FROM per_step s JOIN per_tensor p ON s.run_id = p.run_id AND s.stage = p.stage AND s.tensor = p.tensor
                 AND s.step = p.last_step),
        numel AS (SELECT run_id, stage, tensor, max(numel) AS numel FROM per_step GROUP BY ALL)
        SELECT p.run_id, p.stage, p.layer, count(*) AS tensors, sum(n.numel)::BIGINT AS numel,
               sum(p.update_sq) AS update_sq, sum(p.update_bf16_changed) AS update_bf16_changed,
               sum(l.drift_sq) AS drift_sq, sum(l.drift_bf16_changed) AS drift_bf16_changed,
               max(p.steps) AS steps, max(p.last_step) AS last_step
        FROM per_tensor p JOIN numel n USING (run_id, stage, tensor)
             LEFT JOIN last l USING (run_id, stage, tensor)
        GROUP BY p.run_id, p.stage, p.layer""")
    if df.is_empty():
        return pl.DataFrame(schema=_SCHEMA)

    def pct(col: str) -> pl.Expr:
        total = pl.col(col).sum().over("run_id", "stage")
        return pl.when(total > 0).then(100.0 * pl.col(col) / total).alias(col)

    out = df.with_columns(pct("numel").alias("numel_pct"), pct("drift_sq").alias("drift_energy_pct"),
                          pct("drift_bf16_changed").alias("drift_bf16_changed_pct"),
                          pct("update_sq").alias("update_energy_pct"),
                          pct("update_bf16_changed").alias("update_bf16_changed_pct"))
    return (out.select([pl.col(c).cast(t) for c, t in _SCHEMA.items()])
            .sort(["run_id", "stage", "layer"], nulls_last=True))
