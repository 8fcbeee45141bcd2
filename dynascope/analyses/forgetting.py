"""Forgetting beside its candidate predictors, per evaluation point: RL's Razor's test, on one run's record.

RL's Razor (Shenfeld, Pari & Agrawal, arXiv 2509.04259) finds that how much a fine-tuned model forgets of
tasks it was not trained on follows the forward KL from the base policy π₀ to the trained π on the new
task's distribution, E_{x∼task}[KL(π₀(·|x) ‖ π(·|x))], and that weight-change norms, update sparsity and
rank do not. This analysis puts the two sides next to each other at each evaluation point of a stage:

- forgetting: ``eval/prose_nll_nats`` (log-loss on text the run does not train on) minus its value at the
  base's own evaluation (the last one logged before the stage), so 0 is no forgetting;
- the KL: ``eval/forward_kl_<base>_nats`` logged at the same point;
- the weight measures the probe recorded at that step against the stage's θ₀: ‖ΔW‖ = ‖W − θ₀‖_F over every
  tensor, ‖ΔW‖/‖W‖, Mukherjee et al.'s changed share (1 − update sparsity: bf16(W) − bf16(θ₀) beyond 1e-5),
  and the rank-1 energy Σσ₁²/Σ‖ΔW‖²_F of the latest spectra at or before the step.

The scalars are logged by the run (``dynascope demo --model smollm2`` logs them all); a missing one is a
NULL column, never a stand-in value.
"""

from __future__ import annotations

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.analyses.dynamics import rank1_dominance
from dynascope.store import quote_literal
from dynascope.store.pooling import GLOBAL

__all__ = ["FORGETTING_CANDIDATES", "forgetting_by_point"]

# The columns of forgetting_by_point that RL's Razor weighs as predictors of forgetting.
FORGETTING_CANDIDATES = ("forward_kl_nats", "drift_norm", "drift_ratio", "mukherjee_changed_share", "rank1_energy")

_SCHEMA = {"run_id": pl.String, "step": pl.Int64, "accuracy": pl.Float64, "prose_nll_nats": pl.Float64,
           "forgetting_nats": pl.Float64, "forward_kl_nats": pl.Float64, "drift_norm": pl.Float64,
           "drift_ratio": pl.Float64, "mukherjee_changed_share": pl.Float64, "rank1_energy": pl.Float64,
           "spectra_step": pl.Int64}


def forgetting_by_point(store: StoreLike, stage: str = "rl", base: str = "sft", run: str | None = None) -> pl.DataFrame:
    """One row per evaluation point logged in ``stage``: forgetting and its candidate predictors (see above).

    ``base`` names the KL's base policy (``eval/forward_kl_<base>_nats``); forgetting is measured from the
    last evaluation logged outside ``stage`` before its first point. Columns: run_id, step, accuracy,
    prose_nll_nats, forgetting_nats, forward_kl_nats, drift_norm, drift_ratio, mukherjee_changed_share,
    rank1_energy, spectra_step (the spectra's step; NULL without spectra).
    """
    con = as_store(store)
    kl_key = f"eval/forward_kl_{base}_nats"
    evals = frame(con, f"""
        WITH e AS (SELECT run_id, step, stage, time_us, key, value FROM scalars
                   WHERE key IN ('eval/accuracy', 'eval/prose_nll_nats', {quote_literal(kl_key)}){run_clause(run)}),
        pts AS (SELECT run_id, step, min(time_us) AS time_us,
                       arg_max(value, time_us) FILTER (WHERE key = 'eval/accuracy') AS accuracy,
                       arg_max(value, time_us) FILTER (WHERE key = 'eval/prose_nll_nats') AS prose_nll_nats,
                       arg_max(value, time_us) FILTER (WHERE key = {quote_literal(kl_key)}) AS forward_kl_nats
                FROM e WHERE stage = {quote_literal(stage)} GROUP BY run_id, step),
        first AS (SELECT run_id, min(time_us) AS t FROM pts GROUP BY run_id),
        before AS (SELECT e.run_id, arg_max(e.value, e.time_us) AS nll FROM e JOIN first f USING (run_id)
                   WHERE e.key = 'eval/prose_nll_nats' AND e.stage IS DISTINCT FROM {quote_literal(stage)}
                     AND e.time_us < f.t GROUP BY e.run_id)
        SELECT p.run_id, p.step, p.accuracy, p.prose_nll_nats, p.prose_nll_nats - b.nll AS forgetting_nats,
               p.forward_kl_nats
        FROM pts p LEFT JOIN before b USING (run_id) ORDER BY p.run_id, p.step""")
    if evals.is_empty():
        return pl.DataFrame(schema=_SCHEMA)
    weights = frame(con, f"""
        SELECT run_id, step, sqrt(sum(drift_norm * drift_norm)) AS drift_norm,
               CASE WHEN count(w_norm) = count(*)  -- ‖W‖ of every tensor at the step, else no ratio
                    THEN sqrt(sum(drift_norm * drift_norm)) / nullif(sqrt(sum(w_norm * w_norm)), 0) END AS drift_ratio,
               1 - sum(drift_unchanged_count)::DOUBLE / sum(numel) AS mukherjee_changed_share
        FROM {GLOBAL} WHERE stage = {quote_literal(stage)} AND numel > 0{run_clause(run)}
        GROUP BY run_id, step
        HAVING count(drift_norm) = count(*) AND count(drift_unchanged_count) = count(*)""")
    rank1 = (rank1_dominance(con, run=run).filter((pl.col("level") == "overall") & (pl.col("stage") == stage))
             .select("run_id", pl.col("step").alias("spectra_step"), "rank1_energy").sort("run_id", "spectra_step"))
    out = evals.join(weights, on=["run_id", "step"], how="left").sort("run_id", "step")
    if rank1.height:  # the latest spectra at or before each point (spectra run on their own cadence)
        out = out.join_asof(rank1, left_on="step", right_on="spectra_step", by="run_id", strategy="backward",
                            check_sortedness=False)  # both sorted by (run_id, step) above
    else:
        out = out.with_columns(pl.lit(None, pl.Float64).alias("rank1_energy"), pl.lit(None, pl.Int64).alias("spectra_step"))
    return out.select([pl.col(c).cast(t) for c, t in _SCHEMA.items()])
