"""Combine per-rank ``tensor_stats`` rows (shards, replicas, whole tensors) into one row per tensor.

The same rule as the store's canonical view ``tensor_stats_global`` (``store.pooling.global_sql``), run
over rows held in memory: each rank records its local shard, and every column declares how shards
combine (``Column.reduce``): norms as the root of the sum of squares, counts as sums, max-abs as a max.
Fractions and ratios are derived again from the combined states, never averaged. A combined value is
NULL if any shard's is NULL, and every statistic of a step is NULL where its shards hold fewer elements
than the tensor's fullest step (a shard's row missing). Whole tensors (DDP replicas hold identical
weights) come once, from the lowest rank, and HSDP's further replicas (``replica`` > 0) are left out.

One caveat: ``grad_near_zero_count`` uses each shard's own rms as the threshold, so its combined sum
is exact per shard but not the count against the whole tensor's rms.
"""

from __future__ import annotations

from typing import Any

import duckdb
import polars as pl

from dynascope.store.pooling import global_sql
from dynascope.store.schema import TENSOR_STATS_COLUMNS

__all__ = ["REDUCTIONS", "combine_shards"]

REDUCTIONS: dict[str, str] = {c.name: c.reduce for c in TENSOR_STATS_COLUMNS if c.reduce in ("sum", "norm", "max")}
_KEYS = ["run_id", "role", "step", "tensor"]


def combine_shards(rows: Any) -> pl.DataFrame:
    """One row per (run_id, role, stage, step, tensor) from per-rank rows; ``shards`` counts the rows combined.

    ``rows``: a polars DataFrame or anything ``pl.DataFrame(...)`` accepts (pyarrow Table, dicts).
    """
    df = rows if isinstance(rows, pl.DataFrame) else pl.DataFrame(rows)
    if df.is_empty():
        return df.with_columns(pl.lit(0).alias("shards"))
    for name, value in (("run_id", ""), ("role", ""), ("stage", None), ("time_us", None)):
        if name not in df.columns:
            df = df.with_columns(pl.lit(value).alias(name))
    con = duckdb.connect(":memory:")
    try:
        con.register("_rows", df.to_arrow())
        out = con.sql(global_sql("_rows", df.columns) + " ORDER BY run_id, role, step, stage, tensor").pl()
    finally:
        con.close()
    cols = [c for c in df.columns if c != "rank"] + ["shards"]
    return out.select([c for c in cols if c in out.columns])
