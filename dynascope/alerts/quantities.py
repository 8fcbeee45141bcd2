"""What a rule can watch: each quantity is one series per (run, role, rank) of per-step values.

Every function takes the store and the first step to read (``since``: earlier steps were judged at an
earlier poll) and returns ``run_id, role, rank, part, step, value`` (rank NULL for a run-wide series; ``part``
splits a rank's series where a quantity has several, NULL where it has one):

- detectors of ``detect_instability`` (``grad_norm_spike``, ``loss_spike``, ``entropy_collapse``,
  ``nan_inf``): one row per event it reports, with the value it reports;
- ``straggler_score``: per rank, phase (``part``) and step, the cross-rank median time over the rank's own
  time in the phase (1 = as fast as the median, 0.5 = twice as slow; a rank faster than the median scores
  1), for the phases whose cross-rank median is at least 5 ms, and 1 where the rank's excess over the
  median is within the phase's noise, as ``straggler_scores`` compares them; the probe's own phase is
  ``probe_pct``'s, not a straggler's (rank 0 runs the monitor: on a busy host, its probe time is the
  observer's, not the rank's). One series per phase, so a
  rule's window counts steps slow in the same phase: a busy host slows one phase one step and another the
  next, a straggler the same phase step after step;
- ``phase_ms:<phase>`` (``weight_sync_ms`` is ``phase_ms:weight_sync``): the rank's time in the phase;
- ``rollout_tail_x``: p99 over p50 generation time of the step's samples; ``gen_p99_ms``;
- ``logprob_gap_over_pct``, ``logprob_gap_max_nats``, ``logprob_gap_mean_nats``: ``logprob_gap_by_step``;
- ``probe_pct``: the probe's own time as a share of the rank's step time;
- anything else: a logged scalar, by key (``loss``, ``frac_reward_zero_std``...) or by the last part of a
  key (``train/loss`` is ``loss``), per rank.
"""

from __future__ import annotations

from collections.abc import Callable

import polars as pl

from dynascope.analyses import detect_instability, logprob_gap_by_step, rollout_long_tail
from dynascope.analyses.probe_time import PROBE_PHASE
from dynascope.analyses.steps import STEP_ROW
from dynascope.analyses.stragglers import MIN_EFFECT_MS, NOISE_K, straggler_phases_sql
from dynascope.store import StoreConnection, quote_literal

__all__ = ["DETECTORS", "MIN_PHASE_MS", "series"]

DETECTORS = ("grad_norm_spike", "loss_spike", "entropy_collapse", "nan_inf")
MIN_PHASE_MS = 5.0  # phases shorter than this on the median rank are noise to a straggler rule
NOISE_STEPS = 200  # the steps before the first judged one that the noise floor is measured over
SCHEMA = {"run_id": pl.String, "role": pl.String, "rank": pl.Int32, "part": pl.String, "step": pl.Int64,
          "value": pl.Float64}


def _typed(df: pl.DataFrame) -> pl.DataFrame:
    if df.is_empty():
        return pl.DataFrame(schema=SCHEMA)
    return df.select([(pl.col(c) if c in df.columns else pl.lit(None)).cast(t).alias(c) for c, t in SCHEMA.items()])


def _detector(name: str) -> Callable[..., pl.DataFrame]:
    def rows(con: StoreConnection, since: int, cache: dict | None = None) -> pl.DataFrame:
        # the four detectors are one analysis over the whole run: run once per poll, not once per rule
        cache = {} if cache is None else cache
        if "detect_instability" not in cache:
            cache["detect_instability"] = detect_instability(con)
        df = cache["detect_instability"]
        return _typed(df.filter((pl.col("event") == name) & (pl.col("step") >= since)))
    return rows


