"""Plotly figure builders shared by the pages: banded lines, heat maps, bars. Inputs are small frames."""

from __future__ import annotations

import math
from collections.abc import Sequence

import plotly.graph_objects as go
import polars as pl
import streamlit as st

PALETTE = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#EECA3B", "#9D755D")

# One colour per phase on every chart of the Cluster page, whatever phases a window happens to hold: a
# colour given by position in the legend changes with the set of phases, and two phases could share it.
PHASE_COLORS = {
    "rollout": "#4C78A8", "reward": "#EECA3B", "ref_logprob": "#A0CBE8", "train": "#2F4B7C", "forward": "#54A24B",
    "backward": "#F58518", "optimizer": "#E45756", "weight_sync": "#B279A2", "eval": "#72B7B2", "checkpoint": "#9D755D",
    "data": "#FF9DA6", "(uninstrumented)": "#BAB0AC",
}
# Phases without a fixed colour take these, in name order, after every fixed colour is spent.
_SPARE = ("#7570B3", "#D95F02", "#E7298A", "#17BECF", "#843C39", "#BCBD22", "#393B79", "#A6761D", "#7B4173",
          "#637939", "#1B9E77", "#8C564B", "#66A61E", "#3182BD", "#E6550D", "#31A354")

# A legend goes above the plot only while it fits on one line beside the title of a half-width chart
# (about this many entries and characters); longer ones go to the right: above, they wrap onto the title.
_TOP_LEGEND_ENTRIES, _TOP_LEGEND_CHARS = 3, 32


def phase_colors(names: Sequence[str], given: dict[str, str] | None = None) -> dict[str, str]:
    """A distinct colour for each phase name: fixed ones for known phases, spare ones for the others; the
    ``given`` colours are kept and not handed out again (a chart showing phases the page had not coloured)."""
    out = dict(given or {})
    out |= {n: PHASE_COLORS[n] for n in names if n in PHASE_COLORS and n not in out}
    spare = [c for c in _SPARE if c not in out.values()] or list(_SPARE)
    for i, n in enumerate(sorted(set(names) - set(out))):
        out[n] = spare[i % len(spare)]
    return out


def layout(fig: go.Figure, title: str, xtitle: str = "", ytitle: str = "", height: int = 330) -> go.Figure:
    """Title, axis titles and a legend that never covers the title: above the plot (right-aligned; below it
    collides with the x-axis title on short charts) for a few entries, on the right for more."""
    fig.update_layout(title=dict(text=title, y=0.98, yanchor="top"), height=height, margin=dict(l=10, r=10, t=70, b=10),
                      xaxis_title=xtitle, yaxis_title=ytitle)
    return place_legend(fig)


def place_legend(fig: go.Figure) -> go.Figure:
    """Put the legend where it fits (see ``layout``); call again after adding traces to a laid-out figure."""
    names = [str(t.name or "") for t in fig.data if t.showlegend is not False]
    if len(names) > _TOP_LEGEND_ENTRIES or sum(len(n) for n in names) > _TOP_LEGEND_CHARS:
        # Beside a right-hand axis the legend starts past that axis's ticks and title, not over them.
        right = fig.layout.to_plotly_json().get("yaxis2", {}).get("side") == "right"
        return fig.update_layout(legend=dict(orientation="v", yanchor="top", y=1.0, xanchor="left",
                                             x=1.12 if right else 1.01))
    return fig.update_layout(legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0))


def fraction_axis(fig: go.Figure, hi: float | None) -> go.Figure:
    """A fraction's y axis from 0: the whole [0, 1] unless every value is below 0.2, then 0 to a round top
    above the data, said in the axis title, so a wiggle of a few thousandths does not read as a swing.
    Call after ``layout`` (it appends to the axis title)."""
    top = float(hi) if hi is not None and math.isfinite(hi) else 1.0
    if top > 0.2:
        fig.update_yaxes(range=[0, 1.0], tickformat=".0%")
        return fig
    step = 10 ** math.floor(math.log10(top * 1.25)) if top > 0 else 0.01
    zoom = math.ceil(top * 1.25 / step) * step
    title = fig.layout.yaxis.title.text or "fraction"
    fig.update_yaxes(range=[0, zoom], tickformat=".2%" if zoom < 0.01 else ".1%",
                     title_text=f"{title}<br>(axis zoomed to 0–{100 * zoom:.3g} %)")
    return fig


