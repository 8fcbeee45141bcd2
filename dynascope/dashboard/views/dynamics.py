"""Parameter dynamics: layer × step heat maps, SFT-vs-RL overlay, ΔW spectra, rank-1 fit, gradient health,
KL to the base beside forgetting."""

from __future__ import annotations

import plotly.graph_objects as go
import polars as pl
import streamlit as st

from dynascope import analyses
from dynascope.analyses.delta_sync import summarize_delta_sync
from dynascope.analyses.findings_dynamics import delta_sync_numbers
from dynascope.analyses.findings_text import sentence
from dynascope.core.naming import KINDS
from dynascope.dashboard import charts, data
from dynascope.dashboard.queries import params as P
from dynascope.dashboard.queries.params import HEAT_METRICS
from dynascope.dashboard.views import dynamics_forgetting, dynamics_layers


def page() -> None:
    data.live(_body)


def _body() -> None:
    path, runs = data.current()
    st.header("Parameter dynamics")
    if not runs:
        st.info("Pick one or more runs in the sidebar.")
        return
    # The delta-sync series and the per-layer shares, at the page's foot, each scan tensor_stats once: start
    # them beside the parameter cube (a second core) rather than after the charts above them.
    shown = st.session_state.get("dyn_run") if st.session_state.get("dyn_run") in runs else runs[0]
    data.prefetch(path, queries=[(P.delta_sync_series, (runs,))],
                  analyses=[(analyses.update_share_by_layer, {"run": shown, "stage": None})])
    cubes = {r: data.query(P.param_cube, path, r) for r in runs}
    sk = pl.concat([P.stages_and_kinds(c) for c in cubes.values()])
    if data.empty(sk, "parameter statistics (tensor_stats)"):
        return
    present = set(sk["kind"].drop_nulls().to_list())
    kinds_all = [k for k in KINDS if k in present] + sorted(present - set(KINDS))
    stages_all = list(dict.fromkeys(sk["stage"].to_list()))
    # The kinds get the page's width: in a third of it, a model's seven kinds ran past the box's right edge.
    kinds = tuple(st.multiselect("Module kinds", kinds_all, key="dyn_kinds",
                                 default=data.remembered("dyn_kinds", kinds_all, kinds_all)))
    c2, c3 = st.columns(2)
    stages = tuple(c2.multiselect("Stages (heat maps)", stages_all, key="dyn_stages",
                                   default=data.remembered("dyn_stages", stages_all, stages_all)))
    run = c3.selectbox("Run (heat maps, fit)", runs, key="dyn_run") if len(runs) > 1 else runs[0]
    if not kinds:
        st.info("Pick at least one module kind.")
        return
    # The spectra and the NaN/Inf tensor names are separate scans: start them while the heat maps are drawn.
    nonfinite = {r: P.nonfinite_steps(c, r) for r, c in cubes.items()}
    data.prefetch(path, queries=[(P.spectra_series, (runs, kinds))]
                  + [(P.nonfinite_tensors, (r, _first_steps(nf))) for r, nf in nonfinite.items() if nf.height])

    with data.guard("Layer × step heat maps"):
        # One heat map at a time, the metric picked here: the cube holds all three, so switching re-queries
        # nothing, and each plotly chart costs the browser ~0.1-0.2 s to draw on a 2-core machine.
        left, right = st.columns([4, 1])
        name = left.radio("Heat map", list(HEAT_METRICS), horizontal=True, key="dyn_heat_metric")
        log_z = right.toggle("log color scale", value=True, key="dyn_log")
        hm = P.layer_heatmap(cubes[run], stages, kinds)
        if not data.empty(hm, "tensor statistics for these filters"):
            if hm[name].drop_nulls().len() == 0:
                st.info(f"{name}: not recorded in this run.")
            else:
                charts.show(charts.heatmap(hm, name, f"{name} · {run}", log_z=log_z), "dyn_heat")

    with data.guard("SFT vs RL overlay"):
        ov = pl.concat([P.stage_overlay(c, r, kinds) for r, c in cubes.items()], how="diagonal_relaxed")
        if not data.empty(ov, "per-step updates"):
            left, right = st.columns(2)
            with left:
                charts.show(charts.banded(ov, "step_in_stage", "update_ratio", "update_ratio_lo", "update_ratio_hi", ["run_id", "stage"],
                                          "update ratio by stage", "‖ΔW‖/‖W‖", "steps since stage start",
                                          log_y=True), "dyn_overlay_ratio")
            with right:
                _changed(ov)

    with data.guard("ΔW spectra"):
        _spectra(path, runs, kinds)

    with data.guard("Rank-1 linear fit"):
        _rank1_fit(path, run, kinds)

    with data.guard("Gradient sparsity"):
        _gradients(path, cubes, nonfinite, kinds)

    with data.guard("Where the update lives"):
        dynamics_layers.section(path, run, stages)

    with data.guard("Delta weight sync"):
        _delta_sync(path, runs)

    with data.guard("KL to the base and forgetting"):
        dynamics_forgetting.section(path, runs)


