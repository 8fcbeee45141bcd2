"""Rollouts page: response-length distribution and tail wait, rewards and zero-variance groups, staleness.

Charts come from ``dynascope.analyses.rollouts`` (per step, downsampled here); the dashboard's own
queries stand in where an analysis is missing.
"""

from __future__ import annotations

import polars as pl
import streamlit as st

from dynascope.dashboard import charts, data


def page() -> None:
    data.live(_body)


def _lengths(path: str, runs: tuple[str, ...]) -> pl.DataFrame:
    """(run_id, step, quantile, tokens) rows for p50/p90/p99/max response length."""
    try:
        lt = data.per_run("rollout_long_tail", path, runs)
        cols = {f"response_len_{q}_tokens": q for q in ("p50", "p90", "p99", "max")}
        lt = data.downsample(lt, "step", list(cols), ["run_id"]).select("run_id", "step", *cols).rename(cols)
    except data.MissingAnalysis:
        lt = data.query("rollouts.lengths", path, runs).select("run_id", "step", "p50", "p90", max="max_len")
    return lt.unpivot(index=["run_id", "step"], variable_name="quantile", value_name="tokens").sort(
        "run_id", "quantile", "step")


def _body() -> None:
    path, runs = data.current()
    st.header("Rollouts")
    if not runs:
        st.info("Pick one or more runs in the sidebar.")
        return
    left, right = st.columns(2)
    with left, data.guard("Response lengths"):
        ln = _lengths(path, runs)
        if not data.empty(ln, "rollout samples"):
            charts.show(charts.banded(ln, "step", "tokens", None, None, ["run_id", "quantile"],
                                      "response length per step", "tokens"), "ro_lengths")
    with right, data.guard("Tail wait"):
        try:
            tw = data.downsample(data.per_run("tail_wait_share", path, runs), "step", ["tail_wait_pct"], ["run_id"])
            what = "% of step time"
            title = "tail wait: median sample done → last done"
        except data.MissingAnalysis:
            tw = data.query("rollouts.lengths", path, runs).rename(
                {"tail_pct": "tail_wait_pct", "tail_pct_lo": "tail_wait_pct_lo", "tail_pct_hi": "tail_wait_pct_hi"})
            what = "% of generation span"
            title = "tail wait: 90 % of samples done → last done"
        if not data.empty(tw, "generation times"):
            charts.show(charts.banded(tw, "step", "tail_wait_pct", "tail_wait_pct_lo", "tail_wait_pct_hi",
                                      ["run_id"], title, what), "ro_tail")
    left, right = st.columns(2)
    with left, data.guard("Rewards"):
        rw = data.query("rollouts.rewards", path, runs)
        if not data.empty(rw, "rewards"):
            charts.show(charts.banded(rw, "step", "reward", "reward_lo", "reward_hi", ["run_id"], "mean reward",
                                      "reward"), "ro_reward")
    with right, data.guard("Zero-variance groups"):
        try:
            zv = data.downsample(data.per_run("zero_variance_groups", path, runs), "step", ["zero_variance_pct"],
                                 ["run_id"])
        except data.MissingAnalysis:
            zv = data.query("rollouts.rewards", path, runs).rename({"zero_var_pct": "zero_variance_pct"})
            zv = zv.with_columns(zero_variance_pct_lo=pl.col("zero_variance_pct"),
                                 zero_variance_pct_hi=pl.col("zero_variance_pct"))
        if not data.empty(zv, "groups of two or more rewarded samples"):
            charts.show(charts.banded(zv, "step", "zero_variance_pct", "zero_variance_pct_lo",
                                      "zero_variance_pct_hi", ["run_id"], "zero-variance groups (no advantage signal)",
                                      "% of groups"), "ro_zero_var")
    with data.guard("Staleness"):
        _staleness(path, runs)


def _staleness(path: str, runs: tuple[str, ...]) -> None:
    try:
        stl = data.per_run("async_staleness", path, runs).rename({"staleness_steps": "staleness"})
    except data.MissingAnalysis:
        stl = data.query("rollouts.staleness", path, runs)
    if stl.height == 0:
        st.info("No policy/trainer versions on the samples: staleness applies to asynchronous runs.")
        return
    if stl.filter(pl.col("staleness") != 0).height == 0:
        st.caption("Every sample was consumed by the policy version that generated it (synchronous).")
    stl = stl.with_columns(pl.col("staleness").cast(pl.String))
    charts.show(charts.bars(stl, "staleness", "samples", "run_id", "staleness (trainer − policy version, steps)",
                            "samples", stacked=False), "ro_staleness")