def log_axis(fig: go.Figure, lo: float | None, hi: float | None) -> go.Figure:
    """A log y axis labelled only at powers of ten (faint unlabelled grid lines between) once the data spans
    a decade; plotly's default labels 2 and 5 of every decade, which crowds a short chart. Counts read as
    1k/10k, small values as powers of ten."""
    fig.update_yaxes(type="log")
    if lo and hi and lo > 0 and math.floor(math.log10(hi)) - math.ceil(math.log10(lo)) >= 1:
        fig.update_yaxes(dtick=1, minor=dict(dtick="D1", showgrid=True, gridcolor="rgba(0, 0, 0, 0.04)"))
    elif lo and hi and 0 < lo < hi:
        # With fewer than two powers of ten inside the data plotly labels one or none: four ticks spread
        # evenly on the log scale over the data, each written with its magnitude.
        vals = sorted({float(f"{v:.2g}") for v in (lo * (hi / lo) ** (i / 3) for i in range(4))})
        return fig.update_yaxes(tickvals=vals, ticktext=[f"{v:.2g}" for v in vals])
    if lo and lo >= 1:
        fig.update_yaxes(tickformat="~s")
    else:
        fig.update_yaxes(exponentformat="power")
    return fig


def gapped(xs: list, ys: list, factor: float = 3.0) -> tuple[list, list]:
    """Insert a break (None) wherever x jumps by more than ``factor`` times its usual spacing, so a line
    does not draw straight across steps where nothing was logged (between stages, before a restart)."""
    if len(xs) < 3:
        return xs, ys
    gaps = sorted(xs[i + 1] - xs[i] for i in range(len(xs) - 1))
    usual = gaps[len(gaps) // 2] or 1
    ox, oy = [xs[0]], [ys[0]]
    for i in range(1, len(xs)):
        if xs[i] - xs[i - 1] > factor * usual:
            ox.append(None)
            oy.append(None)
        ox.append(xs[i])
        oy.append(ys[i])
    return ox, oy


def show(fig: go.Figure, key: str) -> None:
    st.plotly_chart(fig, width="stretch", key=key, config={"displaylogo": False})


def banded(df: pl.DataFrame, x: str, y: str, lo: str | None, hi: str | None, by: Sequence[str],
           title: str, ytitle: str = "", xtitle: str = "step", log_y: bool = False, label: str = "") -> go.Figure:
    """One line per group of ``by`` with a shaded min–max band (the downsampled bucket's extremes); ``label``
    prefixes each line's legend name."""
    fig = go.Figure()
    groups = df.partition_by(list(by), maintain_order=True, as_dict=True) if by else {(): df}
    for i, (key, g) in enumerate(groups.items()):
        name = " · ".join([label] * bool(label) + [str(k) for k in key if k not in (None, "")]) or y
        color = PALETTE[i % len(PALETTE)]
        xs = g[x].to_list()
        if lo and hi and g[lo].ne(g[hi]).any():
            fig.add_trace(go.Scatter(x=xs + xs[::-1], y=g[hi].to_list() + g[lo].to_list()[::-1], fill="toself",
                                     fillcolor=color, opacity=0.18, line=dict(width=0), hoverinfo="skip",
                                     showlegend=False, name=f"{name} min–max"))
        lx, ly = gapped(xs, g[y].to_list())
        fig.add_trace(go.Scatter(x=lx, y=ly, mode="lines+markers" if len(xs) < 60 else "lines",
                                 name=name, line=dict(color=color)))
    if log_y:
        vals = df[y].filter(df[y] > 0)
        log_axis(fig, vals.min(), vals.max())
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
         horizontal: bool = False, stacked: bool = True, colors: dict[str, str] | None = None) -> go.Figure:
    """Grouped or stacked bars, one trace per value of ``color`` (coloured by ``colors`` when given)."""
    fig = go.Figure()
    groups = df.partition_by(color, maintain_order=True, as_dict=True) if color else {(y,): df}
    for i, (key, g) in enumerate(groups.items()):
        xs, ys = g[x].to_list(), g[y].to_list()
        fig.add_trace(go.Bar(x=ys if horizontal else xs, y=xs if horizontal else ys, name=str(key[0]),
                             orientation="h" if horizontal else "v",
                             marker_color=(colors or {}).get(str(key[0]), PALETTE[i % len(PALETTE)])))
    fig.update_layout(barmode="stack" if stacked else "group")
    return layout(fig, title, ytitle if horizontal else x, x if horizontal else ytitle)