def _changed(ov: pl.DataFrame) -> None:
    """Step-changed fraction per stage, bit-exact (solid) and changed by more than 0.1% of |W| (dotted,
    ``changed_rel_frac``): with fp32 master weights Adam moves nearly every weight each step, and the
    relative threshold separates moves of the weight's own size from rounding-sized ones. The bf16-cast
    comparison (PULSE S₁) is drawn with the delta weight sync it prices (``_delta_sync``)."""
    fig = charts.banded(ov, "step_in_stage", "changed_frac", "changed_frac_lo", "changed_frac_hi", ["run_id", "stage"],
                        "step-changed fraction by stage: bit-exact and > 0.1% of |W|", "fraction of parameters",
                        "steps since stage start")
    has_rel = ov["changed_rel_frac"].drop_nulls().len() > 0
    if has_rel:
        for i, ((run, stage), g) in enumerate(ov.group_by("run_id", "stage", maintain_order=True)):
            xs, ys = charts.gapped(g["step_in_stage"].to_list(), g["changed_rel_frac"].to_list())
            name = " · ".join(str(k) for k in (run, stage) if k not in (None, ""))
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=f"{name} (relative)",
                                     line=dict(dash="dot", color=charts.PALETTE[i % len(charts.PALETTE)])))
    charts.fraction_axis(fig, max(ov["changed_frac_hi"].max() or 0, ov["changed_rel_frac"].max() or 0))
    charts.show(charts.place_legend(fig), "dyn_overlay_changed")
    if has_rel:
        means = ov.group_by("stage", maintain_order=True).agg(pl.col("changed_frac").mean(),
                                                               pl.col("changed_rel_frac").mean())
        st.caption("Dotted: share of parameters changed by > 0.1% of |W| (relative, `changed_rel_frac`). "
                   + "; ".join(f"{s or 'all'}: {c:.1%} bit-exact, {b:.1%} relative"
                               for s, c, b in means.iter_rows() if c is not None and b is not None) + ".")



def _delta_sync(path: str, runs: tuple[str, ...]) -> None:
    """PULSE's bf16 visibility per step (1 − S₁: the share of elements whose bf16 cast changed) and what it
    is worth on the wire: the bytes a delta sync of those elements sends. The caption is the report's own
    sentence from ``delta_sync_summary``, so both give one figure."""
    st.subheader("Changed in bf16 and delta weight sync")
    ds = data.query(P.delta_sync_series, path, runs)
    if data.empty(ds, "per-step bf16 visibility (bf16_unchanged_count)"):
        return
    fig = go.Figure()
    for i, ((run, stage), g) in enumerate(ds.group_by("run_id", "stage", maintain_order=True)):
        name = " · ".join(str(k) for k in (run, stage) if k not in (None, ""))
        color = charts.PALETTE[i % len(charts.PALETTE)]
        fig.add_trace(go.Scatter(x=g["step"].to_list(), y=g["delta_pct"].to_list(), mode="lines",
                                 name=f"{name} delta sync bytes", line=dict(color=color)))
        fig.add_trace(go.Scatter(x=g["step"].to_list(), y=g["changed_pct"].to_list(), mode="lines",
                                 name=f"{name} changed in bf16", line=dict(color=color, dash="dot")))
    charts.show(charts.layout(fig, "changed in bf16 (1 − PULSE S₁, dotted) and delta-sync bytes per step", "step",
                              "% of elements / of full bf16 bytes"), "dyn_delta_sync")
    summary = summarize_delta_sync(ds)  # the series is delta_sync_bytes: the report's summary without a second scan
    st.caption("Elements whose bf16 cast changed in the step (1 − PULSE S₁), sent as value+index (6 B each) or a "
               "bitmap (numel/8 B + 2 B each), whichever is smaller. Per run and stage, as the report says it: "
               + "; ".join(("" if len(runs) == 1 else f"{r['run_id']}: ") + sentence("delta_sync", delta_sync_numbers(r))
                           for r in summary.iter_rows(named=True)) + ".")


