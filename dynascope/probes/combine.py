"""Combine per-shard ``tensor_stats`` rows (FSDP2/DTensor, ``sharded=True``) into global per-tensor rows.

Each rank records its local shard with states that combine exactly, as each probe declares
(``UPDATE_REDUCTIONS``, ``GRAD_REDUCTIONS``, ``DRIFT_REDUCTIONS``): norms as the root of the sum of
squares, counts as sums, max-abs as a max. Ratios and fractions are then re-derived from the combined
states, never averaged. A combined value is NULL if any shard's is NULL. Unsharded rows (DDP
replicas hold identical weights) are passed through once, from the lowest rank.

One caveat: ``grad_near_zero_count`` uses each shard's own rms as the threshold, so its combined sum
is exact per shard but not the count against the whole tensor's rms.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from dynascope.probes.grad_stats import GRAD_REDUCTIONS
from dynascope.probes.update_stats import UPDATE_REDUCTIONS

__all__ = ["DRIFT_REDUCTIONS", "REDUCTIONS", "combine_shards"]

DRIFT_REDUCTIONS = {"drift_norm": "norm", "drift_changed_count": "sum", "drift_changed_bf16_count": "sum"}
REDUCTIONS: dict[str, str] = {"numel": "sum", **UPDATE_REDUCTIONS, **DRIFT_REDUCTIONS, **GRAD_REDUCTIONS}

_KEYS = ["run_id", "role", "step", "tensor"]
_FRACS = {"changed_frac": "changed_count", "changed_bf16_frac": "changed_bf16_count",
          "sign_flip_frac": "sign_flip_count", "drift_changed_frac": "drift_changed_count",
          "drift_changed_bf16_frac": "drift_changed_bf16_count", "grad_zero_frac": "grad_zero_count",
          "grad_near_zero_frac": "grad_near_zero_count"}


def _reduce(col: str, how: str) -> pl.Expr:
    c = pl.col(col)
    if how == "norm":
        value = c.cast(pl.Float64).pow(2).sum().sqrt()
    elif how == "sum":
        value = c.sum()
    elif how == "max":
        value = c.max()
    else:  # pragma: no cover - a probe declared a reduction this module does not know
        raise ValueError(f"unknown reduction {how!r} for {col}")
    return pl.when(c.null_count() > 0).then(None).otherwise(value).alias(col)


def combine_shards(rows: Any) -> pl.DataFrame:
    """One row per (run_id, role, step, tensor) from per-rank rows; ``shards`` counts the ranks combined.

    ``rows``: a polars DataFrame or anything ``pl.DataFrame(...)`` accepts (pyarrow Table, dicts).
    """
    df = rows if isinstance(rows, pl.DataFrame) else pl.DataFrame(rows)
    if df.is_empty():
        return df.with_columns(pl.lit(0).alias("shards"))
    sharded = df.filter(pl.col("sharded").fill_null(False))
    whole = (df.filter(~pl.col("sharded").fill_null(False)).sort("rank")
             .group_by(_KEYS, maintain_order=True).first().with_columns(pl.lit(1).alias("shards")))
    if sharded.is_empty():
        return whole.drop("rank")
    # ‖W₀‖ of each shard, recovered from drift_ratio = ‖W−W₀‖/‖W₀‖, so drift_ratio re-derives exactly.
    sharded = sharded.with_columns(
        pl.when(pl.col("drift_norm") == 0).then(pl.col("w_norm"))  # W == W₀ on this shard
        .when(pl.col("drift_ratio") > 0).then(pl.col("drift_norm") / pl.col("drift_ratio"))
        .otherwise(None).alias("_ref_norm"))
    firsts = [c for c in ("time_us", "stage", "layer", "kind", "shape", "dtype") if c in df.columns]
    aggs = ([pl.col(c).first() for c in firsts]
            + [_reduce(c, how) for c, how in REDUCTIONS.items() if c in df.columns]
            + [_reduce("_ref_norm", "norm"), pl.col("ref_covered").all(), pl.len().alias("shards"),
               pl.lit(True).alias("sharded")])
    out = sharded.group_by(_KEYS, maintain_order=True).agg(aggs)
    ratio = lambda a, b: pl.when(pl.col(b) > 0).then(pl.col(a) / pl.col(b)).otherwise(None)  # noqa: E731
    out = out.with_columns(
        ratio("update_norm", "w_norm").alias("update_ratio"),
        ratio("drift_norm", "_ref_norm").alias("drift_ratio"),
        *[ratio(count, "numel").alias(frac) for frac, count in _FRACS.items() if count in out.columns],
    ).drop("_ref_norm")
    cols = [c for c in df.columns if c != "rank"] + ["shards"]
    out = out.select([c for c in cols if c in out.columns])
    return pl.concat([whole.select(out.columns), out], how="vertical_relaxed").sort(_KEYS)
