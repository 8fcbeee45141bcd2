"""The framework's floor: how long Streamlit itself takes to draw a trivial page in a new browser tab.

A page opened in a new tab pays for Streamlit's JavaScript (React, protobuf, ~100 lazily loaded chunks),
its websocket session and script run, and, for a page with a chart, plotly.js — whatever the page shows.
This serves two hello-world apps with the dashboard's own server options and times them exactly as
``dashboard_render.py`` times the dashboard's pages, so the two sit side by side in one run:

    empty        a header and one line of text
    one chart    a header and one 3-point plotly line chart

    python3 benchmarks/streamlit_floor.py      # alone: both apps, a cold browser and a warm one
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from screenshots import CHROMIUM, wait_rendered  # benchmarks/ is on sys.path when run as a script

from dynascope.core.net import free_port
from dynascope.dashboard.serve import command, serving_command

APPS = {
    "empty": 'import streamlit as st\nst.header("Empty")\nst.write("hello")\n',
    "one chart": ('import plotly.graph_objects as go\nimport streamlit as st\nst.header("One chart")\n'
                  "st.plotly_chart(go.Figure(go.Scatter(x=[1, 2, 3], y=[1, 3, 2])))\n"),
}
VIEWPORT = {"width": 1400, "height": 1000}


@contextlib.contextmanager
def serve_app(source: str) -> Iterator[str]:
    """Serve a one-file Streamlit app with the dashboard's server options; yields its base URL."""
    with tempfile.TemporaryDirectory(prefix="ds-floor-") as tmp:
        app = Path(tmp) / "app.py"
        app.write_text(source)
        port = free_port()
        # The dashboard's command line with its app and trailing path swapped for this app: same options.
        cmd = command(tmp, "127.0.0.1", port)
        cmd = [sys.executable, "-m", "streamlit", *cmd[3:cmd.index("--")]]
        cmd[cmd.index("run") + 1] = str(app)
        with serving_command(cmd, port) as base:
            yield base


def time_tab(context, url: str) -> float:
    """Seconds from navigation in a new tab of ``context`` until the page is fully drawn."""
    page = context.new_page()
    try:
        t = time.perf_counter()
        page.goto(url)
        wait_rendered(page)
        return time.perf_counter() - t
    finally:
        page.close()


def time_fresh_tab(browser, url: str) -> float:
    """``time_tab`` in a new browser context: nothing cached, as on a first visit to the server."""
    context = browser.new_context(viewport=VIEWPORT)
    try:
        return time_tab(context, url)
    finally:
        context.close()


def floor(browser, warm_visits: int = 2) -> dict[str, tuple[float, float]]:
    """Per app: (new tab in a cold browser, new tab in a browser that has loaded the app ``warm_visits`` times)."""
    out = {}
    for name, source in APPS.items():
        with serve_app(source) as base:
            time_fresh_tab(browser, f"{base}/")  # the server's first script run (its imports)
            cold = time_fresh_tab(browser, f"{base}/")
            warm_ctx = browser.new_context(viewport=VIEWPORT)
            for _ in range(warm_visits):
                time_tab(warm_ctx, f"{base}/")
            out[name] = (cold, time_tab(warm_ctx, f"{base}/"))
            warm_ctx.close()
    return out


def main() -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        results = floor(browser)
        browser.close()
    print(f"{'Streamlit app':<12} {'new tab, cold browser s':>24} {'new tab, warm browser s':>24}")
    for name, (cold, warm) in results.items():
        print(f"{name:<12} {cold:>24.2f} {warm:>24.2f}")


if __name__ == "__main__":
    main()
