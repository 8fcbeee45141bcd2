"""Shared plumbing for analyses: accept a path or an open store, filter by run, return polars."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar, copy_context
from typing import Any, TypeVar

import polars as pl

from dynascope.store import StoreConnection, StoreLike, as_store, quote_literal
from dynascope.store.reader import Params

T = TypeVar("T")

__all__ = ["StoreLike", "as_store", "frame", "in_parallel", "intervals_union_sql", "once", "run_clause", "shared_reads"]  # StoreLike and as_store are the store's


def run_clause(run: str | None, column: str = "run_id") -> str:
    """``AND run_id = '<run>'`` (escaped), or nothing when ``run`` is None."""
    return "" if run is None else f" AND {column} = {quote_literal(run)}"


def frame(store: StoreConnection, sql: str, params: Params = None) -> pl.DataFrame:
    """Run an analysis query (the toolkit's own SQL, not the user's) and return polars; safe from many
    threads, and run again if a compaction deleted a segment mid-query (``StoreConnection.frame``)."""
    return store.frame(sql, params)


# What one ``shared_reads`` block has read, per thread (a ContextVar: a dashboard thread running another
# analysis on the same store never sees it; ``in_parallel`` hands it to its workers).
class _Reads:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.locks: dict[tuple[Any, ...], threading.Lock] = {}  # one per key: a second reader waits for the first
        self.values: dict[tuple[Any, ...], Any] = {}


_SHARED: ContextVar[_Reads | None] = ContextVar("dynascope_shared_reads", default=None)


@contextmanager
def shared_reads() -> Iterator[None]:
    """Within this block, a read that several analyses make of the same rows (``once``) runs once: the
    report asks the what-ifs, the node what-if and the schedule replay for the same timing rows, and
    reading them again each time cost more than all of the replays. The rows are those of the first read
    (a live run's later rows wait for the next block). A block inside another shares the outer one's."""
    if _SHARED.get() is not None:
        yield
        return
    token = _SHARED.set(_Reads())
    try:
        yield
    finally:
        _SHARED.reset(token)


def once(key: tuple[Any, ...], read: Callable[[], T]) -> T:
    """``read()``, or inside ``shared_reads`` the result of the block's first call with this ``key``
    (whose first item is the store); a call while another thread reads the same key waits for it."""
    reads = _SHARED.get()
    if reads is None:
        return read()
    with reads.lock:
        lock = reads.locks.setdefault(key, threading.Lock())
    with lock:
        if key not in reads.values:
            reads.values[key] = read()
        return reads.values[key]


def in_parallel(calls: Sequence[Callable[[], T]], workers: int = 2) -> list[T | Exception]:
    """Each call's result (or the exception it raised), in order, from ``workers`` threads that share the
    caller's ``shared_reads``. DuckDB and NumPy release the GIL, and one analysis's Python and
    single-threaded steps leave a core that another's query uses."""
    def run(call: Callable[[], T]) -> T | Exception:
        try:
            return call()
        except Exception as exc:  # the caller decides what a failed call means
            return exc

    with ThreadPoolExecutor(max(1, workers)) as pool:
        futures = [pool.submit(copy_context().run, run, call) for call in calls]
        return [f.result() for f in futures]


def intervals_union_sql(source: str, keys: str) -> str:
    """A query over the intervals ``(s, e)`` of the query ``source``: their union per ``keys`` (columns of
    ``source``, comma-separated), one row ``(keys, s, e)`` per island of intervals that overlap or touch,
    directly or through each other. Sorted by start, an interval opens an island when it starts after the
    furthest end before it."""
    order = f"PARTITION BY {keys} ORDER BY s, e"
    return f"""SELECT {keys}, min(s) AS s, max(e) AS e FROM (
            SELECT *, sum(CASE WHEN pm IS NULL OR s > pm THEN 1 ELSE 0 END) OVER ({order} ROWS UNBOUNDED PRECEDING)
                      AS island
            FROM (SELECT *, max(e) OVER ({order} ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS pm
                  FROM ({source})))
        GROUP BY {keys}, island"""
