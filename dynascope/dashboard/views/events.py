"""Events page: instability, faults, checkpoints and restarts on the step axis, each linked to its step."""

from __future__ import annotations

import plotly.graph_objects as go
import polars as pl
import streamlit as st

from dynascope.dashboard import charts, data

_SEVERITY_COLOR = {"info": "#4C78A8", "warning": "#F58518", "error": "#E45756", "critical": "#9E0142"}


def page() -> None:
    data.live(_body)


def _body() -> None:
    path, runs = data.current()
    st.header("Events")
    if not runs:
        st.info("Pick one or more runs in the sidebar.")
        return
    with data.guard("Events"):
        ev = data.query("runs.events", path, runs)
        detected = _detected(path, runs)
        if ev.height == 0 and detected.height == 0:
            st.info("No events in the selected runs, and no instability detected.")
            return
        kinds = sorted(set(ev["kind"].drop_nulls().to_list()) | set(detected["kind"].drop_nulls().to_list()))
        picked = st.multiselect("Kinds", kinds, default=data.remembered("ev_kinds", kinds, kinds), key="ev_kinds")
        ev = ev.filter(pl.col("kind").is_in(picked))
        detected = detected.filter(pl.col("kind").is_in(picked))
        _timeline(path, runs, ev, detected)
        st.caption("Recorded events")
        st.dataframe(ev.drop("fields_json"), hide_index=True, width="stretch", key="ev_table")
        if detected.height:
            st.caption("Detected by dynascope.analyses.detect_instability (robust z-score spikes, NaN/Inf)")
            st.dataframe(detected, hide_index=True, width="stretch", key="ev_detected")
        _step_context(path, pl.concat([ev.select("run_id", "step", "kind"), detected.select("run_id", "step", "kind")],
                                      how="vertical_relaxed"))
    with data.guard("Goodput"):
        _goodput(path, runs)


def _detected(path: str, runs: tuple[str, ...]) -> pl.DataFrame:
    """Instability the analyses find in scalars and tensor stats (not only what the run logged)."""
    try:
        chosen = tuple(r for r in runs if data.on_demand("instability", f"Detect instability in {r}", path, r))
        if chosen:
            return data.per_run("detect_instability", path, chosen)
    except data.MissingAnalysis:
        pass
    return pl.DataFrame(schema={"run_id": pl.String, "rank": pl.Int32, "step": pl.Int64, "kind": pl.String,
                                "severity": pl.String, "message": pl.String})


def _goodput(path: str, runs: tuple[str, ...]) -> None:
    try:
        gp = data.per_run("goodput_summary", path, runs)
        inc = data.per_run("goodput_incidents", path, runs)
    except data.MissingAnalysis:
        return
    if gp.height == 0:
        return
    st.subheader("Goodput")
    st.dataframe(gp, hide_index=True, width="stretch", key="ev_goodput")
    if inc.height:
        st.caption("Restarts: lost work since the last checkpoint and downtime")
        st.dataframe(inc, hide_index=True, width="stretch", key="ev_incidents")


def _timeline(path: str, runs: tuple[str, ...], ev: pl.DataFrame, detected: pl.DataFrame) -> None:
    """Event markers at their step over a background scalar, so an event lines up with what it did."""
    keys = data.query("runs.scalar_keys", path, runs)
    fig = go.Figure()
    if keys:
        key = st.selectbox("Background scalar", keys, index=keys.index("loss") if "loss" in keys else 0,
                           key="ev_scalar")
        bg = data.query("runs.scalar_series", path, runs, key)
        for (run,), g in bg.sort("run_id", "step").group_by("run_id", maintain_order=True):
            fig.add_trace(go.Scatter(x=g["step"].to_list(), y=g["mean"].to_list(), yaxis="y2", mode="lines",
                                     name=f"{key} · {run}", line=dict(width=1), opacity=0.6))
        fig.update_layout(yaxis2=dict(overlaying="y", side="right", title=key, showgrid=False))
    stepped = ev.filter(pl.col("step").is_not_null())
    for (sev,), g in stepped.group_by("severity", maintain_order=True):
        fig.add_trace(go.Scatter(
            x=g["step"].to_list(), y=g["kind"].to_list(), mode="markers", name=str(sev),
            marker=dict(size=12, symbol="diamond", color=_SEVERITY_COLOR.get(str(sev), "#777")),
            text=[f"{r} · rank {k}: {m}" for r, k, m in zip(g["run_id"], g["rank"], g["message"], strict=True)],
            hovertemplate="step %{x}<br>%{y}<br>%{text}<extra></extra>"))
    if detected.height:
        fig.add_trace(go.Scatter(
            x=detected["step"].to_list(), y=detected["kind"].to_list(), mode="markers", name="detected",
            marker=dict(size=13, symbol="circle-open", color="#B279A2", line=dict(width=2)),
            text=[f"{r} · rank {k}: {m}" for r, k, m in detected.select("run_id", "rank", "message").iter_rows()],
            hovertemplate="step %{x}<br>%{y}<br>%{text}<extra></extra>"))
    fig.update_layout(yaxis=dict(type="category"))
    charts.show(charts.layout(fig, "Events by step", "step", "kind"), "ev_chart")


def _step_context(path: str, ev: pl.DataFrame) -> None:
    """Pick an event; show what the store holds about its step (scalars, phase times, worst tensors)."""
    stepped = ev.filter(pl.col("step").is_not_null()).unique(maintain_order=True)
    if stepped.height == 0:
        return
    options = [(r, int(s), k) for r, s, k in zip(stepped["run_id"], stepped["step"], stepped["kind"], strict=True)]
    run, step, _ = st.selectbox("Inspect the step of", options, key="ev_pick",
                                format_func=lambda o: f"step {o[1]} · {o[2]} · {o[0]}")
    ctx = data.query("runs.step_context", path, run, step)
    st.subheader(f"{run} · step {step}")
    cols = st.columns(3)
    for col, (name, df) in zip(cols, ctx.items(), strict=True):
        with col:
            st.caption(name)
            if df.height:
                st.dataframe(df, hide_index=True, width="stretch")
            else:
                st.write("—")
