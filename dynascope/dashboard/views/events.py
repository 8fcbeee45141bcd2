"""Events page: instability, faults, checkpoints and restarts on the step axis, each linked to its step."""

from __future__ import annotations

import plotly.graph_objects as go
import polars as pl
import streamlit as st

from dynascope import analyses
from dynascope.dashboard import charts, data
from dynascope.dashboard.queries import runs as Q

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
        ev = data.query(Q.events, path, runs)
        detected = _detected(path, runs)
        if ev.height == 0 and detected.height == 0:
            st.info("No events in the selected runs, and no instability detected.")
            return
        kinds = sorted(set(ev["event"].drop_nulls().to_list()) | set(detected["event"].drop_nulls().to_list()))
        picked = st.multiselect("Events", kinds, default=data.remembered("ev_kinds", kinds, kinds), key="ev_kinds")
        ev = ev.filter(pl.col("event").is_in(picked))
        detected = detected.filter(pl.col("event").is_in(picked))
        _timeline(path, runs, ev, detected)
        st.caption("Recorded events")
        st.dataframe(ev.select(*_RECORDED), hide_index=True, width="stretch", key="ev_table", column_config=_FIT_WIDTH)
        if detected.height:
            st.caption("Detected by dynascope.analyses.detect_instability (robust z-score spikes, NaN/Inf)")
            st.dataframe(detected.select(*_DETECTED), hide_index=True, width="stretch", key="ev_detected",
                         column_config=_FIT_WIDTH)
        _step_context(path, pl.concat([ev.select("run_id", "step", "event"), detected.select("run_id", "step", "event")],
                                      how="vertical_relaxed"))
    with data.guard("Goodput"):
        _goodput(path, runs)


# Tables sized to the page: Streamlit sizes a column to its longest cell, so one long message pushed the
# numbers past the right edge. Narrow columns for short values; the message gets what is left and wraps
# into its tooltip.
_FIT_WIDTH = {c: st.column_config.Column(width="small") for c in (
    "rank", "step", "severity", "value", "baseline", "robust_z", "dur_ms")} | {
    "run_id": st.column_config.Column(width=110), "event": st.column_config.Column(width=140),
    "time": st.column_config.DatetimeColumn(width=150, format="YYYY-MM-DD HH:mm:ss"),
    "message": st.column_config.Column(width="medium")}
_RECORDED = ("run_id", "step", "rank", "event", "severity", "dur_ms", "time", "message")
_DETECTED = ("run_id", "rank", "step", "event", "severity", "value", "baseline", "robust_z", "message")


def _detected(path: str, runs: tuple[str, ...]) -> pl.DataFrame:
    """Instability the analyses find in scalars and tensor stats (not only what the run logged)."""
    chosen = tuple(r for r in runs if data.on_demand("instability", f"Detect instability in {r}", path, r))
    if chosen:
        found = data.per_run(analyses.detect_instability, path, chosen)
        return found.rename({"kind": "event"}) if "kind" in found.columns else found
    return pl.DataFrame(schema={"run_id": pl.String, "rank": pl.Int32, "step": pl.Int64, "event": pl.String,
                                "severity": pl.String, "value": pl.Float64, "baseline": pl.Float64,
                                "robust_z": pl.Float64, "message": pl.String})


def _goodput(path: str, runs: tuple[str, ...]) -> None:
    gp = data.per_run(analyses.goodput_summary, path, runs)
    inc = data.per_run(analyses.goodput_incidents, path, runs)
    if gp.height == 0:
        return
    st.subheader("Goodput")
    # One column per run, one row per figure: a dozen figures side by side ran off the right of the page.
    wide = gp.drop("run_id").cast(pl.Float64).transpose(include_header=True, header_name="figure",
                                                        column_names=gp["run_id"].to_list())
    st.dataframe(wide, hide_index=True, width="content", key="ev_goodput", height=35 * (wide.height + 1) + 3,
                 column_config={r: st.column_config.NumberColumn(format="%.4g") for r in gp["run_id"]})
    if inc.height:
        st.caption("Restarts: lost work since the last checkpoint and downtime")
        st.dataframe(inc.select("run_id", "resumed_step", "failure_source", "last_checkpoint_step", "last_step",
                                "lost_steps", "lost_work_ms", "downtime_ms"),
                     hide_index=True, width="stretch", key="ev_incidents")


