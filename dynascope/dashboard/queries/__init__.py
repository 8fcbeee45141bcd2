"""Aggregate SQL behind the dashboard's charts, pushed down to DuckDB.

Every function takes an open ``StoreConnection`` and returns a small polars frame: rows per chart point,
never per stored row. Long series are cut into at most ``MAX_POINTS`` step buckets and keep the min and
max of each bucket, so a spike survives downsampling. Where an analysis in ``dynascope.analyses`` gives
the same figure, the page prefers the analysis; these queries are its fallback and the heavy lifting for
chart-shaped aggregates (heat maps, Gantt windows) that analyses do not return.
"""

from __future__ import annotations

from collections.abc import Iterable

import polars as pl

from dynascope.store import StoreConnection, quote_literal

MAX_POINTS = 400


def frame(store: StoreConnection, sql: str) -> pl.DataFrame:
    """Run toolkit SQL on its own cursor: Streamlit serves sessions from several threads at once."""
    cur = store._con.cursor()
    try:
        return cur.sql(sql).pl()
    finally:
        cur.close()


def in_list(column: str, values: Iterable[object]) -> str:
    """``column IN (...)`` with every value quoted; an empty selection matches nothing."""
    vals = [v for v in values]
    if not vals:
        return "FALSE"
    return f"{column} IN ({', '.join(quote_literal(str(v)) for v in vals)})"


def bounds_cte(table: str, where: str, max_points: int = MAX_POINTS, partition: str = "") -> str:
    """A ``bounds`` CTE giving the first step ``s0`` and a bucket width ``w`` so at most ``max_points`` remain.

    ``partition`` (e.g. ``run_id``) computes bounds per group; join on it.
    """
    cols = f"{partition}, " if partition else ""
    group = f" GROUP BY {partition}" if partition else ""
    return (f"bounds AS (SELECT {cols}min(step) AS s0, "
            f"greatest(1, CAST(ceil((max(step) - min(step) + 1) / {int(max_points)}.0) AS BIGINT)) AS w "
            f"FROM {table} WHERE {where}{group})")


BUCKET = "(s0 + ((step - s0) // w) * w)"
