"""RL rollouts: the generation long tail, wasted GRPO groups, and asynchronous-RL staleness and overlap.

Inputs are ``samples`` rows (one per generated response: ``gen_start_us``/``gen_end_us``, ``gen_ms``,
``response_len``, ``reward``, ``group_id``, ``policy_version``/``trainer_version``) and, for overlap and
weight-sync time, ``timings`` phase rows. A sample's generation time is ``gen_ms`` or, when that is NULL,
``(gen_end_us − gen_start_us) / 1000``.
"""

from __future__ import annotations

from collections.abc import Iterable

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, intervals_union_sql, run_clause
from dynascope.analyses.steps import STEP_ROW
from dynascope.store import quote_literal

__all__ = ["async_staleness", "logprob_gap_by_step", "rollout_long_tail", "rollout_train_overlap",
           "tail_wait_share", "tail_wait_summary", "weight_sync_checks", "zero_variance_groups"]

ROLLOUT_PHASES = ("rollout", "generate", "generation")
TRAIN_PHASES = ("train", "forward", "backward", "optimizer", "update_actor", "actor_update")
# A forward pass inside these phases is inference for rollouts/rewards, not training.
NOT_TRAIN_PARENTS = ("rollout", "generate", "generation", "reward", "ref_logprob", "old_logprob")
WEIGHT_SYNC_PHASES = ("weight_sync", "sync_weights", "update_weights")


def weight_syncs_sql(where: str = "") -> str:
    """One row per weight sync (``run_id, step, span_us``): the weight-sync rows of one run and step whose
    intervals overlap, directly or through each other, are the ranks' parts of one sync (trainers
    broadcasting while workers load), its time the wall-clock span from the first part's start to the last
    part's end. The step alone does not tie rows together: in asynchronous RL a trainer's publish and a
    rollout worker's load carry their own roles' step counts, so the same number names unrelated moments.
    A row without a step or a start is a sync of its own, its duration its time. ``where``: extra
    conditions on ``timings``, each starting with AND."""
    parts = intervals_union_sql("SELECT * FROM w WHERE step IS NOT NULL AND s IS NOT NULL", "run_id, step")
    return f"""WITH w AS (
            SELECT run_id, step, start_us AS s, start_us + dur_us AS e, dur_us FROM timings
            WHERE phase IN {_in(WEIGHT_SYNC_PHASES)} AND stream IS NULL AND dur_us IS NOT NULL{where})
        SELECT run_id, step, e - s AS span_us FROM ({parts})
        UNION ALL SELECT run_id, step, dur_us FROM w WHERE step IS NULL OR s IS NULL"""


_GEN_MS = "coalesce(gen_ms, (gen_end_us - gen_start_us) / 1000.0)"


def _in(names: Iterable[str]) -> str:
    return "(" + ", ".join(quote_literal(n) for n in names) + ")"


