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

import polars as pl
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


# ---- without a browser: the launcher and the numbers behind the charts --------------------------------
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from dynascope.store import open_store

    with open_store(make_store(tmp_path_factory.mktemp("numbers"))) as s:
        yield s


def test_server_warms_its_imports_without_noise(tmp_path):
    """The server process (dynascope.dashboard.serve) imports the pages during start-up; its log must stay
    free of tracebacks and of the "No runtime found" warning an import before the runtime would log."""
    from dashboard_fixtures import write_small_run

    from dynascope.dashboard.serve import serving

    log = tmp_path / "server.log"
    with serving(write_small_run(tmp_path / "run"), log=log) as base:
        with urllib.request.urlopen(f"{base}/", timeout=30) as r:
            assert r.status == 200
        deadline = time.monotonic() + 60  # the warm-up thread runs on after the server is healthy
        while "dynascope: dashboard pages loaded" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
    text = log.read_text()
    assert "You can now view your Streamlit app" in text and "dynascope: dashboard pages loaded in" in text, text
    assert "No runtime found" not in text and "Traceback" not in text, text[-2000:]
    assert "found in sys.modules" not in text, text[-2000:]  # runpy's warning: the package imported serve itself


def test_launch_checks_path_and_warns_off_loopback(tmp_path, monkeypatch, capsys):
    from dynascope.dashboard import serve as dashboard
    from dynascope.store import StoreError

    with pytest.raises(StoreError, match="no such file"):
        dashboard.launch(tmp_path / "missing")
    root = make_store(tmp_path / "root")
    calls = []

    class FakeServer:  # stands in for the Streamlit process: records the command line, exits at once
        def __init__(self, cmd: list[str]) -> None:
            calls.append(cmd)

        def wait(self, timeout: float | None = None) -> int:
            return 0

    monkeypatch.setattr(dashboard.subprocess, "Popen", FakeServer)
    assert dashboard.launch(root, host="127.0.0.1", port=8765) == 0
    assert "no authentication" not in capsys.readouterr().err
    dashboard.launch(root, host="0.0.0.0", port=8766)
    assert "no authentication" in capsys.readouterr().err
    cmd = calls[-1]
    assert cmd[cmd.index("--server.address") + 1] == "0.0.0.0" and cmd[cmd.index("--server.port") + 1] == "8766"
    assert cmd[-2:] == ["--", str(root.resolve())] and cmd[cmd.index("--server.headless") + 1] == "true"
    assert [dashboard.is_loopback(h) for h in ("localhost", "127.0.0.2", "::1", "0.0.0.0", "10.0.0.1")] == \
        [True, True, True, False, False]


def test_server_process_binds_loopback_unless_told():
    """``python -m dynascope.dashboard.serve run app.py`` adds 127.0.0.1 where Streamlit would bind every
    interface; an explicit address is kept."""
    from dynascope.dashboard.serve import server_args

    assert server_args(["run", "app.py", "--", "/runs"]) == \
        ["run", "app.py", "--server.address", "127.0.0.1", "--", "/runs"]
    assert server_args(["run", "app.py", "--server.address", "0.0.0.0"]).count("--server.address") == 1
    assert server_args(["run", "app.py", "--server.address=::1"]) == ["run", "app.py", "--server.address=::1"]
    assert server_args(["version"]) == ["version"]


