"""Parameter-dynamics page, where the update lives: each layer's share of ‖ΔW‖² and of bf16-visible changes.

From ``dynascope.analyses.update_share_by_layer`` (formulas in its docstring and docs/dynamics.md); the
layer's share of the parameters is drawn beside them, the share an evenly spread update would give.
"""

from __future__ import annotations

import plotly.graph_objects as go
import polars as pl
import streamlit as st

from dynascope import analyses
from dynascope.dashboard import charts, data

_BARS = {"drift_energy_pct": "‖ΔW‖² (cumulative)", "drift_bf16_changed_pct": "bf16-visible changes (cumulative)",
         "update_energy_pct": "Σ per-step ‖ΔW‖²", "numel_pct": "parameters"}


def section(path: str, run: str, stages: tuple[str, ...]) -> None:
    """Grouped bars per layer for one stage of ``run`` (the last of ``stages``: RL after SFT)."""
    st.subheader("Where the update lives, per layer")
    df = data.analysis(analyses.update_share_by_layer, path, run=run, stage=None)
    if stages:
        df = df.filter(pl.col("stage").is_in(list(stages)))
    if data.empty(df, "per-layer update statistics"):
        return
    # stages in training order (by their last record), so the default is the latest: RL after SFT
    present = df.group_by("stage").agg(pl.col("last_step").max()).sort("last_step", nulls_last=False)["stage"].to_list()
    stage = st.radio("Stage", present, index=len(present) - 1, horizontal=True, key="dyn_layers_stage") \
        if len(present) > 1 else present[0]
    g = df.filter(pl.col("stage") == stage).with_columns(
        pl.when(pl.col("layer").is_null()).then(pl.lit("outside blocks"))
        .otherwise(pl.format("L{}", pl.col("layer"))).alias("layer_name"))
    fig = go.Figure()
    for i, (col, label) in enumerate(_BARS.items()):
        if g[col].drop_nulls().len():
            fig.add_trace(go.Bar(x=g["layer_name"].to_list(), y=g[col].to_list(), name=label,
                                 marker_color="#BAB0AC" if col == "numel_pct" else charts.PALETTE[i]))
    fig.update_layout(barmode="group", bargap=0.2)
    charts.show(charts.place_legend(charts.layout(fig, f"share of the {stage} update per layer · {run}", "layer",
                                                  "% of the whole model")), "dyn_layers")
    top = g.filter(pl.col("drift_energy_pct").is_not_null()).sort("drift_energy_pct", descending=True).head(3)
    if top.height:
        st.caption("Cumulative ΔW = W − θ₀ at the stage's last record. Largest shares of ‖ΔW‖²: " + "; ".join(
            f"{r['layer_name']} {r['drift_energy_pct']:.1f}% ({r['numel_pct']:.1f}% of the parameters)"
            for r in top.iter_rows(named=True)) + ". bf16-visible: the weights whose bf16 cast moved. Zhang et al. "
            "(arXiv 2607.01232) locate RL's gain in a few middle layers by training each layer alone; these shares "
            "say where this run's update went.")