def _timeline(path: str, runs: tuple[str, ...], ev: pl.DataFrame, detected: pl.DataFrame) -> None:
    """Event markers at their step over a background scalar, so an event lines up with what it did."""
    keys = data.query(Q.scalar_keys, path, runs)
    fig = go.Figure()
    if keys.height:
        names = keys["key"].to_list()
        key = st.selectbox("Background scalar", names, index=names.index(Q.default_scalar(keys)), key="ev_scalar")
        bg = data.query(Q.scalar_series, path, runs, key)
        for (run,), g in bg.sort("run_id", "step").group_by("run_id", maintain_order=True):
            xs, ys = charts.gapped(g["step"].to_list(), g["mean"].to_list())  # no line across unlogged steps
            fig.add_trace(go.Scatter(x=xs, y=ys, yaxis="y2", mode="lines", name=f"{key} · {run}",
                                     line=dict(width=1), opacity=0.6, connectgaps=False))
        # Plotly syncs an overlaying axis's ticks to the left axis's grid by default: on a category axis of
        # events the right axis then labelled each event row with a value, as if it were the event's.
        fig.update_layout(yaxis2=dict(overlaying="y", side="right", title=f"{key} (line)", showgrid=False,
                                      tickmode="auto", nticks=5, color="#888"))
    stepped = ev.filter(pl.col("step").is_not_null())
    for (sev,), g in stepped.group_by("severity", maintain_order=True):
        fig.add_trace(go.Scatter(
            x=g["step"].to_list(), y=g["event"].to_list(), mode="markers", name=str(sev),
            marker=dict(size=12, symbol="diamond", color=_SEVERITY_COLOR.get(str(sev), "#777")),
            text=[f"{r} · rank {k}: {m}" for r, k, m in zip(g["run_id"], g["rank"], g["message"], strict=True)],
            hovertemplate="step %{x}<br>%{y}<br>%{text}<extra></extra>"))
    if detected.height:
        fig.add_trace(go.Scatter(
            x=detected["step"].to_list(), y=detected["event"].to_list(), mode="markers", name="detected",
            marker=dict(size=13, symbol="circle-open", color="#B279A2", line=dict(width=2)),
            text=[f"{r} · rank {k}: {m}" for r, k, m in detected.select("run_id", "rank", "message").iter_rows()],
            hovertemplate="step %{x}<br>%{y}<br>%{text}<extra></extra>"))
    fig.update_layout(yaxis=dict(type="category"))
    charts.show(charts.layout(fig, "Events by step", "step", "event"), "ev_chart")


def _step_context(path: str, ev: pl.DataFrame) -> None:
    """Pick an event; show what the store holds about its step (scalars, phase times, worst tensors)."""
    stepped = ev.filter(pl.col("step").is_not_null()).unique(maintain_order=True)
    if stepped.height == 0:
        return
    options = [(r, int(s), k) for r, s, k in zip(stepped["run_id"], stepped["step"], stepped["event"], strict=True)]
    run, step, _ = st.selectbox("Inspect the step of", options, key="ev_pick",
                                format_func=lambda o: f"step {o[1]} · {o[2]} · {o[0]}")
    ctx = data.query(Q.step_context, path, run, step)
    st.subheader(f"{run} · step {step}")
    # Scalars and phases are narrow, side by side; the worst tensors have five columns and take the width.
    left, right = st.columns(2)
    for col, name in ((left, "scalars"), (right, "phases"), (st.container(), "tensors")):
        with col:
            st.caption(name)
            if ctx[name].height:
                st.dataframe(ctx[name], hide_index=True, width="stretch", key=f"ev_ctx_{name}")
            else:
                st.write("—")
