"""Aggregate SQL behind the dashboard's charts, pushed down to DuckDB.

Every function takes an open ``StoreConnection`` and returns a small polars frame (``store.frame``: a
cursor per call, so Streamlit's script threads and the prefetch pool query one store at once): rows per
chart point, never per stored row. Long series are cut into at most ``MAX_POINTS`` step buckets and keep
the min and max of each bucket, so a spike survives downsampling. Where an analysis in ``dynascope.analyses`` gives
the figure, the page calls the analysis; these queries are the chart-shaped aggregates (heat maps, Gantt
windows, bucketed series) that analyses do not return.
"""

from __future__ import annotations

from collections.abc import Iterable

from dynascope.store import quote_literal

MAX_POINTS = 400


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