def _straggler(con: StoreConnection, since: int) -> pl.DataFrame:
    # straggler_scores' false-straggler floor, per step: a rank scores below 1 only where its time exceeds
    # the step's cross-rank median by more than the phase's noise (NOISE_K · 1.4826 · MAD of each rank's
    # time minus that median, over the last NOISE_STEPS steps, the median over ranks) and MIN_EFFECT_MS.
    df = con.frame(f"""
        WITH p AS ({straggler_phases_sql(None, f' AND step >= {int(since) - NOISE_STEPS}')}),
        m AS (SELECT *, median(dur_us) OVER (PARTITION BY run_id, role, step, phase) AS med_us,
                     count(*) OVER (PARTITION BY run_id, role, step, phase) AS ranks FROM p),
        noise AS (SELECT run_id AS n_run, role AS n_role, phase AS n_phase, median(sigma_us) AS noise_us FROM (
                      SELECT run_id, role, rank, phase, 1.4826 * mad(dur_us - med_us) AS sigma_us FROM m
                      WHERE ranks >= 2 GROUP BY ALL) GROUP BY ALL)
        SELECT run_id, role, rank, phase AS part, step,
               CASE WHEN dur_us - med_us > greatest({NOISE_K} * coalesce(noise_us, 0), {MIN_EFFECT_MS * 1000})
                    THEN least(1.0, med_us / nullif(dur_us, 0)) ELSE 1.0 END AS value
        FROM m LEFT JOIN noise ON run_id IS NOT DISTINCT FROM n_run AND role = n_role AND phase = n_phase
        WHERE ranks >= 2 AND med_us >= {MIN_PHASE_MS * 1000} AND step >= {int(since)}""")
    return _typed(df)


def _phase(phase: str) -> Callable[[StoreConnection, int], pl.DataFrame]:
    def rows(con: StoreConnection, since: int) -> pl.DataFrame:
        return _typed(con.frame(f"""
            SELECT run_id, role, rank, step, SUM(dur_us) / 1000.0 AS value FROM timings
            WHERE step >= {int(since)} AND phase = {quote_literal(phase)} AND stream IS NULL
            GROUP BY run_id, role, rank, step"""))
    return rows


def _probe_pct(con: StoreConnection, since: int) -> pl.DataFrame:
    return _typed(con.frame(f"""
        SELECT run_id, role, rank, step,
               100.0 * SUM(dur_us) FILTER (WHERE phase = {quote_literal(PROBE_PHASE)})
                     / nullif(SUM(dur_us) FILTER (WHERE {STEP_ROW}), 0) AS value
        FROM timings WHERE step >= {int(since)} AND stream IS NULL
        GROUP BY run_id, role, rank, step HAVING value IS NOT NULL"""))


def _per_step(fn: Callable[[StoreConnection], pl.DataFrame], expr: pl.Expr) -> Callable[..., pl.DataFrame]:
    def rows(con: StoreConnection, since: int) -> pl.DataFrame:
        df = fn(con)
        if df.is_empty():
            return _typed(df)
        return _typed(df.filter(pl.col("step") >= since).with_columns(expr.alias("value")))
    return rows


def _scalar(key: str) -> Callable[[StoreConnection, int], pl.DataFrame]:
    def rows(con: StoreConnection, since: int) -> pl.DataFrame:
        k = quote_literal(key)
        return _typed(con.frame(f"""
            SELECT run_id, role, rank, step, arg_max(value, time_us) AS value FROM scalars
            WHERE step >= {int(since)} AND (key = {k} OR ends_with(key, '/' || {k}))
            GROUP BY run_id, role, rank, step"""))
    return rows


_NAMED: dict[str, Callable[..., pl.DataFrame]] = {
    **{d: _detector(d) for d in DETECTORS},
    "straggler_score": _straggler,
    "weight_sync_ms": _phase("weight_sync"),
    "probe_pct": _probe_pct,
    "rollout_tail_x": _per_step(rollout_long_tail, pl.col("gen_p99_ms") / pl.col("gen_p50_ms")),
    "gen_p99_ms": _per_step(rollout_long_tail, pl.col("gen_p99_ms")),
    **{c: _per_step(logprob_gap_by_step, pl.col(c))
       for c in ("logprob_gap_over_pct", "logprob_gap_max_nats", "logprob_gap_mean_nats")},
}


def series(con: StoreConnection, quantity: str, since: int = 0, cache: dict | None = None) -> pl.DataFrame:
    """The quantity's per-step values from step ``since`` on (see the module docstring for the names);
    ``cache``: one dict per pass over the same store, for what several quantities share."""
    if quantity in DETECTORS:
        return _NAMED[quantity](con, since, cache)
    if quantity in _NAMED:
        return _NAMED[quantity](con, since)
    if quantity.startswith("phase_ms:"):
        return _phase(quantity.split(":", 1)[1])(con, since)
    return _scalar(quantity)(con, since)
