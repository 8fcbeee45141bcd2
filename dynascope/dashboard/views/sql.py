"""SQL console: the same locked-down, read-only connection as ``dynascope sql``, with a row cap."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import streamlit as st

from dynascope.dashboard import data
from dynascope.store import StoreError, run_sql
from dynascope.store.schema import TABLE_NAMES

_DEFAULT = ("SELECT run_id, stage, count(*) AS rows, max(step) AS last_step,\n"
            "       avg(changed_frac) AS mean_changed_frac, avg(update_ratio) AS mean_update_ratio\n"
            "FROM tensor_stats_global\nGROUP BY ALL ORDER BY run_id, stage")


def run_user_sql(path: str, query: str, max_rows: int) -> pa.Table:
    """Run ``query`` through ``run_sql`` on the read-only store (refuses non-queries; a cursor per call)."""
    return run_sql(data.store(path), query, max_rows=max_rows)


def full_precision(schema: pa.Schema) -> dict[str, st.column_config.NumberColumn]:
    """Show floats as stored: Streamlit's default display rounds to a few digits (0.99999 read "1")."""
    return {f.name: st.column_config.NumberColumn(format="plain") for f in schema
            if pa.types.is_floating(f.type) or pa.types.is_decimal(f.type)}


def page() -> None:
    path, _ = data.current()
    st.header("SQL")
    st.caption(f"Read-only queries over {', '.join(TABLE_NAMES)}. No file or network access, no SET, no ATTACH.")
    with st.form("sql_form"):
        query = st.text_area("Query", _DEFAULT, height=160, key="sql_text")
        cap = st.number_input("Row cap", min_value=1, max_value=1_000_000, value=10_000, step=1000, key="sql_cap")
        submitted = st.form_submit_button("Run query", type="primary")
    if submitted:
        try:
            st.session_state["sql_result"] = (query, run_user_sql(path, query, int(cap)))
        except StoreError as exc:
            st.session_state.pop("sql_result", None)
            st.error(str(exc))
            return
    if "sql_result" not in st.session_state:
        return
    ran, table = st.session_state["sql_result"]
    capped = " (row cap reached)" if table.num_rows >= int(cap) else ""
    st.caption(f"{table.num_rows:,} rows{capped}")
    st.dataframe(table, hide_index=True, width="stretch", key="sql_table", column_config=full_precision(table.schema))
    csv_buf, pq_buf = io.BytesIO(), io.BytesIO()
    pcsv.write_csv(table, csv_buf)
    pq.write_table(table, pq_buf)
    c1, c2, _ = st.columns([1, 1, 4])
    c1.download_button("Download CSV", csv_buf.getvalue(), "dynascope-query.csv", "text/csv", on_click="ignore")
    c2.download_button("Download Parquet", pq_buf.getvalue(), "dynascope-query.parquet",
                       "application/vnd.apache.parquet", on_click="ignore")
