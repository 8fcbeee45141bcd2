"""Shared plumbing for analyses: accept a path or an open store, filter by run, return polars."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import polars as pl

from dynascope.store import StoreConnection, StoreLike, as_store, quote_literal
from dynascope.store.reader import Params

T = TypeVar("T")

__all__ = ["StoreLike", "as_store", "frame", "once", "run_clause", "shared_reads"]  # StoreLike and as_store are the store's


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


# What one ``shared_reads`` block has read, per thread (a ContextVar: a dashboard thread running another
# analysis on the same store never sees it): (store, what, run) → the result.
_SHARED: ContextVar[dict[tuple[Any, ...], Any] | None] = ContextVar("dynascope_shared_reads", default=None)


@contextmanager
def shared_reads() -> Iterator[None]:
    """Within this block, a read that several analyses make of the same rows (``once``) runs once: the
    report asks the what-ifs, the node what-if and the schedule replay for the same timing rows, and
    reading them again each time cost more than all of the replays. The rows are those of the first read
    (a live run's later rows wait for the next block). A block inside another shares the outer one's."""
    if _SHARED.get() is not None:
        yield
        return
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def once(key: tuple[Any, ...], read: Callable[[], T]) -> T:
    """``read()``, or inside ``shared_reads`` the result of the block's first call with this ``key``
    (whose first item is the store)."""
    cache = _SHARED.get()
    if cache is None:
        return read()
    if key not in cache:
        cache[key] = read()
    return cache[key]
