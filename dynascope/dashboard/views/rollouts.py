"""Rollouts page: response-length distribution and tail wait, rewards and zero-variance groups, staleness,
and trainer↔rollout consistency (``views.consistency``).

Charts come from ``dynascope.analyses.rollouts`` (per step, downsampled here) and, for the mean reward,
from ``dynascope.dashboard.queries.rollouts``.
"""

from __future__ import annotations

import plotly.graph_objects as go
import polars as pl
import streamlit as st

from dynascope import analyses
from dynascope.analyses.findings import tail_wait_numbers
from dynascope.analyses.findings_text import sentence
from dynascope.dashboard import charts, data
from dynascope.dashboard.queries import rollouts as Q
from dynascope.dashboard.views import consistency


def page() -> None:
    data.live(_body)


def _lengths(path: str, runs: tuple[str, ...]) -> pl.DataFrame:
    """(run_id, step, quantile, tokens) rows for p50/p90/p99/max response length."""
    lt = data.per_run(analyses.rollout_long_tail, path, runs)
    cols = {f"response_len_{q}_tokens": q for q in ("p50", "p90", "p99", "max")}
    lt = data.downsample(lt, "step", list(cols), ["run_id"]).select("run_id", "step", *cols).rename(cols)
    return lt.unpivot(index=["run_id", "step"], variable_name="quantile", value_name="tokens").sort(
        "run_id", "quantile", "step")


def _body() -> None:
    path, runs = data.current()
    st.header("Rollouts")
    if not runs:
        st.info("Pick one or more runs in the sidebar.")
        return
    # Each chart below the first is its own scan of samples or timings: start them while the first is drawn.
    data.prefetch(path, queries=[(Q.rewards, (runs,))],
                  analyses=[(fn, {"run": r}) for fn in (analyses.tail_wait_share, analyses.tail_wait_summary,
                                                        analyses.zero_variance_groups, analyses.async_staleness)
                            for r in runs])
    left, right = st.columns(2)
    with left, data.guard("Response lengths"):
        ln = _lengths(path, runs)
        if not data.empty(ln, "rollout samples"):
            charts.show(charts.banded(ln, "step", "tokens", None, None, ["run_id", "quantile"],
                                      "response length per step", "tokens"), "ro_lengths")
    with right, data.guard("Tail wait"):
        tw = data.downsample(data.per_run(analyses.tail_wait_share, path, runs), "step", ["tail_wait_pct"],
                             ["run_id"])
        if not data.empty(tw, "generation times"):
            charts.show(charts.banded(tw, "step", "tail_wait_pct", "tail_wait_pct_lo", "tail_wait_pct_hi",
                                      ["run_id"], "tail wait: median sample done → last done", "% of step time"),
                        "ro_tail")
            if not tw.filter(pl.col("tail_wait_pct_hi") > 0).height:  # a flat line at 0 says why
                st.caption("No tail wait at any step: every sample of a step finished at the same moment, as when "
                           "a step's responses are generated as one batch (one generate call ends all its "
                           "sequences together), so no rollout waited on a longer one.")
            _tail_caption(path, runs)
    left, right = st.columns(2)
    with left, data.guard("Rewards"):
        rw = data.query(Q.rewards, path, runs)
        if not data.empty(rw, "rewards"):
            charts.show(charts.banded(rw, "step", "reward", "reward_lo", "reward_hi", ["run_id"], "mean reward",
                                      "reward"), "ro_reward")
    with right, data.guard("Zero-variance groups"):
        zv = data.downsample(data.per_run(analyses.zero_variance_groups, path, runs), "step", ["zero_variance_pct"],
                             ["run_id"])
        if not data.empty(zv, "groups of two or more rewarded samples"):
            charts.show(charts.banded(zv, "step", "zero_variance_pct", "zero_variance_pct_lo",
                                      "zero_variance_pct_hi", ["run_id"], "zero-variance groups (no advantage signal)",
                                      "% of groups"), "ro_zero_var")
    with data.guard("Staleness"):
        _staleness(path, runs)
    with data.guard("Trainer ↔ rollout consistency"):
        consistency.section(path, runs)


def _tail_caption(path: str, runs: tuple[str, ...]) -> None:
    """The run's whole tail-wait share under the per-step chart: Σ tail wait / Σ step time
    (``tail_wait_summary``), in the report's own sentence."""
    summary = data.per_run(analyses.tail_wait_summary, path, runs).filter(pl.col("step_ms") > 0)
    said = [("" if len(runs) == 1 else f"{r['run_id']}: ") + sentence("rollout_tail", tail_wait_numbers(r))
            for r in summary.iter_rows(named=True)]
    if said:
        st.caption("Over the whole run, as the report says it: " + "; ".join(said) + ".")


def _staleness(path: str, runs: tuple[str, ...]) -> None:
    """Samples per staleness (an integer number of optimizer steps): one bar per value, a tick per integer."""
    stl = data.per_run(analyses.async_staleness, path, runs)
    if stl.height == 0:
        st.info("No policy/trainer versions on the samples: staleness applies to asynchronous runs.")
        return
    if stl.filter(pl.col("staleness_steps") != 0).height == 0:
        st.caption("Every sample was consumed by the policy version that generated it (synchronous).")
    fig = go.Figure()
    for i, ((run,), g) in enumerate(stl.group_by("run_id", maintain_order=True)):
        fig.add_trace(go.Bar(x=g["staleness_steps"].to_list(), y=g["samples"].to_list(), name=str(run),
                             marker_color=charts.PALETTE[i % len(charts.PALETTE)], customdata=g["share_pct"].to_list(),
                             hovertemplate="staleness %{x}<br>%{y} samples (%{customdata:.1f} %)<extra></extra>"))
    lo, hi = int(stl["staleness_steps"].min()), int(stl["staleness_steps"].max())
    # An integer axis from 0 (or the lowest value) to at least 1: a lone bar at 0 otherwise gets ticks at −0.4…0.4.
    fig.update_xaxes(type="linear", tick0=0, dtick=max(1, (hi - lo) // 20 + 1), range=[min(0, lo) - 0.5, max(hi, 1) + 0.5])
    fig.update_layout(barmode="group", bargap=0.15)
    charts.show(charts.layout(fig, "staleness (trainer − policy version, steps)", "staleness (steps)", "samples"),
                "ro_staleness")
