"""Which ranks are slower than their role, by their busy time in each step: the one rule the report's
findings and the dashboard's Cluster page both name ranks by.

In a synchronous step every rank's step lasts as long as the slowest rank's (the others wait in the
collectives), so ranks are told apart by their *busy* time: the top-level phases without waits and
collectives (the definitions of ``steps``), in the steps with the rank's step row, each against the
cross-rank median of its role in that step. ``rank_busy`` gives the per-rank table; ``rank_steps``,
``relative_busy`` and ``rank_table`` are its stages, which the dashboard keeps apart to cache and draw them.
"""

from __future__ import annotations

from statistics import NormalDist

import polars as pl

from dynascope.analyses._common import StoreLike, as_store
from dynascope.store import quote_literal

__all__ = ["rank_busy"]

_STEP_KEYS = ["role", "step"]


def rank_steps(store, run: str) -> pl.DataFrame:
    """Per (role, rank, step) with busy time: ``busy_us``, the top-level phases without waits and
    collectives (the definitions of ``dynascope.analyses.steps``), filtered before they are summed. Only
    steps with the rank's step row count, as in the report, ``dynascope runs`` and the what-if: phases after
    the last optimizer step (a final evaluation) are no step."""
    from dynascope.analyses.steps import STEP_ROW, SYNC, TOP_LEVEL

    r = quote_literal(run)
    return store.frame(f"""
        WITH busy AS (SELECT coalesce(role, '') AS role, rank, step, sum(dur_us) AS busy_us
                      FROM timings WHERE run_id = {r} AND {TOP_LEVEL} AND NOT ({SYNC}) GROUP BY ALL),
             st AS (SELECT DISTINCT coalesce(role, '') AS role, rank, step FROM timings WHERE run_id = {r} AND {STEP_ROW})
        SELECT busy.* FROM busy SEMI JOIN st USING (role, rank, step) ORDER BY role, rank, step""")


def relative_busy(rs: pl.DataFrame) -> pl.DataFrame:
    """Each (role, rank, step) with busy time and the step's cross-rank median busy time of its role:
    ``rel_pct`` = 100 · (busy / median − 1). Steps timed on a single rank of the role are left out."""
    busy = rs.filter(pl.col("busy_us").is_not_null())
    return (busy.with_columns(pl.col("busy_us").median().over(_STEP_KEYS).alias("median_us"),
                              pl.len().over(_STEP_KEYS).alias("ranks"))
            .filter((pl.col("ranks") > 1) & (pl.col("median_us") > 0))
            .with_columns((100.0 * (pl.col("busy_us") / pl.col("median_us") - 1)).alias("rel_pct")))


def rank_table(rel: pl.DataFrame, alpha: float = 0.01) -> pl.DataFrame:
    """Per rank, from ``relative_busy``: mean busy ms per step, ``score_pct`` (its busy time over the run
    against the step medians', 100 · (Σ busy / Σ median − 1): negative for a rank faster than the median),
    how often it was its role's slowest and above the median (``above_median_pct``), and ``slow``: whether
    it stands out as slower than its role.

    A rank slower than the median (``score_pct`` > 0) stands out on either of two counts, each one-sided at
    ``alpha`` shared among its role's ranks: it is above the step's median in more steps than chance allows
    (a rank no slower than the others is above it in about half of them, so its count is tested against
    Binomial(n, ½), normal approximation): slow at most steps; or its ``score_pct`` lies beyond its role's
    ranks' spread (robust z over 1.4826 · MAD of the role's scores, as a normal deviate): slow by much at
    some steps, as a rollout worker that drew the long tail. A rank slower by less than its role's
    step-to-step jitter and its ranks' spread, or faster, does not stand out.

    What a rank costs the step ("what if rank R ran at the median") is ``what_if``'s scenario ``rank R``.
    """
    order = pl.col("busy_us").rank("ordinal", descending=True).over(_STEP_KEYS)
    df = (rel.with_columns(order.alias("pos")).group_by("role", "rank").agg(
        (pl.col("busy_us").mean() / 1000).alias("mean_busy_ms"),
        (100.0 * (pl.col("busy_us").sum() / pl.col("median_us").sum() - 1)).alias("score_pct"),
        (100.0 * (pl.col("pos") == 1).mean()).alias("slowest_share_pct"),
        (100.0 * (pl.col("rel_pct") > 0).mean()).alias("above_median_pct"), pl.len().alias("steps")))
    n, k = pl.col("steps"), pl.col("above_median_pct") * pl.col("steps") / 100
    z_steps = (k - n / 2 - 0.5) / (n.sqrt() / 2)  # continuity-corrected
    score = pl.col("score_pct")
    spread = 1.4826 * (score - score.median().over("role")).abs().median().over("role")
    z_spread = (score - score.median().over("role")) / spread  # inf for a lone outlier among equal ranks
    need = pl.col("rank").count().over("role").map_elements(
        lambda ranks: NormalDist().inv_cdf(1 - alpha / ranks), return_dtype=pl.Float64)
    out = ((score > 0) & ((z_steps >= need) | (z_spread.fill_nan(0.0) >= need))).fill_null(False)
    return df.with_columns(out.alias("slow")).sort(["score_pct", "role", "rank"], descending=[True, False, False])


def rank_busy(store: StoreLike, run: str, *, alpha: float = 0.01) -> pl.DataFrame:
    """Per (role, rank) of ``run``: ``rank_table``'s columns (mean_busy_ms, score_pct, slowest_share_pct,
    above_median_pct, steps, slow). Empty when no step was timed on two or more ranks of a role."""
    return rank_table(relative_busy(rank_steps(as_store(store), run)), alpha)