def deviation_heatmap(cells: pl.DataFrame, title: str, ztitle: str, height: int = 420) -> go.Figure:
    """Row × step heat map of a signed deviation from long (row, order, step, value) cells: red above 0, blue
    below, the colour range symmetric and clipped at the larger of the 90th percentile of |value| and the
    largest |row median| (at least 1), so a few extreme cells do not wash out the rest. Rows top to bottom in ``order``; a thousand rows read as bands,
    their labels thinned by plotly."""
    import numpy as np

    rows = cells.select("row", "order").unique().sort("order")["row"].to_list()
    wide = cells.pivot(on="step", index="row", values="value", aggregate_function="first", sort_columns=True)
    wide = pl.DataFrame({"row": rows}).join(wide, on="row", how="left", maintain_order="left")
    steps = [c for c in wide.columns if c != "row"]
    z = wide.select(steps).to_numpy().astype(np.float32)
    finite = np.abs(z[np.isfinite(z)])
    # A robust range: the 90th percentile of |cell|, or the largest |row median| when that is more, so a
    # row that is slow throughout reaches the scale's end (a clearly red row) and a few single-cell
    # outliers, however extreme, do not set the range and wash every other cell out.
    with np.errstate(all="ignore"):
        rows_med = np.abs(np.nanmedian(np.where(np.isfinite(z), z, np.nan), axis=1)) if z.size else np.array([])
    rows_med = rows_med[np.isfinite(rows_med)]
    top = max(1.0, float(np.quantile(finite, 0.9)) if finite.size else 1.0,
              float(rows_med.max()) if rows_med.size else 1.0)
    fig = go.Figure(go.Heatmap(z=z, x=[int(s) for s in steps], y=rows, zmid=0, zmin=-top, zmax=top,
                               colorscale="RdBu_r", colorbar=dict(title=ztitle, ticksuffix="%"),
                               hovertemplate="%{y}<br>step %{x}<br>%{z:+.1f}%<extra></extra>"))
    fig.update_yaxes(autorange="reversed", type="category")
    return layout(fig, title, "step", "", height=height)


def deviation_strip(df: pl.DataFrame, x: str, group: str, label: str, title: str, xtitle: str,
                    named: Sequence[str] = ()) -> go.Figure:
    """The distribution of one value per item (a rank), one horizontal box per ``group`` with every item a
    jittered point (hover names it by ``label``); the items whose ``label`` is in ``named`` are labelled on
    the chart, their labels stacked one above the other so that close points' names never overlap."""
    fig = go.Figure()
    for i, ((g,), part) in enumerate(df.group_by(group, maintain_order=True)):
        fig.add_trace(go.Box(x=part[x].to_list(), name=str(g), boxpoints="all", jitter=0.6, pointpos=0,
                             orientation="h", marker=dict(size=4, opacity=0.6), line=dict(width=1),
                             fillcolor="rgba(0,0,0,0)", marker_color=PALETTE[i % len(PALETTE)],
                             text=part[label].to_list(), hovertemplate="%{text}: %{x:+.2f}%<extra></extra>",
                             showlegend=False))
    shown = df.filter(pl.col(label).is_in(list(named))).sort(x, descending=True)
    for j, row in enumerate(shown.iter_rows(named=True)):
        fig.add_annotation(x=row[x], y=str(row[group]), text=str(row[label]), showarrow=True, arrowhead=2,
                           ax=0, ay=-28 - 18 * j, font=dict(size=11), bgcolor="rgba(255,255,255,0.85)")
    fig.add_vline(x=0, line=dict(color="#888", width=1, dash="dot"))
    return layout(fig, title, xtitle, "", height=max(220, 130 + 70 * df[group].n_unique()))
