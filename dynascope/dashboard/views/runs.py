"""Runs page: every run under the store with its status, size and progress, the alerts that fired; compare a
scalar across runs."""

from __future__ import annotations

import polars as pl
import streamlit as st

from dynascope.dashboard import charts, data
from dynascope.dashboard.queries import runs as Q


def page() -> None:
    data.live(_body)


def _body() -> None:
    path, runs = data.current()
    st.header("Runs")
    with data.guard("Run list"):
        cat = data.catalog(path)
        view = cat.with_columns(
            (pl.col("size_bytes") / 1e6).round(2).alias("size_mb"),
            pl.from_epoch(pl.col("last_write_us"), time_unit="us").alias("last_write"),
        )
        cols = [c for c in ("run_id", "name", "status", "steps", "ranks", "size_mb", "last_write", "problem")
                if c in view.columns and (c != "problem" or view[c].drop_nulls().len())]
        view = view.select(cols).sort("last_write", descending=True, nulls_last=True)
        st.dataframe(view, hide_index=True, width="stretch", key="runs_table")
        counts = view.group_by("status").len().sort("status")
        st.caption(f"{view.height} runs: " + ", ".join(f"{n} {s}" for s, n in counts.iter_rows())
                   + " — pick runs to compare in the sidebar.")
    if not runs:
        st.info("Pick one or more runs in the sidebar.")
        return
    with data.guard("Alerts"):
        _alerts(path, runs)
    left, right = st.columns(2)
    with left, data.guard("Rows per table"):
        rows = data.query(Q.table_rows, path, runs)
        if not data.empty(rows, "rows"):
            fig = charts.bars(rows.rename({"tbl": "table"}), "table", "n", "run_id", "Rows per table", "rows",
                              stacked=False)
            charts.log_axis(fig, rows["n"].filter(rows["n"] > 0).min(), rows["n"].max())
            charts.show(fig, "runs_rows")
    with right, data.guard("Compare runs"):
        keys = data.query(Q.scalar_keys, path, runs)
        if keys.height == 0:
            st.info("No scalars logged in the selected runs.")
            return
        names = keys["key"].to_list()
        key = st.selectbox("Scalar", names, index=names.index(Q.default_scalar(keys)), key="runs_scalar")
        df = data.query(Q.scalar_series, path, runs, key)
        if not data.empty(df, f"'{key}' values"):
            charts.show(charts.banded(df, "step", "mean", "lo", "hi", ["run_id", "stage"], key), "runs_scalar_chart")


def _alerts(path: str, runs: tuple[str, ...]) -> None:
    """What the run's alert rules fired (docs/alerts.md), newest first; live with the page's auto-refresh."""
    fired = data.query(Q.alerts, path, runs)
    st.subheader("Alerts")
    if fired.height == 0:
        st.caption("No alert fired in the selected runs (rules: `watch(..., alerts=True)` or "
                   "`dynascope watch-run RUN`).")
        return
    by = fired.group_by("severity").len().sort("len", descending=True)
    st.caption(f"{fired.height} alert{'' if fired.height == 1 else 's'}: " + ", ".join(f"{n} {s}" for s, n in by.iter_rows()))
    st.dataframe(fired, hide_index=True, width="stretch", key="runs_alerts")
