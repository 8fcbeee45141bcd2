"""The dashboard in a real browser: real Streamlit server over a real store, driven by headless Chromium.

One server and one browser for the module: every page renders without a Streamlit exception and its
plotly charts hold data; the SQL page refuses file access with a visible error; a run written while the
server is up appears with auto-refresh on.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dashboard_fixtures import make_store

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
# page → (url path, least number of plotly charts the fixture store must fill on it); Runs is the default page
PAGES = {"runs": ("", 2), "dynamics": ("dynamics", 10), "cluster": ("cluster", 3), "rollouts": ("rollouts", 5),
         "events": ("events", 1), "sql": ("sql", 0)}

pytestmark = [pytest.mark.browser, pytest.mark.slow]

if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} is missing: browser tests need Debian's chromium", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the python playwright package is not installed")

# Count the points each plotly chart really drew (typed arrays, plain arrays, or heat-map rows).
_POINTS_JS = """els => els.map(el => (el.data || []).reduce((n, t) => {
    const len = v => (v == null ? 0 : (typeof v.length === 'number' ? v.length : (v.bdata ? v.bdata.length : 0)));
    return n + Math.max(len(t.x), len(t.y), len(t.z));
}, 0))"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root: Path, port: int, log: Path) -> subprocess.Popen:
    """``dynascope dashboard ROOT --port PORT`` in its own process group; polls /_stcore/health."""
    cmd = [sys.executable, "-c", "from dynascope.cli import app; app()", "dashboard", str(root), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dashboard exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"dashboard did not become healthy: {log.read_text()[-2000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_idle(page, timeout_ms: int = 60_000) -> None:
    """Wait until the Streamlit script has finished its run (the app root carries the script state)."""
    page.wait_for_selector('[data-testid="stApp"][data-test-script-state="notRunning"]', timeout=timeout_ms)


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    root = make_store(tmp_path_factory.mktemp("store"))
    port = free_port()
    proc = start_server(root, port, tmp_path_factory.mktemp("log") / "streamlit.log")
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                        args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
                yield root, f"http://127.0.0.1:{port}", page
            finally:
                browser.close()
    finally:
        stop_server(proc)


def open_page(page, base: str, name: str) -> list[int]:
    """Visit a page, wait for its charts, check for exceptions; returns points per chart."""
    url, charts = PAGES[name]
    page.goto(f"{base}/{url}")
    wait_idle(page)
    if charts:
        page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot').length >= {charts}", timeout=60_000)
    wait_idle(page)
    errors = page.locator('[data-testid="stException"]')
    assert errors.count() == 0, f"{name}: Streamlit exception: {errors.first.inner_text()[:1000]}"
    page.screenshot(path=str(ARTIFACTS / f"dashboard-{name}.png"), full_page=True)
    return page.eval_on_selector_all(".js-plotly-plot", _POINTS_JS)


def test_every_page_renders_charts_with_data(dashboard):
    _, base, page = dashboard
    for name, (_, expected) in PAGES.items():
        points = open_page(page, base, name)
        assert len(points) >= expected, f"{name}: {len(points)} charts, expected {expected}"
        assert all(n > 0 for n in points), f"{name}: a chart drew no points: {points}"
        infos = page.locator('[data-testid="stAlertContentInfo"]').all_inner_texts()
        assert not [t for t in infos if "not available for this run" in t], f"{name}: chart failed: {infos}"


def run_query(page, sql: str) -> None:
    box = page.get_by_label("Query")
    box.fill(sql)
    page.get_by_role("button", name="Run query").click()
    wait_idle(page)


def test_sql_console_refuses_file_access_and_downloads(dashboard, tmp_path):
    _, base, page = dashboard
    open_page(page, base, "sql")
    target = tmp_path / "x.csv"
    run_query(page, f"COPY (SELECT 1) TO '{target}'")
    error = page.locator('[data-testid="stAlertContentError"]')
    error.wait_for(timeout=30_000)
    assert "refused" in error.inner_text() and "COPY" in error.inner_text()
    assert not target.exists()

    run_query(page, "SELECT * FROM read_csv('/etc/passwd')")
    error.wait_for(timeout=30_000)
    assert re.search(r"SQL error: .*(Permission|disabled|not allowed)", error.inner_text()), error.inner_text()
    assert page.locator('[data-testid="stException"]').count() == 0

    run_query(page, "SELECT run_id, count(*) AS n FROM tensor_stats GROUP BY run_id ORDER BY run_id")
    assert error.count() == 0
    page.get_by_text("2 rows").wait_for(timeout=30_000)
    with page.expect_download() as dl:
        page.get_by_role("button", name="Download CSV").click()
    text = Path(dl.value.path()).read_text()
    assert text.splitlines()[0] == '"run_id","n"' and "grpo-sync" in text and "grpo-async" in text


def test_new_run_appears_with_auto_refresh(dashboard):
    from dashboard_fixtures import write_small_run

    root, base, page = dashboard
    open_page(page, base, "runs")
    page.get_by_text("2 runs", exact=False).first.wait_for(timeout=30_000)
    page.get_by_text("Auto-refresh").click()
    write_small_run(root / "grpo-late")
    # No reload: the page's fragment reruns on its timer and the cache TTL lets the new segments through.
    page.get_by_text("3 runs", exact=False).first.wait_for(timeout=45_000)
    assert page.locator('[data-testid="stException"]').count() == 0
