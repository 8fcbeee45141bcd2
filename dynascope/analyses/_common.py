"""Shared plumbing for analyses: accept a path or an open store, filter by run, return polars."""

from __future__ import annotations

import os

import polars as pl

from dynascope.store import StoreConnection, open_store, quote_literal
from dynascope.store.reader import Params

StoreLike = StoreConnection | str | os.PathLike


def as_store(store: StoreLike) -> StoreConnection:
    """An open store for ``store`` (a path is opened read-only)."""
    return store if isinstance(store, StoreConnection) else open_store(store)


def run_clause(run: str | None, column: str = "run_id") -> str:
    """``AND run_id = '<run>'`` (escaped), or nothing when ``run`` is None."""
    return "" if run is None else f" AND {column} = {quote_literal(run)}"


def frame(store: StoreConnection, sql: str, params: Params = None) -> pl.DataFrame:
    """Run an analysis query (the toolkit's own SQL, not the user's) and return polars; safe from many
    threads, and run again if a compaction deleted a segment mid-query (``StoreConnection.frame``)."""
    return store.frame(sql, params)
