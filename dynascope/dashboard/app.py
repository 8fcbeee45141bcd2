"""The dashboard's Streamlit script: ``streamlit run app.py -- PATH`` (``dynascope dashboard PATH`` does this).

The sidebar holds what every page shares (the runs picked, auto-refresh); pages live in ``views/`` (not ``pages/``, which Streamlit would turn into its own page list).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import streamlit as st

from dynascope.dashboard import data
from dynascope.dashboard.views import cluster, dynamics, events, rollouts, runs, sql
from dynascope.store import StoreError


def _store_path() -> str:
    args = [a for a in sys.argv[1:] if a and not a.startswith("-")]
    return str(Path(args[0] if args else os.environ.get("DYNASCOPE_STORE", ".")).expanduser().resolve())


def _sidebar(path: str) -> None:
    with st.sidebar:
        st.markdown("### dynascope")
        st.caption(path)
        try:
            catalog = data.catalog(path).sort("last_write_us", descending=True)
        except StoreError as exc:
            st.error(str(exc))
            st.stop()
        ids = catalog["run_id"].to_list()
        # A few runs: show them all; many: start with the newest so the first render stays small.
        default = ids if len(ids) <= 3 else ids[:1]
        if "runs" in st.session_state:
            st.session_state["runs"] = [r for r in st.session_state["runs"] if r in ids]
        status = dict(zip(ids, catalog["status"].to_list(), strict=True))
        st.multiselect("Runs", ids, default=None if "runs" in st.session_state else default, key="runs",
                       format_func=lambda r: f"{r} ({status.get(r, '?')})")
        st.toggle("Auto-refresh", key="auto_refresh", help="Rerun the page on a timer; new segments are picked up as they land.")
        st.select_slider("Refresh every (s)", [2, 5, 10, 30, 60], value=5, key="refresh_s")
        if st.button("Refresh now"):
            data.clear()


_NO_CHARTS = {"sql"}  # url paths of pages that draw no plotly chart


def _preload_plotly() -> None:
    """Send an invisible one-point chart before any query runs (on pages that draw charts).

    The browser fetches and compiles plotly.js (~4.6 MB) only when the first chart element arrives, and
    every page's first chart arrives after its queries: on 2 cores that was ~1.5 s of the first load spent
    after the script had finished. Sent first, the chart makes the browser load plotly while the sidebar's
    and the page's queries run.
    """
    import plotly.graph_objects as go

    with st.container(key="plotly_preload"):
        st.html("<style>.st-key-plotly_preload {display: none}</style>")
        st.plotly_chart(go.Figure(go.Scatter(x=[0], y=[0])), key="plotly_preload_chart")


def main() -> None:
    st.set_page_config(page_title="dynascope", layout="wide")
    path = _store_path()
    st.session_state["store_path"] = path
    pages = [
        st.Page(runs.page, title="Runs", url_path="overview", default=True),
        # Streamlit serves the default page at the root only, so /runs (the name in the menu) answered
        # "Page not found" before falling back to it: the same page under /runs, hidden from the menu.
        st.Page(runs.page, title="Runs", url_path="runs", visibility="hidden"),
        st.Page(dynamics.page, title="Parameter dynamics", url_path="dynamics"),
        st.Page(cluster.page, title="Cluster", url_path="cluster"),
        st.Page(rollouts.page, title="Rollouts", url_path="rollouts"),
        st.Page(events.page, title="Events", url_path="events"),
        st.Page(sql.page, title="SQL", url_path="sql"),
    ]
    page = st.navigation(pages)
    # A page without charts does not load plotly.js: opened in a new tab, its ~1 s of script evaluation would
    # come before the page is drawn (it blocks the browser's main thread), and a chart page clicked next
    # loads it then.
    if page.url_path not in _NO_CHARTS:
        _preload_plotly()
    _sidebar(path)
    page.run()


main()
