"""The dashboard server process: ``python -m dynascope.dashboard._serve run app.py ...`` is ``streamlit run``
with the first page's imports warmed beside the server's start-up.

Streamlit imports a page's modules inside the first browser session's script run, so the first visitor
waits for plotly, pandas (``st.dataframe``), the analyses and plotly's lazily built trace validators:
about a second on 2 cores, on top of the JavaScript. Here a thread imports them while the web server starts, so
they are (mostly) in ``sys.modules`` by the time anyone connects. Python's import lock makes a race with
the first script run safe: whichever thread imports a module first, the other waits for it.
"""

from __future__ import annotations

import importlib
import sys
import threading
import time

PAGE_MODULES = ("views.runs", "views.dynamics", "views.cluster", "views.rollouts", "views.events", "views.sql",
                "queries.params", "queries.cluster", "queries.rollouts", "queries.runs")


def warm() -> None:
    """Import what the pages import, and build one figure of each trace type the pages draw."""
    t0 = time.perf_counter()
    try:
        import pandas  # noqa: F401  (st.dataframe converts through it)
        import plotly.graph_objects as go
        from streamlit import runtime

        import dynascope.analyses  # noqa: F401

        # data.py's @st.cache_data decorators check their parameters against the runtime's cache storage;
        # imported before the runtime exists, they log "No runtime found" (harmless, but noise in the log).
        deadline = time.monotonic() + 60
        while not runtime.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        for name in PAGE_MODULES:
            importlib.import_module(f"dynascope.dashboard.{name}")
        # plotly creates each trace type's validators on first use, and Streamlit serialises every figure
        go.Figure([go.Scatter(x=[0], y=[0]), go.Bar(x=[0], y=[0]), go.Heatmap(z=[[0.0]]),
                   go.Histogram(x=[0])]).to_json()
    except Exception as exc:  # warming is an optimisation: the pages import what they need anyway
        print(f"dynascope: warming the dashboard's imports failed ({type(exc).__name__}: {exc})", file=sys.stderr)
        return
    print(f"dynascope: dashboard pages loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def main() -> None:
    threading.Thread(target=warm, name="dynascope-warm", daemon=True).start()
    from streamlit.web.cli import main as streamlit_main

    streamlit_main(args=sys.argv[1:], prog_name="streamlit")


if __name__ == "__main__":
    main()
