"""The Cluster page at 80 ranks (64 trainers on 8 nodes, 16 rollout workers on 2), in a real browser.

A real dashboard server over the planted 64-rank synthetic run (``helpers.cluster_truth``), driven by
headless Chromium: the page renders without an exception, no chart draws a trace or a legend entry per
rank, the heat map shows one role with a row per rank (64 trainers) or per node on request, the captions
and the distribution name the planted slow node as a node and the rollout worker with the long tail as a
rank, and picking a rank drills the timeline down to it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.cluster_truth import planted_cluster

CHROMIUM = "/usr/bin/chromium"
READY = '[data-testid="stApp"][data-test-script-state="notRunning"]'
# Every plotly chart of the page (the app's hidden preload chart aside): title, traces, legend entries, rows.
_CHARTS_JS = """() => [...document.querySelectorAll('.js-plotly-plot')]
    .filter(e => !e.closest('.st-key-plotly_preload') && e._fullLayout)
    .map(e => ({title: ((e._fullLayout.title && e._fullLayout.title.text) || '').replace(/<[^>]+>/g, ''),
                traces: e._fullData.length,
                legend: e._fullData.filter(t => t.showlegend !== false && t.visible !== false).length,
                types: e._fullData.map(t => t.type),
                y: e._fullData.map(t => Array.from(t.y || []).map(String))}))"""
# Most traces or legend entries one chart may have, whatever the rank count: one per phase, per role.
MOST_TRACES = 16


@pytest.fixture(scope="module")
def cluster_page(tmp_path_factory):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: browser tests need Debian's chromium")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the python playwright package is not installed")
    from dynascope.dashboard.serve import serving

    run, truth = planted_cluster(tmp_path_factory.mktemp("cluster"))
    log = tmp_path_factory.mktemp("log") / "streamlit.log"
    with serving(run, log=log) as base, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{base}/cluster")
            wait_drawn(page)
            yield page, truth
        finally:
            browser.close()


def wait_drawn(page, charts: int = 4) -> None:
    """Until the script run ended and at least ``charts`` plotly charts drew (deadlines, no fixed sleeps)."""
    page.wait_for_selector(READY, timeout=180_000)
    page.wait_for_function(
        """n => { const els = [...document.querySelectorAll('.js-plotly-plot')]
                      .filter(e => !e.closest('.st-key-plotly_preload'));
                  return els.length >= n && els.every(e => e.data && e._fullLayout); }""",
        arg=charts, timeout=180_000)
    page.wait_for_selector(READY, timeout=180_000)
    errors = page.locator('[data-testid="stException"]')
    assert errors.count() == 0, errors.first.inner_text()[:1000]


def charts(page) -> dict[str, dict]:
    return {c["title"]: c for c in page.evaluate(_CHARTS_JS)}


def chart(page, start: str) -> dict:
    hits = [c for t, c in charts(page).items() if t.startswith(start)]
    assert len(hits) == 1, f"{start!r} among {list(charts(page))}"
    return hits[0]


def captions(page) -> str:
    return "\n".join(page.locator('[data-testid="stCaptionContainer"]').all_inner_texts())


@pytest.mark.browser
@pytest.mark.slow
def test_no_chart_draws_a_trace_per_rank(cluster_page):
    page, truth = cluster_page
    found = charts(page)
    assert len(found) >= 4, list(found)
    for title, c in found.items():
        assert c["traces"] <= MOST_TRACES and c["legend"] <= MOST_TRACES, (title, c["traces"], c["legend"])
    heat = chart(page, "busy time against the step's cross-rank median")
    # 64 trainers (the role shown first): a row per rank by default (a row per node from 65 on)
    assert heat["types"] == ["heatmap"]
    assert sorted(heat["y"][0]) == sorted(f"rank {r}" for r in range(truth["spec"]["ranks"]))
    # the timeline shows the ranks picked (by default each role's slowest and its median rank), not all 80
    timeline = {y for ys in chart(page, "per-rank timeline")["y"] for y in ys}
    assert 2 <= len(timeline) <= 4, timeline


@pytest.mark.browser
@pytest.mark.slow
def test_tables_name_the_planted_node_and_ranks(cluster_page):
    page, truth = cluster_page
    planted = truth["planted"]
    text = captions(page)
    node, tail = planted["slow_node"], planted["tail_worker"]
    # the slowest node is the planted one, named as a node; the rollout node with one slow worker is not
    assert f"Slowest node: {node['host']}, its {len(node['ranks'])} trainer ranks" in text, text
    assert f"Slowest rank: rollout {tail['rank']} ({tail['host']})" in text, text
    # the distribution labels the slowest ranks by name and host
    strip = chart(page, "per-rank busy time per step")
    assert strip["types"] == ["box", "box"]
    labels = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')]
        .filter(e => (e._fullLayout.title.text || '').includes('per-rank busy time'))
        .flatMap(e => (e._fullLayout.annotations || []).map(a => a.text))""")
    assert f"rollout {tail['rank']} ({tail['host']})" in labels, labels


@pytest.mark.browser
@pytest.mark.slow
def test_rows_per_node_and_drill_down_to_one_rank(cluster_page):
    page, truth = cluster_page
    page.get_by_test_id("stRadioGroup").get_by_text("one per node", exact=True).click()
    page.wait_for_function("""() => [...document.querySelectorAll('.js-plotly-plot')].some(e =>
        (e._fullLayout.title.text || '').includes("node × step"))""", timeout=180_000)
    wait_drawn(page)
    heat = chart(page, "busy time against the step's cross-rank median")
    # a row per trainer node, every one of them and nothing else
    trainer_nodes = sorted(h for h, ranks in truth["hosts"].items() if max(ranks) < truth["spec"]["ranks"])
    assert sorted(heat["y"][0]) == trainer_nodes and len(trainer_nodes) == 8
    # pick the planted slow rank in the timeline's picker: the timeline then shows it
    slow = truth["planted"]["slow_rank"]
    box = page.locator('[data-testid="stMultiSelect"]').filter(has_text="Ranks on the timeline")
    box.locator("input").click()
    box.locator("input").fill(f"trainer {slow['rank']} ·")
    page.get_by_role("option").filter(has_text=f"trainer {slow['rank']} · {slow['host']}").first.click()
    page.keyboard.press("Escape")
    page.wait_for_function("""r => [...document.querySelectorAll('.js-plotly-plot')].some(e =>
        (e._fullLayout.title.text || '').includes('per-rank timeline') &&
        e._fullData.some(t => Array.from(t.y || []).includes(r)))""", arg=f"trainer {slow['rank']}", timeout=180_000)
    wait_drawn(page)
