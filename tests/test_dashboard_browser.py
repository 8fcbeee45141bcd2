"""The dashboard in a real browser: real Streamlit server over a real store, driven by headless Chromium.

One server and one browser for the module: every page renders without a Streamlit exception and its
plotly charts hold data; the SQL page refuses file access with a visible error; a run written while the
server is up appears with auto-refresh on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from dashboard_fixtures import make_store

from dynascope.core.net import free_port

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
# page → (url path, least number of plotly charts the fixture store must fill on it); Runs is the default page
PAGES = {"runs": ("runs", 2), "dynamics": ("dynamics", 10), "cluster": ("cluster", 3), "rollouts": ("rollouts", 7),
         "events": ("events", 1), "sql": ("sql", 0)}

needs_browser = pytest.mark.browser

# The page's own plotly charts: the app's hidden one-point chart that preloads plotly.js is not one of them.
_CHARTS_JS = "[...document.querySelectorAll('.js-plotly-plot')].filter(e => !e.closest('.st-key-plotly_preload'))"
# At least n charts, every one drawn (a chart Streamlit is still drawing has no data or _fullLayout yet).
_DRAWN_JS = f"n => {{ const els = {_CHARTS_JS}; return els.length >= n && els.every(e => e.data && e._fullLayout); }}"
# Count the points each plotly chart really drew (typed arrays, plain arrays, or heat-map rows).
_POINTS_JS = f"""() => {_CHARTS_JS}.map(el => (el.data || []).reduce((n, t) => {{
    const len = v => (v == null ? 0 : (typeof v.length === 'number' ? v.length : (v.bdata ? v.bdata.length : 0)));
    return n + Math.max(len(t.x), len(t.y), len(t.z));
}}, 0))"""


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
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: browser tests need Debian's chromium")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the python playwright package is not installed")
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
    wait_idle(page)
    page.wait_for_function(_DRAWN_JS, arg=charts, timeout=120_000)  # a loaded 2-core machine is slow
    errors = page.locator('[data-testid="stException"]')
    assert errors.count() == 0, f"{name}: Streamlit exception: {errors.first.inner_text()[:1000]}"
    assert page.get_by_text("Page not found").count() == 0, f"/{url} answered 'Page not found'"
    page.screenshot(path=str(ARTIFACTS / f"dashboard-{name}.png"), full_page=True)
    return page.evaluate(_POINTS_JS)


@needs_browser
@pytest.mark.slow
def test_every_page_renders_charts_with_data(dashboard):
    _, base, page = dashboard
    for name, (_, expected) in PAGES.items():
        points = open_page(page, base, name)
        assert len(points) >= expected, f"{name}: {len(points)} charts, expected {expected}"
        assert all(n > 0 for n in points), f"{name}: a chart drew no points: {points}"
        infos = page.locator('[data-testid="stAlertContentInfo"]').all_inner_texts()
        assert not [t for t in infos if "not available for this run" in t], f"{name}: chart failed: {infos}"


def run_query(page, sql: str) -> None:
    page.get_by_label("Query").fill(sql)
    page.get_by_role("button", name="Run query").click()


@needs_browser
@pytest.mark.slow
def test_heat_map_metric_picker_draws_each_metric(dashboard):
    """The page draws one heat map at a time; each metric of the picker must draw its own cells (Streamlit's
    theme wraps titles in <b>, hence includes)."""
    from dynascope.dashboard.queries.params import HEAT_METRICS

    _, base, page = dashboard
    open_page(page, base, "dynamics")
    for name in HEAT_METRICS:
        page.locator('[data-testid="stRadio"] label', has_text=name).first.click()
        wait_idle(page)
        # One poll finds the heat map with this title and reads its rows: a chart Streamlit is redrawing has
        # no _fullLayout yet, so a second, separate read could catch it half-drawn (and line charts share
        # the metric's name in their titles, hence the trace type). Rows + 1 keeps an
        # empty heat map truthy, so the assert below (not a timeout) reports it.
        found = page.wait_for_function("""t => {
            const e = [...document.querySelectorAll('.js-plotly-plot')].find(e => e._fullLayout && e._fullData &&
                e._fullData.length && e._fullData[0].type === 'heatmap' &&
                String(e._fullLayout.title && e._fullLayout.title.text).includes(t));
            return e ? (e._fullData[0].z || []).length + 1 : false; }""", arg=name, timeout=30_000)
        cells = found.json_value() - 1
        assert cells > 0, f"{name}: heat map drew no rows"


@needs_browser
@pytest.mark.slow
def test_sql_console_refuses_file_access_and_downloads(dashboard, tmp_path):
    _, base, page = dashboard
    open_page(page, base, "sql")
    errors = '[data-testid="stAlertContentError"]'
    target = tmp_path / "x.csv"
    run_query(page, f"COPY (SELECT 1) TO '{target}'")
    page.locator(errors, has_text=re.compile(r"refused: COPY statements are not allowed")).wait_for(timeout=30_000)
    assert not target.exists()

    run_query(page, "SELECT * FROM read_csv('/etc/passwd')")
    page.locator(errors, has_text=re.compile(r"SQL error: .*(Permission|disabled)")).wait_for(timeout=30_000)
    assert page.locator('[data-testid="stException"]').count() == 0
    assert "root:" not in page.inner_text("body")

    run_query(page, "SELECT run_id, count(*) AS n FROM tensor_stats GROUP BY run_id ORDER BY run_id")
    page.get_by_text("2 rows").wait_for(timeout=30_000)
    wait_idle(page)
    assert page.locator(errors).count() == 0
    with page.expect_download() as dl:
        page.get_by_role("button", name="Download CSV").click()
    text = Path(dl.value.path()).read_text()
    assert text.splitlines()[0] == '"run_id","n"' and "grpo-sync" in text and "grpo-async" in text


# ---- what the charts say: axes, colours, bins, legends, tables ------------------------------------------
# Each chart's title, axes, legend and traces as plotly laid them out (Streamlit wraps titles in <b>).
_CHART_INFO_JS = f"""() => {_CHARTS_JS}.map(e => {{
    const L = e._fullLayout, box = el => el ? el.getBoundingClientRect() : null;
    return {{title: String(L.title && L.title.text || '').replace(/<[^>]+>/g, ''),
             y: {{type: L.yaxis.type, range: L.yaxis.range, dtick: L.yaxis.dtick, title: String(L.yaxis.title.text || '')}},
             x: {{dtick: L.xaxis.dtick, ticks: (L.xaxis._vals || []).map(v => v.x)}},
             legend: box(e.querySelector('.legend')), titleBox: box(e.querySelector('.gtitle')),
             traces: e._fullData.map(t => ({{name: t.name, type: t.type, x: Array.from(t.x || []),
                                             y: Array.from(t.y || []), color: t.marker && t.marker.color}}))}};
}})"""


def charts_of(page, base: str, name: str) -> dict[str, dict]:
    open_page(page, base, name)
    return {c["title"]: c for c in page.evaluate(_CHART_INFO_JS)}


def chart(found: dict[str, dict], start: str) -> dict:
    hits = [c for t, c in found.items() if t.startswith(start)]
    assert len(hits) == 1, f"{start!r} among {list(found)}"
    return hits[0]


@needs_browser
@pytest.mark.slow
def test_dynamics_axes_are_honest_and_name_the_relative_measure(dashboard):
    _, base, page = dashboard
    found = charts_of(page, base, "dynamics")
    changed = chart(found, "step-changed fraction by stage")
    assert changed["y"]["range"] == [0, 1]  # not autoscaled to the data's few tenths of a point
    # the dotted series is the relative measure (changed_rel_frac), named for it, not "bf16"
    assert any(t["name"].endswith("(relative)") and any(v is not None for v in t["y"]) for t in changed["traces"])
    assert not any("bf16" in t["name"] for t in changed["traces"])
    ratio = chart(found, "update ratio by stage")
    assert ratio["y"]["type"] == "log" and ratio["y"]["dtick"] == 1  # decades only: no 2 and 5 labels
    assert chart(found, "rank-1 energy")["y"]["range"] == [0, 1]
    grad = chart(found, "gradient sparsity")
    assert grad["y"]["range"][0] == 0 and (grad["y"]["range"][1] == 1 or "zoomed" in grad["y"]["title"])
    # RL's Razor's pair on one chart, each run's values as forgetting_by_point gives them
    forgot = chart(found, "forgetting and forward KL to the base")
    traces = {t["name"]: t for t in forgot["traces"]}
    assert traces["grpo-sync · forgetting"]["y"] == pytest.approx([0.0, 0.004])
    assert traces["grpo-sync · KL to base"]["y"] == pytest.approx([0.0, 0.012])
    assert "nats" in forgot["y"]["title"]


@needs_browser
@pytest.mark.slow
def test_cluster_phases_keep_one_distinct_colour(dashboard):
    _, base, page = dashboard
    found = charts_of(page, base, "cluster")
    gantt, breakdown = chart(found, "per-rank timeline"), chart(found, "mean time per step by phase")
    colours = {}
    for c in (gantt, breakdown):
        for t in c["traces"]:
            assert colours.setdefault(t["name"], t["color"]) == t["color"], f"{t['name']} changes colour"
    assert "(uninstrumented)" in colours and len(set(colours.values())) == len(colours), colours


@needs_browser
@pytest.mark.slow
def test_schedule_what_if_follows_its_parameters(dashboard):
    _, base, page = dashboard
    open_page(page, base, "cluster")

    def step_ms() -> float:  # the metric reads as core.fmt.fmt_ms writes it: "522 ms", "1.02 s"
        metric = page.locator('[data-testid="stMetric"]').filter(has_text="step time").first
        value, unit = re.search(r"([\d.]+) (ms|s|min)\b", metric.inner_text()).groups()
        return float(value) * {"ms": 1, "s": 1e3, "min": 6e4}[unit]

    before = step_ms()  # one_step_off_policy, the default pick, with weights published at no cost
    box = page.get_by_label("Publish ms per version (trainer)")
    box.fill("500")
    box.press("Enter")
    wait_idle(page)
    page.wait_for_function("() => [...document.querySelectorAll('[data-testid=stCaptionContainer]')]"
                           ".some(e => e.innerText.includes('publish_ms=500'))", timeout=60_000)
    # Each of the run's steps now waits for a 500 ms publish on the trainer's critical path.
    assert step_ms() > before + 400, (before, step_ms())
    assert page.locator('[data-testid="stException"]').count() == 0


@needs_browser
@pytest.mark.slow
def test_staleness_histogram_has_integer_bins(dashboard):
    _, base, page = dashboard
    st = chart(charts_of(page, base, "rollouts"), "staleness")
    bars = [x for t in st["traces"] for x in t["x"]]
    assert bars and all(float(x).is_integer() for x in bars) and 2 in bars  # the async run lags 0-2 steps
    assert st["x"]["dtick"] == 1 and all(float(v).is_integer() for v in st["x"]["ticks"]), st["x"]


@needs_browser
@pytest.mark.slow
def test_legends_never_cover_chart_titles(dashboard):
    _, base, page = dashboard
    for name in ("runs", "dynamics", "cluster", "rollouts", "events"):
        for c in charts_of(page, base, name).values():
            lg, tb = c["legend"], c["titleBox"]
            if not lg or not tb or not lg["width"]:
                continue
            apart = (lg["left"] >= tb["right"] or lg["right"] <= tb["left"] or lg["top"] >= tb["bottom"]
                     or lg["bottom"] <= tb["top"])
            assert apart, f"{name}: the legend covers the title of {c['title']!r}"


@needs_browser
@pytest.mark.slow
def test_event_tables_fit_the_page(dashboard):
    """Every table on the Events page shows all its columns without scrolling sideways."""
    _, base, page = dashboard
    open_page(page, base, "events")
    page.locator('[data-testid="stDataFrame"] .dvn-scroller').first.wait_for(timeout=30_000)
    widths = page.evaluate("""() => [...document.querySelectorAll('[data-testid="stDataFrame"] .dvn-scroller')]
        .map(e => [e.scrollWidth, e.clientWidth])""")
    assert len(widths) >= 3 and all(sw <= cw + 1 for sw, cw in widths), widths


@needs_browser
@pytest.mark.slow
def test_cluster_rank_tables_fit_the_page(dashboard):
    """The slowest ranks' and nodes' tables show all their columns without scrolling sideways."""
    _, base, page = dashboard
    open_page(page, base, "cluster")
    grids = ".st-key-cl_rank_tables .dvn-scroller"
    page.locator(".st-key-cl_rank_tables").scroll_into_view_if_needed(timeout=60_000)  # grids draw when shown
    page.locator(grids).first.wait_for(timeout=60_000)
    widths = page.evaluate("g => [...document.querySelectorAll(g)].map(e => [e.scrollWidth, e.clientWidth])", grids)
    assert widths and all(sw <= cw + 1 for sw, cw in widths), widths


@needs_browser
@pytest.mark.slow
def test_sql_results_keep_full_precision(dashboard):
    _, base, page = dashboard
    open_page(page, base, "sql")
    run_query(page, "SELECT 0.99999::DOUBLE AS x, 1.0000001::DOUBLE AS y, 42 AS n")
    page.get_by_text("1 rows").wait_for(timeout=30_000)
    # The grid draws on a canvas; its accessibility table (hidden) holds each cell's displayed text.
    cells = '[data-testid="stDataFrame"] td'
    page.locator(cells).first.wait_for(state="attached", timeout=30_000)
    assert page.locator(cells).all_text_contents()[:3] == ["0.99999", "1.0000001", "42"]


# Last of the browser tests: it adds a run to the store the others read.
@needs_browser
@pytest.mark.slow
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


# Beside the auto-refresh test: an alert fired while the page is open appears, without a reload.
@needs_browser
@pytest.mark.slow
def test_alerts_panel_shows_what_fired_live(dashboard):
    from dynascope.store import RunWriter

    root, base, page = dashboard
    open_page(page, base, "runs")
    page.get_by_text("No alert fired", exact=False).first.wait_for(timeout=30_000)
    page.get_by_text("Auto-refresh").click()
    with RunWriter(root / "grpo-sync", role="monitor", flush_secs=60) as w:
        w.event("alert", "gradient-norm spike: grad_norm = 41.2 at step 17 (trainer rank 1)", step=17,
                severity="warning", rule="gradient-norm spike", role="trainer", rank=1, value=41.2, threshold=None)
    page.get_by_text("1 alert: 1 warning", exact=False).first.wait_for(timeout=45_000)
    page.screenshot(path=str(ARTIFACTS / "dashboard-alerts.png"), full_page=True)
    assert page.locator('[data-testid="stException"]').count() == 0
