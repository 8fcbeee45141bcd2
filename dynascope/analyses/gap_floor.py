"""The trainer↔rollout log-prob gap beside the trainer's own floor: how much of the gap the rollout engine adds.

Recomputing the same tokens in the trainer's own precision under another micro-batch split or chunking moves
their log-probs too (kernels reduce in another order for another shape). A run that records that
trainer-vs-trainer gap (``probes.rollout_consistency.logprob_gap_totals`` under ``trainer_self/`` in
``scalars``, from the same ``logprob_gap_columns`` as the rollout gap) gets per step both gaps, by the same
definitions: mean |Δ| = Σ|Δ| / Σ tokens, the share of tokens with |Δ| over the threshold, and the share with
the importance ratio exp(Δ) outside [0.9, 1.1]; the excess is the rollout's figure minus the floor's.
"""

from __future__ import annotations

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.analyses.rollouts import logprob_gap_by_step

__all__ = ["SELF_PREFIX", "logprob_gap_floor_by_step"]

SELF_PREFIX = "trainer_self/"  # probes.rollout_consistency.TRAINER_SELF (analyses do not import the probes)

_SCHEMA = {"run_id": pl.String, "step": pl.Int64, "tokens_count": pl.Int64,
           "rollout_gap_mean_nats": pl.Float64, "rollout_gap_over_pct": pl.Float64, "rollout_ratio_outside_pct": pl.Float64,
           "self_tokens_count": pl.Int64, "self_gap_mean_nats": pl.Float64, "self_gap_max_nats": pl.Float64,
           "self_gap_over_pct": pl.Float64, "self_ratio_outside_pct": pl.Float64,
           "excess_gap_mean_nats": pl.Float64, "excess_over_pct": pl.Float64, "excess_ratio_outside_pct": pl.Float64}


def logprob_gap_floor_by_step(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """Per step with both gaps recorded: the rollout gap (``logprob_gap_by_step``), the trainer-vs-trainer gap,
    and the excess of the first over the second. Columns: run_id, step, tokens_count, rollout_gap_mean_nats,
    rollout_gap_over_pct, rollout_ratio_outside_pct, self_tokens_count, self_gap_mean_nats, self_gap_max_nats,
    self_gap_over_pct, self_ratio_outside_pct, excess_gap_mean_nats, excess_over_pct, excess_ratio_outside_pct."""
    con = as_store(store)

    def key(name: str) -> str:
        return f"sum(value) FILTER (WHERE key = '{SELF_PREFIX}{name}')"

    own = frame(con, f"""
        SELECT run_id, step, {key('logprob_gap_tokens_count')}::BIGINT AS self_tokens_count,
               {key('logprob_gap_sum_nats')} / nullif({key('logprob_gap_tokens_count')}, 0) AS self_gap_mean_nats,
               max(value) FILTER (WHERE key = '{SELF_PREFIX}logprob_gap_max_nats') AS self_gap_max_nats,
               100.0 * {key('logprob_gap_over_count')} / nullif({key('logprob_gap_tokens_count')}, 0) AS self_gap_over_pct,
               100.0 * {key('logprob_ratio_outside_count')} / nullif({key('logprob_gap_tokens_count')}, 0)
                   AS self_ratio_outside_pct
        FROM scalars WHERE key LIKE '{SELF_PREFIX}%' AND step IS NOT NULL{run_clause(run)}
        GROUP BY run_id, step""")
    gap = logprob_gap_by_step(con, run=run)
    if own.is_empty() or gap.is_empty():
        return pl.DataFrame(schema=_SCHEMA)
    both = gap.select("run_id", "step", "tokens_count", pl.col("logprob_gap_mean_nats").alias("rollout_gap_mean_nats"),
                      pl.col("logprob_gap_over_pct").alias("rollout_gap_over_pct"),
                      pl.col("logprob_ratio_outside_pct").alias("rollout_ratio_outside_pct")).join(
        own, on=["run_id", "step"], how="inner")
    both = both.with_columns(
        (pl.col("rollout_gap_mean_nats") - pl.col("self_gap_mean_nats")).alias("excess_gap_mean_nats"),
        (pl.col("rollout_gap_over_pct") - pl.col("self_gap_over_pct")).alias("excess_over_pct"),
        (pl.col("rollout_ratio_outside_pct") - pl.col("self_ratio_outside_pct")).alias("excess_ratio_outside_pct"))
    return both.sort("run_id", "step").select([pl.col(c).cast(t) for c, t in _SCHEMA.items()])