def rollout_long_tail(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """Per step: response-length and generation-time distribution (p50/p90/p99/max).

    Columns: run_id, step, samples, response_len_{p50,p90,p99,max}_tokens, gen_{p50,p90,p99,max}_ms,
    gen_tail_x (max / p50 generation time).
    """
    q = ", ".join(f"quantile_cont(response_len, {p / 100}) AS response_len_p{p}_tokens" for p in (50, 90, 99))
    g = ", ".join(f"quantile_cont({_GEN_MS}, {p / 100}) AS gen_p{p}_ms" for p in (50, 90, 99))
    return frame(as_store(store), f"""
        SELECT run_id, step, COUNT(*) AS samples, {q}, MAX(response_len)::DOUBLE AS response_len_max_tokens,
               {g}, MAX({_GEN_MS}) AS gen_max_ms,
               MAX({_GEN_MS}) / nullif(quantile_cont({_GEN_MS}, 0.5), 0) AS gen_tail_x
        FROM samples WHERE step IS NOT NULL{run_clause(run)}
        GROUP BY run_id, step ORDER BY run_id, step""")


def tail_wait_share(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """Per step: the time between the median sample finishing and the last one finishing, over step time.

    Step time is the longest step row of that step (any rank or role); without step rows it falls back to
    the rollout span (first generation start to last end), named in ``step_source``. Columns: run_id,
    step, samples, tail_wait_ms, rollout_span_ms, step_ms, step_source, tail_wait_pct.
    """
    return frame(as_store(store), f"""
        WITH s AS (
            SELECT run_id, step, COUNT(*) AS samples,
                   (MAX(gen_end_us) - quantile_cont(gen_end_us, 0.5)) / 1000.0 AS tail_wait_ms,
                   (MAX(gen_end_us) - MIN(gen_start_us)) / 1000.0 AS rollout_span_ms
            FROM samples WHERE step IS NOT NULL AND gen_end_us IS NOT NULL{run_clause(run)}
            GROUP BY run_id, step),
        st AS (
            SELECT run_id, step, MAX(dur_us) / 1000.0 AS step_ms FROM timings
            WHERE {STEP_ROW}{run_clause(run)} GROUP BY run_id, step)
        SELECT s.run_id, s.step, s.samples, s.tail_wait_ms, s.rollout_span_ms,
               coalesce(st.step_ms, s.rollout_span_ms) AS step_ms,
               CASE WHEN st.step_ms IS NULL THEN 'rollout_span' ELSE 'step_rows' END AS step_source,
               100.0 * s.tail_wait_ms / nullif(coalesce(st.step_ms, s.rollout_span_ms), 0) AS tail_wait_pct
        FROM s LEFT JOIN st USING (run_id, step) ORDER BY s.run_id, s.step""")


def tail_wait_summary(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """Per run: the share of step time spent waiting for the tail, over all its steps with samples.

    ``tail_wait_pct`` is Σ tail_wait_ms / Σ step_ms over the steps of ``tail_wait_share`` (a long step
    weighs more than a short one: it is the share of the run's time), the one figure the report, the demo
    and the dashboard show. Columns: run_id, steps, tail_wait_ms, step_ms, tail_wait_pct,
    median_tail_wait_ms, step_source (``step_rows`` when every step had a step row, else ``rollout_span``).
    """
    per = tail_wait_share(store, run)
    return per.group_by("run_id", maintain_order=True).agg(
        pl.len().alias("steps"), pl.col("tail_wait_ms").sum(), pl.col("step_ms").sum(),
        (100 * pl.col("tail_wait_ms").sum() / pl.col("step_ms").sum()).alias("tail_wait_pct"),
        pl.col("tail_wait_ms").median().alias("median_tail_wait_ms"),
        pl.when((pl.col("step_source") == "step_rows").all()).then(pl.lit("step_rows"))
        .otherwise(pl.lit("rollout_span")).alias("step_source"))


def zero_variance_groups(store: StoreLike, run: str | None = None, *, eps: float = 1e-9) -> pl.DataFrame:
    """Per step: GRPO groups whose rewards are all equal (within ``eps``), so their advantages are all zero
    and the rollouts taught nothing.

    Only groups with at least two rewarded samples count. Columns: run_id, step, groups,
    zero_variance_groups, zero_variance_pct, samples, wasted_samples.
    """
    return frame(as_store(store), f"""
        WITH g AS (
            SELECT run_id, step, group_id, COUNT(*) AS n, MAX(reward) - MIN(reward) <= {float(eps)} AS zero
            FROM samples
            WHERE step IS NOT NULL AND group_id IS NOT NULL AND reward IS NOT NULL
              AND isfinite(reward){run_clause(run)}
            GROUP BY run_id, step, group_id HAVING COUNT(*) >= 2)
        SELECT run_id, step, COUNT(*) AS groups, SUM(zero::INT)::BIGINT AS zero_variance_groups,
               100.0 * SUM(zero::INT) / COUNT(*) AS zero_variance_pct, SUM(n)::BIGINT AS samples,
               coalesce(SUM(CASE WHEN zero THEN n END), 0)::BIGINT AS wasted_samples
        FROM g GROUP BY run_id, step ORDER BY run_id, step""")


def logprob_gap_by_step(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """Per step: how far the rollout engine's log-probs of the sampled tokens were from the trainer's.

    From the ``logprob_gap_*`` columns of ``samples`` (``probes.rollout_consistency.logprob_gap_columns``):
    mean |Δ| = Σ gap / Σ tokens over the step's samples, the largest |Δ| of any token, and the share of
    tokens whose |Δ| exceeded the threshold they were counted against, and the share whose importance ratio
    exp(Δ) fell outside [0.9, 1.1] (NULL where the samples did not count it). Steps without those columns are
    left out. Columns: run_id, step, samples, tokens_count, logprob_gap_mean_nats, logprob_gap_max_nats,
    logprob_gap_over_pct, threshold_nats, logprob_ratio_outside_pct.
    """
    con = as_store(store)
    cols = {r[0] for r in con.rows("SELECT column_name FROM (DESCRIBE samples)")}
    schema = {"run_id": pl.String, "step": pl.Int64, "samples": pl.Int64, "tokens_count": pl.Int64,
              "logprob_gap_mean_nats": pl.Float64, "logprob_gap_max_nats": pl.Float64,
              "logprob_gap_over_pct": pl.Float64, "threshold_nats": pl.Float64, "logprob_ratio_outside_pct": pl.Float64}
    if "logprob_gap_sum_nats" not in cols:
        return pl.DataFrame(schema=schema)
    ratio = ("100.0 * SUM(logprob_ratio_outside_count) / nullif(SUM(logprob_gap_tokens_count) FILTER "
             "(WHERE logprob_ratio_outside_count IS NOT NULL), 0)" if "logprob_ratio_outside_count" in cols else "NULL")
    df = frame(con, f"""
        SELECT run_id, step, COUNT(*) AS samples, SUM(logprob_gap_tokens_count)::BIGINT AS tokens_count,
               SUM(logprob_gap_sum_nats) / nullif(SUM(logprob_gap_tokens_count), 0) AS logprob_gap_mean_nats,
               MAX(logprob_gap_max_nats) AS logprob_gap_max_nats,
               100.0 * SUM(logprob_gap_over_count) / nullif(SUM(logprob_gap_tokens_count), 0) AS logprob_gap_over_pct,
               MAX(logprob_gap_threshold_nats) AS threshold_nats,
               {ratio} AS logprob_ratio_outside_pct
        FROM samples WHERE step IS NOT NULL AND logprob_gap_sum_nats IS NOT NULL{run_clause(run)}
        GROUP BY run_id, step ORDER BY run_id, step""")
    return df.select([pl.col(c).cast(t) for c, t in schema.items()])


def weight_sync_checks(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """Per step: what ``verify_weight_sync`` found after that step's weight sync (its scalars and events).

    Columns: run_id, step, tensors_checked_count, mismatched_tensors_count (the worst check of the step),
    message (the ``weight_sync_mismatch`` events' text naming the tensors, NULL when none).
    """
    return frame(as_store(store), f"""
        WITH s AS (
            SELECT run_id, step,
                   max(value) FILTER (WHERE key = 'weight_sync/tensors_checked')::BIGINT AS tensors_checked_count,
                   max(value) FILTER (WHERE key = 'weight_sync/mismatched_tensors')::BIGINT AS mismatched_tensors_count
            FROM scalars WHERE key IN ('weight_sync/tensors_checked', 'weight_sync/mismatched_tensors')
                 AND step IS NOT NULL{run_clause(run)}
            GROUP BY run_id, step),
        e AS (
            SELECT run_id, step, string_agg(message, ' | ' ORDER BY time_us) AS message FROM events
            WHERE event = 'weight_sync_mismatch'{run_clause(run)} GROUP BY run_id, step)
        SELECT s.run_id, s.step, s.tensors_checked_count, s.mismatched_tensors_count, e.message
        FROM s LEFT JOIN e USING (run_id, step) ORDER BY s.run_id, s.step""")


def async_staleness(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """Distribution of sample staleness = trainer_version − policy_version (in optimizer steps).

    Columns: run_id, staleness_steps, samples, share_pct.
    """
    return frame(as_store(store), f"""
        SELECT run_id, trainer_version - policy_version AS staleness_steps, COUNT(*) AS samples,
               100.0 * COUNT(*) / SUM(COUNT(*)) OVER (PARTITION BY run_id) AS share_pct
        FROM samples WHERE trainer_version IS NOT NULL AND policy_version IS NOT NULL{run_clause(run)}
        GROUP BY run_id, trainer_version - policy_version ORDER BY run_id, staleness_steps""")


def rollout_train_overlap(store: StoreLike, run: str | None = None, *,
                          rollout_phases: Iterable[str] = ROLLOUT_PHASES,
                          train_phases: Iterable[str] = TRAIN_PHASES) -> pl.DataFrame:
    """Per run: how much rollout and training ran at the same time (asynchronous RL), and weight-sync time.

    Rollout time and train time are each the union of their phase intervals over all ranks and roles
    (a ``forward`` nested in rollout/reward/ref_logprob is not training). ``overlap_ms`` is the length of
    the intersection of the two unions, ``overlap_pct`` its share of the wall time from the first to the
    last of those intervals; in a synchronous run it is only the jitter between ranks. ``disaggregated``
    is true when no actor (role, rank) ran both rollout and train phases, as in asynchronous RL with
    separate rollout workers. Columns: run_id, wall_ms, rollout_ms, train_ms, overlap_ms, overlap_pct,
    disaggregated, weight_syncs, weight_sync_ms (a sync's time is the wall-clock span of its overlapping
    parts over the ranks and roles: ``weight_syncs_sql``).
    """
    rp, tp, npar = _in(rollout_phases), _in(train_phases), _in(NOT_TRAIN_PARENTS)
    return frame(as_store(store), f"""
        WITH iv AS (
            SELECT run_id, CASE WHEN phase IN {rp} THEN 'rollout' ELSE 'train' END AS kind,
                   start_us AS s, start_us + dur_us AS e, coalesce(role, '') AS role, rank
            FROM timings
            WHERE coalesce(category, 'phase') = 'phase' AND stream IS NULL AND dur_us > 0 AND start_us IS NOT NULL
              AND (phase IN {rp} OR (phase IN {tp} AND coalesce(parent, '') NOT IN {npar})){run_clause(run)}),
        u AS ({intervals_union_sql("SELECT run_id, kind, s, e FROM iv", "run_id, kind")}),
        both_ AS (SELECT run_id, COUNT(*) AS n FROM (
                     SELECT run_id, role, rank FROM iv GROUP BY ALL HAVING COUNT(DISTINCT kind) = 2)
                  GROUP BY run_id),
        tot AS (
            SELECT run_id, (MAX(e) - MIN(s)) / 1000.0 AS wall_ms,
                   coalesce(SUM(CASE WHEN kind = 'rollout' THEN e - s END), 0) / 1000.0 AS rollout_ms,
                   coalesce(SUM(CASE WHEN kind = 'train' THEN e - s END), 0) / 1000.0 AS train_ms
            FROM u GROUP BY run_id),
        ov AS (
            SELECT r.run_id, SUM(least(r.e, t.e) - greatest(r.s, t.s)) / 1000.0 AS overlap_ms
            FROM u r JOIN u t ON r.run_id = t.run_id AND r.kind = 'rollout' AND t.kind = 'train'
                              AND t.s < r.e AND r.s < t.e
            GROUP BY r.run_id),
        ws AS (
            SELECT run_id, COUNT(*) AS weight_syncs, SUM(span_us) / 1000.0 AS weight_sync_ms
            FROM ({weight_syncs_sql(run_clause(run))}) GROUP BY run_id)
        SELECT tot.run_id, tot.wall_ms, tot.rollout_ms, tot.train_ms, coalesce(ov.overlap_ms, 0) AS overlap_ms,
               100.0 * coalesce(ov.overlap_ms, 0) / nullif(tot.wall_ms, 0) AS overlap_pct,
               coalesce(both_.n, 0) = 0 AS disaggregated,
               coalesce(ws.weight_syncs, 0) AS weight_syncs, coalesce(ws.weight_sync_ms, 0) AS weight_sync_ms
        FROM tot LEFT JOIN ov USING (run_id) LEFT JOIN ws USING (run_id) LEFT JOIN both_ USING (run_id)
        ORDER BY tot.run_id""")
