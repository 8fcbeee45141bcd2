"""Combine per-shard ``tensor_stats`` rows (FSDP2/DTensor, ``sharded=True``) into global per-tensor rows.

Rows in, frame out, as the column registry says (``store.schema.TENSOR_STATS_COLUMNS``): each rank
records its local shard, and every column declares how shards combine (``Column.reduce``): norms as
the root of the sum of squares, counts as sums, max-abs as a max. Fractions and ratios are then
re-derived from the combined states (``frac_of``, ``ratio``), never averaged. A combined value is NULL
if any shard's is NULL, and every statistic of a step is NULL where its shards hold fewer elements
than the tensor's fullest step (a shard's row missing). Unsharded rows (DDP replicas hold identical
weights) pass through once, from the lowest rank, and the rows of HSDP's further replicas (``replica`` > 0)
are left out (``store.pooling``). It sits beside the rollups (``rollup.py``), the other reader of the registry's
reductions: both pool stored rows exactly, one across tensors, this one across ranks.

One caveat: ``grad_near_zero_count`` uses each shard's own rms as the threshold, so its combined sum
is exact per shard but not the count against the whole tensor's rms.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from dynascope.store.schema import TENSOR_STATS_COLUMNS

__all__ = ["REDUCTIONS", "combine_shards"]

REDUCTIONS: dict[str, str] = {c.name: c.reduce for c in TENSOR_STATS_COLUMNS if c.reduce in ("sum", "norm", "max")}
_REDUCED = frozenset(REDUCTIONS.values())
_KEYS = ["run_id", "role", "step", "tensor"]
_CARRIED = ("time_us", "stage")  # per-step columns taken from the first shard


def _reduce(col: str, how: str) -> pl.Expr:
    c = pl.col(col)
    if how == "norm":
        value = c.cast(pl.Float64).pow(2).sum().sqrt()
    elif how == "sum":
        value = c.sum()
    elif how == "max":
        value = c.max()
    else:  # pragma: no cover - the registry declared a reduction this module does not know
        raise ValueError(f"unknown reduction {how!r} for {col}")
    return pl.when(c.null_count() > 0).then(None).otherwise(value).alias(col)


def combine_shards(rows: Any) -> pl.DataFrame:
    """One row per (run_id, role, step, tensor) from per-rank rows; ``shards`` counts the ranks combined.

    ``rows``: a polars DataFrame or anything ``pl.DataFrame(...)`` accepts (pyarrow Table, dicts).
    """
    df = rows if isinstance(rows, pl.DataFrame) else pl.DataFrame(rows)
    if df.is_empty():
        return df.with_columns(pl.lit(0).alias("shards"))
    # store.pooling's rule: shards of replica 0 combine; a replica's rows are copies; whole tensors once.
    is_shard = pl.col("sharded").fill_null(False)
    replica = pl.col("replica").fill_null(0) if "replica" in df.columns else pl.lit(0)
    sharded = df.filter(is_shard & (replica == 0))
    whole = (df.filter(~is_shard).sort("rank")
             .group_by(_KEYS, maintain_order=True).first().with_columns(pl.lit(1).alias("shards")))
    if sharded.is_empty():
        return whole.drop("rank")
    # ‖W₀‖ of each shard (drift_ratio's denominator), recovered from drift_ratio = ‖W−W₀‖/‖W₀‖.
    sharded = sharded.with_columns(
        pl.when(pl.col("drift_norm") == 0).then(pl.col("w_norm"))  # W == W₀ on this shard
        .when(pl.col("drift_ratio") > 0).then(pl.col("drift_norm") / pl.col("drift_ratio"))
        .otherwise(None).alias("ref_norm"))
    present = [c for c in TENSOR_STATS_COLUMNS if c.name in df.columns]
    aggs = ([pl.col(c.name).first() for c in present if c.reduce == "first"]
            + [pl.col(c.name).all() for c in present if c.reduce == "all"]
            + [_reduce(c.name, c.reduce) for c in present if c.reduce is not None and c.reduce in _REDUCED]
            + [pl.col(c).first() for c in _CARRIED if c in df.columns]
            + [_reduce("ref_norm", "norm"), pl.len().alias("shards"), pl.lit(True).alias("sharded")]
            # the combined row is the whole tensor: no one shard's coordinates; the replica that counted
            + ([pl.lit(None, dtype=pl.String).alias("shard")] if "shard" in df.columns else [])
            + ([pl.col("replica").first()] if "replica" in df.columns else []))
    out = sharded.group_by(_KEYS, maintain_order=True).agg(aggs)
    out = out.with_columns(
        [(pl.when(pl.col(c.ratio[1]) > 0).then(pl.col(c.ratio[0]) / pl.col(c.ratio[1])).otherwise(None)).alias(c.name)
         for c in present if c.ratio is not None]
        + [(pl.col(c.frac_of) / pl.col("numel")).alias(c.name)
           for c in present if c.frac_of is not None and c.frac_of in out.columns]
    ).drop("ref_norm")
    # A step where a shard's row is missing (a rank lost its writes, or recorded another step) would combine
    # into a smaller tensor's plausible statistics: NULL them where fewer elements were seen than at the
    # tensor's fullest step. Counting elements rather than ranks keeps a run resharded onto another world
    # size whole.
    partial = pl.col("numel") < pl.col("numel").max().over(["run_id", "role", "tensor"])
    keep = {*_KEYS, *_CARRIED, "numel", "shards", "sharded", "shard", "replica",
            *(c.name for c in present if c.reduce == "first")}
    out = out.with_columns([pl.when(partial).then(None).otherwise(pl.col(c)).alias(c)
                            for c in out.columns if c not in keep])
    cols = [c for c in df.columns if c != "rank"] + ["shards"]
    out = out.select([c for c in cols if c in out.columns])
    return pl.concat([whole.select(out.columns), out], how="vertical_relaxed").sort(_KEYS)