def test_heatmap_cells_pool_the_raw_rows(store):
    """A heat-map cell is √Σ‖ΔW‖²/√Σ‖W‖² and Σchanged/Σnumel of its rows, checked against the raw table."""
    from dynascope.dashboard.queries import params

    cube = params.param_cube(store, "grpo-sync")
    hm = params.layer_heatmap(cube, ("sft", "rl"), ("q", "k", "mlp"))
    raw = store.sql("SELECT step, update_norm, w_norm, changed_count, numel FROM tensor_stats "
                    "WHERE run_id = 'grpo-sync' AND layer = 2 AND kind IN ('q', 'k', 'mlp') AND step = 11").pl()
    cell = hm.filter((pl.col("layer") == 2) & (pl.col("step") == 11)).row(0, named=True)
    upd = raw.filter(pl.col("update_norm").is_not_null())  # ‖W‖ of the rows that have an update
    assert cell["update ratio ‖ΔW‖/‖W‖"] == pytest.approx(
        (upd["update_norm"] ** 2).sum() ** 0.5 / (upd["w_norm"] ** 2).sum() ** 0.5)
    assert cell["step-changed fraction"] == pytest.approx(raw["changed_count"].sum() / raw["numel"].sum())
    nf = params.nonfinite_steps(cube, "grpo-sync")
    assert nf["step"].to_list() == [13] and nf["nan"].to_list() == [3]
    named = params.nonfinite_tensors(store, "grpo-sync", (13,))
    assert named.height == 1 and named["nonfinite"].item() == 3


def test_per_step_sums_from_the_rollup_equal_the_raw_rows(store):
    """The page's series read tensor_stats_by_kind; pooling tensor_stats_global (the fallback for runs
    written before the rollup existed) must give the same frame."""
    from dynascope.dashboard.queries import params
    from dynascope.store.pooling import GLOBAL

    cube = params.param_cube(store, "grpo-sync").filter(pl.col("per_step"))
    raw = store.frame(f"""
        SELECT true AS per_step, step, CAST(NULL AS BIGINT) AS bucket, CAST(NULL AS INTEGER) AS layer,
               {params._KEYS}, {params._pooled_sql(params._SUMS, GLOBAL)}
        FROM {GLOBAL} WHERE run_id = 'grpo-sync' AND step IS NOT NULL GROUP BY ALL""").cast(cube.schema)
    assert cube.height > 0 and store.sql("SELECT count(*) FROM tensor_stats_by_kind").fetchall()[0][0] > 0
    key = ["step", "kind", "stage"]
    a, b = cube.sort(key), raw.sort(key)
    assert a.select(key).equals(b.select(key))
    assert {"update_sq", "update_w_sq", "changed_count", "changed_numel", "bf16_unchanged_count", "drift_sq",
            "drift_w_sq", "grad_zero_count", "grad_near_zero_count", "grad_numel", "w_nan_count"} <= set(params._SUMS)
    for col in params._SUMS:
        x, y = a[col].to_list(), b[col].to_list()
        assert [v is None for v in x] == [v is None for v in y], col  # NULL sums match exactly
        assert [v for v in x if v is not None] == pytest.approx([v for v in y if v is not None], rel=1e-12,
                                                                 nan_ok=True), col


def test_overlay_and_gradients_follow_the_stages(store):
    from dynascope.dashboard.queries import params

    cube = params.param_cube(store, "grpo-sync")
    kinds = tuple(params.stages_and_kinds(cube)["kind"].unique())
    ov = params.stage_overlay(cube, "grpo-sync", kinds)
    by_stage = {s: g for (s,), g in ov.group_by("stage")}
    # Stages in the order the run reached them, as the per-step charts list them: the same colour each
    assert ov["stage"].unique(maintain_order=True).to_list() == ["sft", "rl"]
    assert by_stage["sft"]["step_in_stage"].min() == 0 and by_stage["rl"]["first_step"].min() == 9
    # The fixture's RL steps move an order of magnitude less and change a smaller share than SFT.
    assert by_stage["rl"]["update_ratio"].mean() < by_stage["sft"]["update_ratio"].mean() / 5
    assert by_stage["rl"]["changed_frac"].max() < by_stage["sft"]["changed_frac"].min()
    gh = params.grad_health(cube, "grpo-sync", kinds)
    assert gh.filter(pl.col("step") > 8)["grad_zero_frac"].min() > gh.filter(pl.col("step") <= 8)["grad_zero_frac"].max()


