"""KL to the base and forgetting, side by side: RL's Razor's two quantities on one chart.

RL's Razor (Shenfeld, Pari & Agrawal, arXiv 2509.04259) finds that forgetting follows the forward KL from
the base policy to the trained one on the new task, and not the weight change. The chart puts forgetting
(the rise of log-loss on held-out text the run does not train on) and that KL at each evaluation point,
as ``analyses.forgetting_by_point`` pairs them. The weight measures stay on their own charts: a run's
handful of evaluation points cannot say whether they predict forgetting, so the page does not offer them
as predictors.
"""

from __future__ import annotations

import plotly.graph_objects as go
import polars as pl
import streamlit as st

from dynascope import analyses
from dynascope.dashboard import charts, data

MIN_POINTS = 5  # evaluation points before a rank correlation over them is shown at all

FORGET_COLOR, KL_COLOR = charts.PALETTE[3], charts.PALETTE[0]


def section(path: str, runs: tuple[str, ...]) -> None:
    st.subheader("KL to the base and forgetting")
    df = pl.concat([data.analysis(analyses.forgetting_by_point, path, run=r) for r in runs], how="diagonal_relaxed")
    both = df.filter(pl.col("forgetting_nats").is_not_null() | pl.col("forward_kl_nats").is_not_null())
    if both.is_empty():
        st.info("No evaluation points with forgetting or a KL to the base in these runs: log the log-loss on "
                "held-out text as `eval/prose_nll_nats` (before RL and at each RL evaluation) and the forward KL "
                "to the SFT policy on the training task as `eval/forward_kl_sft_nats`.")
        return
    charts.show(figure(both), "dyn_forgetting")
    st.caption(caption(both))


def figure(df: pl.DataFrame) -> go.Figure:
    """Forgetting (left axis, solid) and the forward KL (right axis, dashed) per run over RL steps."""
    fig = go.Figure()
    for run, g in df.sort("step").group_by("run_id", maintain_order=True):
        name = f"{run[0]} · "
        fig.add_trace(go.Scatter(x=g["step"].to_list(), y=g["forgetting_nats"].to_list(), mode="lines+markers",
                                 name=f"{name}forgetting", line=dict(color=FORGET_COLOR)))
        fig.add_trace(go.Scatter(x=g["step"].to_list(), y=g["forward_kl_nats"].to_list(), mode="lines+markers",
                                 name=f"{name}KL to base", yaxis="y2", line=dict(color=KL_COLOR, dash="dash")))
    charts.layout(fig, "forgetting and forward KL to the base, per evaluation point",
                  "step", "forgetting: held-out log-loss rise, nats/token")
    fig.update_layout(yaxis2=dict(title="KL(π_base ‖ π), nats", overlaying="y", side="right", rangemode="tozero",
                                  showgrid=False))
    return charts.place_legend(fig)


def caption(df: pl.DataFrame) -> str:
    """What the chart shows, and the rank correlation of the two where there are enough points to state one."""
    text = ("Forgetting: the rise of log-loss on held-out text the run does not train on, from the last "
            "evaluation before RL (0 = none). KL: forward KL from the SFT policy to the current one on the "
            "training task. RL's Razor (arXiv 2509.04259) finds forgetting follows this KL and not the size, "
            "sparsity or rank of the weight change, which is why those are not offered here as predictors.")
    for run, g in df.group_by("run_id", maintain_order=True):
        pts = g.drop_nulls(["forgetting_nats", "forward_kl_nats"])
        if pts.height >= MIN_POINTS:
            rho = pts.select(pl.corr("forward_kl_nats", "forgetting_nats", method="spearman")).item()
            said = "undefined (one side constant)" if rho is None or rho != rho else f"{rho:+.2f}"
            text += f" {run[0]}: Spearman's ρ(KL, forgetting) = {said} over {pts.height} points, one run."
        else:
            text += (f" {run[0]}: {pts.height} points with both, too few for a correlation"
                     f" (from {MIN_POINTS}).")
    return text
