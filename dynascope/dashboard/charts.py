"""Plotly figure builders shared by the pages: banded lines, heat maps, bars. Inputs are small frames."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
import polars as pl
import streamlit as st

PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#EECA3B", "#9D755D")


def layout(fig: go.Figure, title: str, xtitle: str = "", ytitle: str = "", height: int = 330) -> go.Figure:
    # Legend above the plot, right-aligned: below it, it collides with the x-axis title on short charts.
    fig.update_layout(title=dict(text=title, y=0.98, yanchor="top"), height=height, margin=dict(l=10, r=10, t=70, b=10),
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0), xaxis_title=xtitle, yaxis_title=ytitle)
    return fig


def show(fig: go.Figure, key: str) -> None:
    st.plotly_chart(fig, width="stretch", key=key, config={"displaylogo": False})


def banded(df: pl.DataFrame, x: str, y: str, lo: str | None, hi: str | None, by: Sequence[str],
           title: str, ytitle: str = "", xtitle: str = "step", log_y: bool = False) -> go.Figure:
    """One line per group of ``by`` with a shaded min–max band (the downsampled bucket's extremes)."""
    fig = go.Figure()
    groups = df.partition_by(list(by), maintain_order=True, as_dict=True) if by else {(): df}
    for i, (key, g) in enumerate(groups.items()):
        name = " · ".join(str(k) for k in key if k not in (None, "")) or y
        color = PALETTE[i % len(PALETTE)]
        xs = g[x].to_list()
        if lo and hi and g[lo].ne(g[hi]).any():
            fig.add_trace(go.Scatter(x=xs + xs[::-1], y=g[hi].to_list() + g[lo].to_list()[::-1], fill="toself",
                                     fillcolor=color, opacity=0.18, line=dict(width=0), hoverinfo="skip",
                                     showlegend=False, name=f"{name} min–max"))
        fig.add_trace(go.Scatter(x=xs, y=g[y].to_list(), mode="lines+markers" if len(xs) < 60 else "lines",
                                 name=name, line=dict(color=color)))
    if log_y:
        fig.update_yaxes(type="log")
    return layout(fig, title, xtitle, ytitle)


def heatmap(df: pl.DataFrame, value: str, title: str, log_z: bool = False) -> go.Figure:
    """Layer × step heat map from long (layer, step, value) rows; layer −1 is labelled 'other'."""
    wide = df.pivot(on="step", index="layer", values=value, aggregate_function="first").sort("layer")
    steps = [c for c in wide.columns if c != "layer"]
    z = wide.select(steps).to_numpy()
    if log_z:
        import numpy as np

        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(z > 0, np.log10(z), np.nan)
    labels = ["other" if v == -1 else f"L{v}" for v in wide["layer"].to_list()]
    fig = go.Figure(go.Heatmap(z=z, x=[int(s) for s in steps], y=labels, colorscale="Viridis",
                               colorbar=dict(title="log10" if log_z else ""),
                               hovertemplate="step %{x}<br>%{y}<br>%{z:.4g}<extra></extra>"))
    return layout(fig, title, "step", "layer", height=300)


def bars(df: pl.DataFrame, x: str, y: str, color: str | None, title: str, ytitle: str = "",
         horizontal: bool = False, stacked: bool = True) -> go.Figure:
    """Grouped or stacked bars, one trace per value of ``color``."""
    fig = go.Figure()
    groups = df.partition_by(color, maintain_order=True, as_dict=True) if color else {(y,): df}
    for i, (key, g) in enumerate(groups.items()):
        xs, ys = g[x].to_list(), g[y].to_list()
        fig.add_trace(go.Bar(x=ys if horizontal else xs, y=xs if horizontal else ys, name=str(key[0]),
                             orientation="h" if horizontal else "v", marker_color=PALETTE[i % len(PALETTE)]))
    fig.update_layout(barmode="stack" if stacked else "group")
    return layout(fig, title, ytitle if horizontal else x, x if horizontal else ytitle)
