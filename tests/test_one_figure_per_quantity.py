"""A quantity shown in several places reads the same in each: the demo's text, the report, the dashboard
and the SQL of the finding.

One quick demo for the session (a real SFT → GRPO run, probed, through the CLI). Each test computes the
quantity with the one function that defines it, writes it the way every surface writes it (the report's
sentence, ``dynascope.core.fmt``), and finds that text in the demo's stdout, in ``dynascope report`` and on
the dashboard page served by the real Streamlit server in headless Chromium; the finding's SQL, run as
``dynascope sql`` runs it, returns the same number.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from dynascope.analyses import probe_cost
from dynascope.analyses.delta_sync import delta_sync_summary
from dynascope.analyses.findings import MIN_PROBE_PCT, collect_findings, tail_wait_numbers
from dynascope.analyses.findings_dynamics import delta_sync_numbers
from dynascope.analyses.findings_text import sentence
from dynascope.analyses.probe_time import DEFAULT_PROBE_COST
from dynascope.analyses.rollouts import tail_wait_summary
from dynascope.analyses.step_shares import phase_shares
from dynascope.core.fmt import fmt_ms, fmt_pct
from dynascope.store import open_store, run_sql

CLI = [sys.executable, "-c", "from dynascope.cli import app; app()"]
CHROMIUM = "/usr/bin/chromium"


def _cli(*args: str) -> str:
    env = {**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1"}  # wide: the demo's table rows stay one line
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="session")
def demo(quick_demo) -> tuple[Path, str]:
    """(run directory, stdout) of one ``dynascope demo --quick`` (the session's, from conftest)."""
    return quick_demo


@pytest.fixture(scope="session")
def report(demo) -> str:
    return _cli("report", str(demo[0]))


@pytest.fixture(scope="session")
def findings(demo) -> dict:
    with open_store(demo[0]) as con:
        found, _ = collect_findings(con)
    return {f.finding: f for f in found}


def _sql(run: Path, sql: str) -> dict:
    with open_store(run) as con:  # as `dynascope sql RUN "<sql>"` runs it: read-only, fresh
        return run_sql(con, sql).to_pylist()[0]


@pytest.fixture(scope="session")
def pages(demo) -> dict[str, dict]:
    """Per dashboard page: its text and its tables' cells, as the browser shows them."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: the dashboard part needs Debian's chromium")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the python playwright package is not installed")
    from dynascope.dashboard.serve import serving

    ready = """() => { const app = document.querySelector('[data-testid="stApp"]');
        if (!app || app.getAttribute('data-test-script-state') !== 'notRunning') return false;
        return ![...document.querySelectorAll('[data-testid="stSkeleton"]')].length; }"""
    out = {}
    with serving(demo[0]) as base, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            for name, marker in (("dynamics", "as the report says it"), ("rollouts", "as the report says it"),
                                 ("cluster", "Where step time went"), ("runs", "Runs")):
                page.goto(f"{base}/{name}")
                page.get_by_text(marker).first.wait_for(timeout=180_000)  # a loaded 2-core machine is slow
                page.wait_for_function(ready, timeout=180_000)
                if name == "cluster":  # the grid draws on a canvas; its hidden table (the cells' text) comes after
                    page.locator('[data-testid="stDataFrame"] th', has_text="rl (").first.wait_for(
                        state="attached", timeout=60_000)
                assert page.locator('[data-testid="stException"]').count() == 0, name
                tables = [[tr.locator("th, td").all_text_contents() for tr in grid.locator("tr").all()]
                          for grid in page.locator('[data-testid="stDataFrame"]').all()]
                out[name] = {"text": " ".join(page.inner_text('[data-testid="stMain"]').split()), "tables": tables}
        finally:
            browser.close()
    return out


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _demo_row(stdout: str, label: str) -> list[str]:
    """The cells of the demo's table row that starts with ``label``."""
    line = next(x for x in stdout.splitlines() if x.startswith("│") and x.split("│")[1].strip().startswith(label))
    return [c.strip() for c in line.split("│")[1:-1]]


def test_changed_in_bf16_reads_the_same_everywhere(demo, report, findings, pages):
    """"Changed in bf16" = 1 − PULSE S₁, median over each stage's steps after its first (delta_sync_summary)."""
    run, stdout = demo
    rows = {r["stage"]: r for r in delta_sync_summary(run).iter_rows(named=True)}
    sft, rl = (f"{rows[s]['changed_pct']:.2f}%" for s in ("sft", "rl"))
    assert _demo_row(stdout, "changed in bf16 per step (1 − PULSE S₁)")[1:] == [sft, rl]
    upd = findings["update_sparsity"]
    assert upd.numbers["measure"] == "bf16"  # fp32 weights: the bf16 figure leads, not the ~98% bit-exact one
    said = f"changed in bf16 (1 − PULSE S₁): a rl step changed {rl} of parameters vs {sft} in sft"
    assert said in upd.sentence and said in _one_line(report)
    assert f"changed in bf16 (1 − PULSE S₁): {rl} of elements" in findings["delta_sync"].sentence
    row = _sql(run, upd.sql)
    assert (f"{row['bf16_changed_pct_a']:.2f}%", f"{row['bf16_changed_pct_b']:.2f}%") == (sft, rl)
    assert f"{_sql(run, findings['delta_sync'].sql)['changed_pct']:.2f}%" == rl
    page = pages["dynamics"]["text"]
    assert f"changed in bf16 (1 − PULSE S₁): {sft} of elements" in page
    assert f"changed in bf16 (1 − PULSE S₁): {rl} of elements" in page


def test_delta_sync_reads_the_same_everywhere(demo, report, findings, pages):
    """The report's sentence (rl, the stage it reports) and the dashboard's caption (every stage) say the
    figures of delta_sync_summary, first step of each stage left out in both."""
    run, _ = demo
    summary = delta_sync_summary(run)
    by_stage = {r["stage"]: sentence("delta_sync", delta_sync_numbers(r)) for r in summary.iter_rows(named=True)}
    rl = summary.filter(pl.col("stage") == "rl").row(0, named=True)
    assert findings["delta_sync"].sentence == by_stage["rl"]
    assert f"{rl['delta_pct']:.2f}% of the full bf16 bytes per rl step" in by_stage["rl"]
    assert f"{fmt_ms(rl['delta_sync_ms'])} instead of {fmt_ms(rl['full_bf16_sync_ms'])}" in by_stage["rl"]
    assert " 0 ms " not in by_stage["rl"]  # a 0.1 ms sync keeps its digits
    assert by_stage["rl"] in _one_line(report)
    for said in by_stage.values():
        assert said in pages["dynamics"]["text"]
    row = _sql(run, findings["delta_sync"].sql)
    assert (row["steps"], f"{row['delta_pct']:.2f}") == (rl["steps"], f"{rl['delta_pct']:.2f}")


def test_tail_wait_reads_the_same_everywhere(demo, report, findings, pages):
    """One share (Σ tail wait / Σ step time, tail_wait_summary), one sentence: demo, report, Rollouts page."""
    run, stdout = demo
    said = sentence("rollout_tail", tail_wait_numbers(tail_wait_summary(run).row(0, named=True)))
    assert findings["rollout_tail"].sentence == said
    assert f"Rollout tail: {said}." in _one_line(stdout)
    assert said in _one_line(report)
    assert said in pages["rollouts"]["text"]
    row = _sql(run, findings["rollout_tail"].sql)
    assert fmt_pct(row["tail_wait_pct"]) == fmt_pct(findings["rollout_tail"].numbers["tail_wait_pct"])


def test_step_shares_read_the_same_everywhere(demo, report, pages):
    """phase_shares' RL shares: every phase in the demo's table, the report's summary line and the Cluster
    page's table, each written by fmt_pct, and the demo's 'all' row at the shares' sum."""
    run, stdout = demo
    rl = phase_shares(run).filter(pl.col("stage") == "rl")
    want = {p: fmt_pct(s) for p, s in zip(rl["phase"], rl["share_pct"], strict=True)}
    demo_rows = [c for c in (line.split("│")[1:-1] for line in stdout.splitlines() if line.startswith("│ trainer"))]
    shown = {c[1].strip(): c[3].strip() for c in demo_rows}
    total = shown.pop(f"all ({rl['steps'][0]} steps)")
    assert shown == want, (shown, want)
    assert total == fmt_pct(rl["share_pct"].sum()) == "100%"
    line = next(x for x in report.splitlines() if x.startswith("  step time, rl "))
    assert line.split(": ", 1)[1] == ", ".join(f"{p} {s}" for p, s in want.items())
    table = next(t for t in pages["cluster"]["tables"] if t and t[0][0] == "phase")
    col = next(i for i, h in enumerate(table[0]) if h.startswith("rl ("))
    cells = {r[0]: r[col] for r in table[1:]}
    assert cells.pop("all") == total
    assert {p: s for p, s in cells.items() if s != "—"} == want


def test_probe_cost_reads_the_same_in_report_and_dashboard(demo, report, findings, pages):
    """The probe's own share of step time, beside its coverage and what watch()'s defaults cost."""
    run, stdout = demo
    with open_store(run) as con:
        cost = probe_cost(con).row(0, named=True)
    assert cost["coverage_pct"] == 100  # the demo computes every statistic of every tensor at every step
    said = "the probe's own work on the training thread took"
    if cost["probe_pct"] < MIN_PROBE_PCT:  # as cheap as watch()'s defaults: neither the report nor the page says it
        assert "probe_cost" not in findings
        assert said not in _one_line(report) and said not in pages["cluster"]["text"]
        return
    f = findings["probe_cost"]
    assert f.numbers["probe_pct"] == pytest.approx(cost["probe_pct"], rel=1e-5)
    assert f.sentence in _one_line(report) and f.sentence in pages["cluster"]["text"]
    assert DEFAULT_PROBE_COST in f.sentence and "1.015×" in f.sentence and "1.082×" in f.sentence
    assert "The demo records every statistic of every tensor at every step" in _one_line(stdout)
    row = _sql(run, f.sql)
    assert fmt_pct(row["probe_pct"]) == fmt_pct(f.numbers["probe_pct"]) and row["coverage_pct"] == 100


def test_heldout_accuracy_reads_the_same_everywhere(demo, pages):
    """eval/accuracy: once per step, at the step whose weights it scored; the demo's lines and table, the
    Runs page's query and SQL give one value per stage."""
    run, stdout = demo
    with open_store(run) as con:
        twice = con.rows("SELECT step, count(*) FROM scalars WHERE key = 'eval/accuracy' GROUP BY step "
                         "HAVING count(*) > 1")
        assert twice == [], twice
        (last_step,) = con.rows("SELECT max(step) FROM timings WHERE category = 'step'")[0]
        last = {s: (v, st) for s, v, st in con.rows(
            "SELECT stage, arg_max(value, step), max(step) FROM scalars WHERE key = 'eval/accuracy' GROUP BY stage")}
        from dynascope.dashboard.queries.runs import scalar_series

        series = scalar_series(con, (run.name,), "eval/accuracy")
    assert last["rl"][1] == last_step  # the final evaluation scores the last step's weights, at that step
    sft, rl = (f"{100 * last[s][0]:.1f}%" for s in ("sft", "rl"))
    assert f"held-out accuracy {sft}; GRPO" in stdout and f"RL done: held-out accuracy {rl}" in stdout
    assert _demo_row(stdout, "greedy accuracy")[1:3] == [sft, rl]
    charted = {s: g.sort("step")["mean"][-1] for (s,), g in series.group_by("stage")}
    assert {s: f"{100 * v:.1f}%" for s, v in charted.items()} == {"sft": sft, "rl": rl}
    assert "Runs" in pages["runs"]["text"]


def test_dashboard_start_prints_no_runpy_warning(tmp_path):
    """``python -m dynascope.dashboard.serve`` with the package not importing serve itself: no runpy warning."""
    done = subprocess.run([sys.executable, "-W", "always", "-m", "dynascope.dashboard.serve", "version"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0 and "found in sys.modules" not in done.stderr, done.stderr
    assert re.search(r"Streamlit, version", done.stdout)
