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
