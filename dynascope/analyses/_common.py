"""Shared plumbing for analyses: accept a path or an open store, filter by run, return polars."""

from __future__ import annotations

import polars as pl

from dynascope.store import StoreConnection, StoreLike, as_store, quote_literal
from dynascope.store.reader import Params

__all__ = ["StoreLike", "as_store", "frame", "run_clause"]  # StoreLike and as_store are the store's


def run_clause(run: str | None, column: str = "run_id") -> str:
    """``AND run_id = '<run>'`` (escaped), or nothing when ``run`` is None."""
    return "" if run is None else f" AND {column} = {quote_literal(run)}"


def frame(store: StoreConnection, sql: str, params: Params = None) -> pl.DataFrame:
    """Run an analysis query (the toolkit's own SQL, not the user's) and return polars; safe from many
    threads, and run again if a compaction deleted a segment mid-query (``StoreConnection.frame``)."""
    return store.frame(sql, params)


def lowest_rank_sql(store: StoreConnection, where: str, partition: str) -> tuple[str, bool]:
    """(SQL for the lowest rank among each ``partition``'s ``tensor_stats`` rows, whether each run's rows
    come from one rank). A tensor's replicated rows count once, from its lowest rank, its shards all; when
    every run's rows are of one rank or all shards there is nothing to pick and the window (8 s over 10M
    rows on 2 cores, where a plain sum takes one) becomes ``rank``. ``where`` starts with `` AND``."""
    shapes = store.rows(f"SELECT min(rank) = max(rank), bool_and(coalesce(sharded, false)) FROM tensor_stats "
                        f"WHERE step IS NOT NULL{where} GROUP BY run_id")
    if all(one or shards for one, shards in shapes):
        return "rank", all(one for one, _ in shapes)
    return f"min(rank) OVER (PARTITION BY {partition})", False