def _first_steps(nonfinite: pl.DataFrame) -> tuple[int, ...]:
    """The steps whose tensors the page names (the first 50 with NaN/Inf)."""
    return tuple(nonfinite["step"].head(50).to_list())


def _spectra(path: str, runs: tuple[str, ...], kinds: tuple[str, ...]) -> None:
    """Rank-1 energy (Σσ₁²/Σ‖ΔW‖², the definition of rank1_dominance) and stable rank over steps."""
    sp = data.query(P.spectra_series, path, runs, kinds)
    if data.empty(sp, "spectra of ΔW"):
        return
    left, right = st.columns(2)
    with left:
        fig = charts.banded(sp, "step", "rank1", "rank1_lo", "rank1_hi", ["run_id", "stage"],
                            "rank-1 energy of cumulative ΔW", "σ₁² / ‖ΔW‖²")
        charts.show(charts.fraction_axis(fig, sp["rank1_hi"].max()), "dyn_rank1")
    with right:
        charts.show(charts.banded(sp, "step", "stable_rank", "stable_rank_lo", "stable_rank_hi",
                                  ["run_id", "stage"], "stable rank of cumulative ΔW", "‖ΔW‖² / σ₁²"),
                    "dyn_stable_rank")


# A fit worse than predicting the mean (R² < 0), or whose last-record error is above 100 %, says the rank-1
# direction did not move on a line: its numbers are not an R² or an error worth reading off a bar.
FIT_FAILED_R2 = 0.0
FIT_FAILED_ERROR = 1.0


def _rank1_fit(path: str, run: str, kinds: tuple[str, ...]) -> None:
    """R² and last-record prediction error of the rank-1 linear fit, per layer; failed fits are said so."""
    st.subheader("Rank-1 linear fit")
    if not data.on_demand("rank1_fit", "Fit the rank-1 dynamics (reads u₁, v₁ of every spectra record)", path, run):
        return
    per_tensor = data.analysis(analyses.rank1_linear_fit, path, run=run)
    fit = (per_tensor.filter(pl.col("kind").is_in(kinds)).with_columns(pl.col("layer").fill_null(-1))
           .group_by("layer").agg(pl.col("r2_all").mean().alias("r2"),
                                  pl.col("rel_error_last").mean().alias("pred_rel_err"),
                                  pl.len().alias("tensors")).sort("layer"))
    if data.empty(fit, "ΔW spectra with two or more records per tensor"):
        return
    fit = fit.with_columns(
        pl.when(pl.col("layer") == -1).then(pl.lit("other")).otherwise(pl.format("L{}", pl.col("layer"))).alias("layer_name"),
        ((pl.col("r2") < FIT_FAILED_R2) | (pl.col("pred_rel_err") > FIT_FAILED_ERROR)).fill_null(True).alias("failed"))
    what = ("a line in the step fitted to the first 30 % of σ₁u₁ records (dynascope.analyses.rank1_linear_fit); "
            "error = ‖ΔŴ₁ − σ₁u₁v₁ᵀ‖/σ₁ at the last record")
    failed = fit.filter(pl.col("failed"))
    if failed.height == fit.height:
        st.warning(f"The rank-1 linear fit failed in every layer of {run}: R² from {fit['r2'].min():.2f} to "
                   f"{fit['r2'].max():.2f} (below 0 predicts worse than the mean) and a last-record error of "
                   f"{fit['pred_rel_err'].min():.0%}–{fit['pred_rel_err'].max():.0%}. The rank-1 update did not "
                   "follow a line in the step here, so no extrapolation from it holds.")
        st.dataframe(fit.select("layer_name", "tensors", "r2", "pred_rel_err"), hide_index=True, key="dyn_fit_table",
                     column_config={"layer_name": "layer", "r2": "R²", "pred_rel_err": st.column_config.NumberColumn(
                         "error at last record", format="percent")})
        st.caption(f"Fit: {what}.")
        return
    if failed.height:
        st.warning(f"The fit failed (R² < 0 or error > 100 %) in {', '.join(failed['layer_name'])}: grey bars "
                   "there are not a measure of linearity.")
    ok = fit.filter(~pl.col("failed"))
    colors = [("#BAB0AC" if f else charts.PALETTE[0]) for f in fit["failed"]]
    left, right = st.columns(2)
    with left:
        fig = go.Figure(go.Bar(x=fit["layer_name"].to_list(), y=fit["r2"].clip(lower_bound=0).to_list(),
                               marker_color=colors, text=["fit failed" if f else "" for f in fit["failed"]],
                               customdata=fit["r2"].to_list(), hovertemplate="%{x}: R² %{customdata:.3f}<extra></extra>"))
        fig.update_yaxes(range=[0, 1.0])
        charts.show(charts.layout(fig, f"rank-1 linear fit R² per layer · {run}", "layer", "R² (failed fits at 0)"),
                    "dyn_fit_r2")
    with right:
        fig = go.Figure(go.Bar(x=ok["layer_name"].to_list(), y=(ok["pred_rel_err"] * 100).to_list(),
                               marker_color=charts.PALETTE[1]))
        fig.update_xaxes(categoryorder="array", categoryarray=fit["layer_name"].to_list())
        charts.show(charts.layout(fig, "prediction error at the last record (fitted layers)", "layer",
                                  "relative error %"), "dyn_fit_err")
    st.caption(f"Fit: {what}.")