def test_cluster_queries_find_the_slow_rank(store):
    from dynascope.analyses import what_if
    from dynascope.dashboard.queries import cluster
    from dynascope.dashboard.queries.ranks import with_rank_costs

    sc = with_rank_costs(cluster.straggler_table(store, "grpo-sync"), what_if(store, "grpo-sync"))
    slow = sc.row(0, named=True)
    assert slow["rank"] == 1 and slow["slowest_share_pct"] == 100.0 and slow["whatif_saved_ms"] > 0 and slow["slow"]
    # the fast rank is the slowest in no step: capping it at the median saves next to nothing
    assert sc.filter(pl.col("rank") == 0)["whatif_saved_ms"].item() < 0.05 * slow["whatif_saved_ms"]
    assert not sc.filter(pl.col("rank") == 0)["slow"].item()
    bd = cluster.phase_breakdown(store, "grpo-sync")
    per_rank = bd.group_by("rank").agg(pl.col("ms_per_step").sum()).sort("rank")["ms_per_step"].to_list()
    steps = store.sql("SELECT rank, avg(dur_us) / 1000 FROM timings WHERE run_id = 'grpo-sync' AND phase = 'step' "
                      "GROUP BY rank ORDER BY rank").fetchall()
    assert per_rank == pytest.approx([s[1] for s in steps])  # phases + un-instrumented = the step
    assert per_rank[0] == pytest.approx(per_rank[1], rel=0.05)  # synchronous: the fast rank waits
    g = cluster.gantt(store, "grpo-sync", 20, 22, limit=5)
    assert g.height == 5 and g["total"][0] > 5 and g["dur_ms"].is_sorted(descending=True)


def test_cluster_queries_match_the_step_analyses(store):
    """The page's breakdown and busy-time queries skip the analyses' per-phase grouping; the numbers must not move."""
    from dynascope.analyses import step_breakdown
    from dynascope.analyses.steps import top_level_sql
    from dynascope.dashboard.queries import cluster

    sb = step_breakdown(store, run="grpo-sync")
    n = sb.filter(pl.col("step_ms").is_not_null()).group_by("role", "rank").agg(pl.col("step").n_unique().alias("n"))
    want = (sb.group_by("role", "rank", "phase").agg(pl.col("dur_ms").sum()).join(n, on=["role", "rank"])
            .select("role", "rank", "phase", (pl.col("dur_ms") / pl.col("n")).alias("ms_per_step")).sort(pl.all()))
    got = cluster.phase_breakdown(store, "grpo-sync").sort(pl.all())
    assert got.select("role", "rank", "phase").equals(want.select("role", "rank", "phase"))
    assert got["ms_per_step"].to_list() == pytest.approx(want["ms_per_step"].to_list(), rel=1e-12)
    busy = store.sql(f"SELECT rank, avg(d) / 1000.0 FROM (SELECT rank, step, sum(dur_us) AS d FROM "
                     f"({top_level_sql('grpo-sync')}) WHERE NOT sync GROUP BY ALL) GROUP BY rank ORDER BY rank").fetchall()
    sc = cluster.straggler_table(store, "grpo-sync").sort("rank")
    assert sc["mean_busy_ms"].to_list() == pytest.approx([b for _, b in busy], rel=1e-12)


def test_spectra_series_matches_rank1_dominance(store):
    """The chart's push-down query and the analysis agree on Σσ₁²/Σ‖ΔW‖² at every step."""
    from dynascope.analyses import rank1_dominance
    from dynascope.dashboard.queries import params

    kinds = tuple(store.sql("SELECT DISTINCT kind FROM spectra").pl()["kind"])
    mine = params.spectra_series(store, ("grpo-sync",), kinds).sort("step")
    theirs = rank1_dominance(store, run="grpo-sync").filter(pl.col("level") == "overall").sort("step")
    assert mine["step"].to_list() == theirs["step"].to_list()
    assert mine["rank1"].to_list() == pytest.approx(theirs["rank1_energy"].to_list())
