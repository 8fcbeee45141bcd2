"""The dashboard's chart rules and query plumbing, without a browser: honest axes, broken lines at gaps,
distinct phase colours, the default scalar and timeline window, and callables (not names) for queries."""

from __future__ import annotations

import ast
from pathlib import Path

import plotly.graph_objects as go
import polars as pl
import pytest

from dynascope.core.clock import now_us
from dynascope.dashboard import charts
from dynascope.dashboard.queries import cluster, runs
from dynascope.store import RunWriter, open_store

VIEWS = Path(__file__).resolve().parent.parent / "dynascope" / "dashboard" / "views"


def test_fraction_axis_spans_zero_to_one_or_says_it_is_zoomed():
    wide = charts.fraction_axis(charts.layout(go.Figure(go.Scatter(y=[0.9834, 0.984])), "t", ytitle="fraction"), 0.984)
    assert list(wide.layout.yaxis.range) == [0, 1.0] and "zoomed" not in wide.layout.yaxis.title.text
    # A sparsity line between 0.0160 and 0.0166: from 0, to a round top, and the title says so.
    small = charts.fraction_axis(charts.layout(go.Figure(go.Scatter(y=[0.016, 0.0166])), "t", ytitle="fraction"), 0.0166)
    lo, hi = small.layout.yaxis.range
    assert lo == 0 and hi == pytest.approx(0.03) and "zoomed to 0–3 %" in small.layout.yaxis.title.text


def test_log_axis_labels_only_decades_once_the_data_spans_one():
    fig = charts.log_axis(go.Figure(), 1e-3, 2e-2)
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis.dtick == 1 and fig.layout.yaxis.minor.dtick == "D1"
    assert charts.log_axis(go.Figure(), 2e-3, 5e-3).layout.yaxis.dtick is None  # under a decade: plotly's ticks
    assert charts.log_axis(go.Figure(), 3, 40_000).layout.yaxis.tickformat == "~s"  # counts read 1k, 10k


def test_gapped_breaks_the_line_where_nothing_was_logged():
    xs = list(range(0, 50)) + list(range(120, 150))
    ox, oy = charts.gapped(xs, [float(x) for x in xs])
    assert ox.count(None) == 1 and oy.count(None) == 1
    assert ox[ox.index(None) - 1] == 49 and ox[ox.index(None) + 1] == 120
    assert charts.gapped([0, 2, 4, 6], [1, 2, 3, 4]) == ([0, 2, 4, 6], [1, 2, 3, 4])  # regular spacing: untouched


def test_phase_colours_are_distinct_and_fixed():
    names = ["rollout", "weight_sync", "(uninstrumented)", "eval", "zeta", "alpha", "ref_logprob", "train"]
    colors = charts.phase_colors(names)
    assert len(set(colors.values())) == len(names)
    assert colors["weight_sync"] != colors["(uninstrumented)"]
    assert charts.phase_colors(["weight_sync"])["weight_sync"] == colors["weight_sync"]  # whatever else is shown


def test_default_scalar_has_a_series():
    keys = pl.DataFrame({"key": ["eval/accuracy", "mem/rss_bytes", "rl/reward", "sft/loss"], "steps": [1, 200, 150, 50]})
    assert runs.default_scalar(keys) == "rl/reward"
    keys = pl.DataFrame({"key": ["eval/accuracy", "loss", "tokens"], "steps": [1, 1, 30]})
    assert runs.default_scalar(keys) == "tokens"  # 'loss' logged once would be a single dot


def test_timeline_window_ends_on_a_typical_step(tmp_path):
    """The last step of a run is often an evaluation: the timeline starts on the last ordinary step of
    the recent steps, not of the longest stage."""
    t = now_us()
    with RunWriter(tmp_path / "run", flush_secs=60) as w:  # a long first stage, a short second, a final eval
        for step in range(1, 71):
            phases = ["eval"] if step == 70 else ["data", "forward"] if step <= 40 else ["rollout", "forward"]
            w.append("timings", {"step": step, "phase": phases, "category": "phase", "start_us": t,
                                 "dur_us": 1000})
            w.append("timings", {"step": step, "phase": "step", "category": "step", "start_us": t, "dur_us": 5000})
            t += 5000
    with open_store(tmp_path / "run") as store:
        span = cluster.timing_span(store, "run").row(0, named=True)
    assert span["last_step"] == 70 and span["typical_step"] == 69


def test_breakdown_averages_only_recurring_phases_inside_steps(tmp_path):
    """A 150 s evaluation after training (no step row) and a checkpoint in one step are no per-step time:
    they are listed apart, and every recurring phase's mean is over the timed steps."""
    t = now_us()
    with RunWriter(tmp_path / "run", flush_secs=60) as w:
        for step in range(10):
            phases = ["train", "eval"] + (["checkpoint"] if step == 5 else [])
            durs = [100_000, 20_000 if step % 2 == 0 else 0] + ([3_000_000] if step == 5 else [])
            w.append("timings", {"step": step, "phase": phases, "category": "phase", "start_us": t, "dur_us": durs})
            w.append("timings", {"step": step, "phase": "step", "category": "step", "start_us": t,
                                 "dur_us": sum(durs) + 5000})
            t += sum(durs) + 5000
        w.append("timings", {"step": 10, "phase": "alpharl", "category": "phase", "start_us": t, "dur_us": 150_000_000})
    with open_store(tmp_path / "run") as store:
        bd = {r["phase"]: r for r in cluster.phase_breakdown(store, "run").iter_rows(named=True)}
    assert bd["train"]["ms_per_step"] == pytest.approx(100.0) and not bd["train"]["one_off"]
    assert bd["eval"]["ms_per_step"] == pytest.approx(10.0)  # in every other step: amortised over all ten
    assert bd["(uninstrumented)"]["ms_per_step"] == pytest.approx(5.0)
    for phase, ms, step in (("alpharl", 150_000.0, 10), ("checkpoint", 3000.0, 5)):
        row = bd[phase]
        assert row["one_off"] and row["ms_per_step"] is None and row["first_step"] == step
        assert row["timed_ms"] + row["outside_ms"] == pytest.approx(ms)


def test_views_pass_callables_not_names():
    """data.query/analysis/per_run/prefetch take the function itself, so a typo fails at import, not as an
    'analysis not available' line on the page."""
    offenders = []
    for path in VIEWS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "data"
                    and node.func.attr in ("query", "analysis", "per_run") and node.args
                    and isinstance(node.args[0], ast.Constant)):
                offenders.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.Tuple) and node.elts and isinstance(node.elts[0], ast.Constant) \
                    and isinstance(node.elts[0].value, str) and "." in node.elts[0].value and len(node.elts) == 2 \
                    and isinstance(node.elts[1], ast.Tuple | ast.Dict):
                offenders.append(f"{path.name}:{node.lineno} (prefetch)")
    assert not offenders, offenders