def _gradients(path: str, cubes: dict[str, pl.DataFrame], nonfinite: dict[str, pl.DataFrame],
               kinds: tuple[str, ...]) -> None:
    gh = pl.concat([P.grad_health(c, r, kinds) for r, c in cubes.items()], how="diagonal_relaxed")
    nf = pl.concat(list(nonfinite.values()), how="diagonal_relaxed")
    if data.empty(gh, "gradient statistics"):
        return
    fig = charts.banded(gh, "step", "grad_zero_frac", "grad_zero_frac_lo", "grad_zero_frac_hi", ["run_id"], "gradient sparsity and NaN/Inf steps",
                        "fraction of gradient entries", label="== 0")
    for i, ((run,), g) in enumerate(gh.group_by("run_id", maintain_order=True)):
        fig.add_trace(go.Scatter(x=g["step"].to_list(), y=g["grad_near_zero_frac"].to_list(), mode="lines",
                                 name=f"near-zero · {run}", line=dict(dash="dot", color=charts.PALETTE[i % 8])))
    charts.place_legend(fig)
    top = max(float(gh["grad_zero_frac_hi"].max() or 0), float(gh["grad_near_zero_frac_hi"].max() or 0))
    charts.fraction_axis(fig, top)
    if nf.height:
        top = fig.layout.yaxis.range[1]  # markers on the top edge of the (possibly zoomed) axis
        fig.add_trace(go.Scatter(
            x=nf["step"].to_list(), y=[top * 0.97] * nf.height, mode="markers", name="NaN/Inf",
            marker=dict(symbol="x", size=12, color="#E45756"),
            text=[f"{r}: {n} NaN, {f} Inf" for r, n, f in nf.select("run_id", "nan", "inf").iter_rows()],
            hovertemplate="step %{x}<br>%{text}<extra></extra>"))
    charts.show(fig, "dyn_grad")
    if nf.height:
        st.caption("Tensors with non-finite weights or gradients (first 50 such steps per run)")
        named = [data.query(P.nonfinite_tensors, path, run, _first_steps(g))
                 .with_columns(pl.lit(run).alias("run_id")) for run, g in nonfinite.items() if g.height]
        st.dataframe(pl.concat(named).select("run_id", "step", "tensor", "nonfinite"), hide_index=True,
                     width="stretch", key="dyn_nonfinite")
