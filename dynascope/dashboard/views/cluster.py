"""Cluster page: ranks and nodes at any count (heat map, distribution, slowest ranks and nodes), the timeline
and phase breakdown of the ranks picked there, where step time went, throughput and MFU, and the what-if
analyses (``cluster_ranks``, ``cluster_whatif``)."""

from __future__ import annotations

import plotly.graph_objects as go
import polars as pl
import streamlit as st

from dynascope import analyses
from dynascope.analyses.findings import MIN_PROBE_PCT, probe_cost_numbers
from dynascope.analyses.findings_text import sentence
from dynascope.analyses.steps import REMAINDER
from dynascope.core.errors import first_line
from dynascope.core.fmt import fmt_ms, fmt_pct
from dynascope.dashboard import charts, data
from dynascope.dashboard.queries import cluster as Q
from dynascope.dashboard.queries import ranks as R
from dynascope.dashboard.views import cluster_ranks, cluster_whatif

GANTT_LIMIT = 4000


def page() -> None:
    data.live(_body)


def _body() -> None:
    path, runs = data.current()
    st.header("Cluster")
    if not runs:
        st.info("Pick one or more runs in the sidebar.")
        return
    if len(runs) > 1:  # multi-rank runs first: a timeline of one rank says little
        ranks = dict(data.catalog(path).select("run_id", "ranks").iter_rows())
        run = st.selectbox("Run", sorted(runs, key=lambda r: -(ranks.get(r) or 0)), key="cl_run")
    else:
        run = runs[0]
    # What the page reads further down does not depend on its widgets: start it while the first charts draw.
    data.prefetch(path, queries=[(cluster_ranks.rank_frames, (run,)),
                                 (R.rank_hosts, (run, cluster_ranks.run_dir(path, run))), (Q.throughput, (run,))],
                  analyses=[(analyses.phase_shares, {"run": run}), (analyses.probe_cost, {"run": run}),
                            (analyses.throughput_mfu,
                             {"run": run, "peak_tflops": st.session_state.get("cl_peak") or None})])
    span = data.query(Q.timing_span, path, run)
    if span.height == 0 or span["first_step"][0] is None:
        st.info(f"No step timings in {run}.")
        return
    first, last, fine_rows = int(span["first_step"][0]), int(span["last_step"][0]), int(span["fine_rows"][0])
    end = int(span["typical_step"][0]) if span["typical_step"][0] is not None else last
    # One colour per phase on every chart of the page, whichever ranks a chart shows.
    colors = charts.phase_colors([*(span["phases"][0].to_list() if span["phases"][0] is not None else []), REMAINDER])

    ranks = cluster_ranks.section(path, run)

    st.subheader("Timeline")
    picks = tuple(cluster_ranks.timeline_picks(ranks)) if ranks.height else None
    with data.guard("Per-rank timeline"):
        lo, hi = (first, last) if first == last else st.slider(
            "Steps on the timeline", first, last, (max(first, end - 2), end), key="cl_steps")
        fine = st.toggle(f"Kernels, memcpy and CPU ops ({fine_rows:,} rows)", key="cl_fine") if fine_rows else False
        g = data.query(Q.gantt, path, run, lo, hi, fine, GANTT_LIMIT, picks)
        if not data.empty(g, "phase timings of these ranks in these steps"):
            _gantt(g, run, lo, hi, colors)

    left, right = st.columns(2)
    with left, data.guard("Breakdown per rank"):
        _breakdown(path, run, picks, colors)
        _shares(path, run)
    with right, data.guard("Throughput"):
        tp = data.query(Q.throughput, path, run)
        if not data.empty(tp, "samples with step timings"):
            charts.show(charts.banded(tp, "step", "tok_s", "tok_s_lo", "tok_s_hi", [], "throughput: sample tokens / slowest rank's step",
                                      "tokens / s"), "cl_throughput")
    with data.guard("MFU"):
        _mfu(path, run)
    with data.guard("Stragglers"):
        cluster_whatif.stragglers(path, run, ranks)
    with data.guard("Schedule what-if"):
        cluster_whatif.schedules(path, run)


def _breakdown(path: str, run: str, picks: Q.Ranks | None, colors: dict[str, str]) -> None:
    """Mean ms per step of each recurring top-level phase per picked rank, including the un-instrumented
    remainder; one-off phases and time outside any timed step are listed under it, not averaged into it."""
    bd = data.query(Q.phase_breakdown, path, run, picks)
    if data.empty(bd, "top-level phases with step rows"):
        return
    rank = pl.col("rank").cast(pl.String)
    label = pl.col("role") + ":" + rank if bd["role"].n_unique() > 1 else rank
    bd = bd.with_columns(label.alias("rank"))
    per_step = bd.filter(pl.col("ms_per_step").is_not_null())
    fig = charts.bars(per_step, "rank", "ms_per_step", "phase", "mean time per step by phase (recurring phases)",
                      "ms / step", colors=colors)
    charts.show(fig.update_layout(height=max(330, 150 + 22 * per_step["phase"].n_unique())), "cl_breakdown")
    once = bd.filter(pl.col("one_off")).with_columns((pl.col("timed_ms") + pl.col("outside_ms")).alias("ms"),
                                                     pl.lit("once").alias("how"))
    outside = bd.filter(~pl.col("one_off") & (pl.col("outside_ms") > 0)).with_columns(
        pl.col("outside_ms").alias("ms"), pl.lit("outside timed steps").alias("how"))
    apart = [_apart(phase, how, g) for (phase, how), g in pl.concat([once, outside]).group_by(
        "phase", "how", maintain_order=True)]
    if apart:
        st.caption("Not in the per-step means: phases that ran once, and time outside any timed step (before "
                   "the first or after the last optimizer step): " + "; ".join(apart) + ".")


def _apart(phase: str, how: str, g: pl.DataFrame) -> str:
    """One phase kept out of the per-step means, over the ranks that had it: '{phase} 150 s once (step 16,
    rank 0)' or 'eval 582 ms–625 ms per rank outside timed steps (4 ranks)'."""
    step = f"step {g['first_step'].min()}, " if how == "once" else ""
    if g.height == 1:
        return f"{phase} {fmt_ms(g['ms'][0])} {how} ({step}rank {g['rank'][0]})"
    return f"{phase} {fmt_ms(g['ms'].min())}–{fmt_ms(g['ms'].max())} per rank {how} ({step}{g.height} ranks)"


def _shares(path: str, run: str) -> None:
    """Share of step time per phase, per role and stage: ``analyses.phase_shares``, the figures of the
    report's summary and the demo's table, every phase listed so a column adds up to the step time."""
    sh = data.analysis(analyses.phase_shares, path, run=run)
    if sh.is_empty():
        return
    labels = [" · ".join(x for x in (role if sh["role"].n_unique() > 1 else None, stage) if x) + f" ({n} steps)"
              for role, stage, n in sh.select("role", "stage", "steps").iter_rows()]
    sh = sh.with_columns(pl.Series("steps_of", labels))
    wide = (sh.with_columns(pl.Series("share", [fmt_pct(x) for x in sh["share_pct"]]))
            .pivot(on="steps_of", index="phase", values="share", aggregate_function="first").fill_null("—"))
    total = sh.group_by("steps_of", maintain_order=True).agg(pl.col("share_pct").sum())
    wide = pl.concat([wide, pl.DataFrame({"phase": ["all"], **{k: [fmt_pct(v)] for k, v in total.iter_rows()}})])
    st.caption("Where step time went, per role and stage (dynascope.analyses.phase_shares, as the report's "
               "summary): every phase's time summed over ranks, over their step time.")
    st.dataframe(wide, hide_index=True, width="content", key="cl_shares", height=35 * (wide.height + 1) + 3)
    cost = data.analysis(analyses.probe_cost, path, run=run)
    if cost.height and cost["probe_pct"][0] >= MIN_PROBE_PCT:
        st.caption(f"Probe cost (the phase dynascope), as the report says it: "
                   f"{sentence('probe_cost', probe_cost_numbers(cost.row(0, named=True)))}.")


def _mfu(path: str, run: str) -> None:
    """Tokens/s and MFU per rank and phase; CPU or unknown devices need the peak from the user."""
    peak = st.session_state.get("cl_peak") or None
    try:
        mfu = data.analysis(analyses.throughput_mfu, path, run=run, peak_tflops=peak)
    except ValueError as exc:
        # The analysis's message names the CLI's flag; here the page itself asks for the figure.
        why = first_line(exc).split(";")[0]
        st.number_input(f"MFU: {why}. Enter the device's dense peak TFLOP/s to compute it", min_value=0.0,
                        value=None, key="cl_peak")
        return
    if data.empty(mfu, "phases with token counts"):
        return
    show = mfu.select("role", "rank", "phase", "steps", "tokens", "tokens_per_s", "achieved_tflops", "peak_tflops",
                      "mfu_pct")
    st.dataframe(show, hide_index=True, width="stretch", key="cl_mfu_table")


def _gantt(g: pl.DataFrame, run: str, lo: int, hi: int, colors: dict[str, str]) -> None:
    """Horizontal bars per rank (base = start), one trace per phase so the legend toggles phases."""
    fig = go.Figure()
    roles = g["role"].n_unique()
    g = g.with_columns(pl.format("{} {}", pl.col("role"), pl.col("rank")).alias("label") if roles > 1
                       else pl.format("rank {}", pl.col("rank")).alias("label"))
    colors = charts.phase_colors(g["phase"].unique().to_list(), colors)
    for (phase,), p in g.sort("phase").group_by("phase", maintain_order=True):
        fig.add_trace(go.Bar(
            y=p["label"].to_list(), x=p["dur_ms"].to_list(), base=p["start_ms"].to_list(),
            orientation="h", name=str(phase), marker_color=colors[phase],
            customdata=p.select("step", "category").rows(),
            hovertemplate="%{y}<br>" + str(phase) + " · step %{customdata[0]} (%{customdata[1]})<br>"
                          "start %{base:.1f} ms · %{x:.2f} ms<extra></extra>"))
    ranks = g.select("role", "rank", "label").unique().sort(pl.col("role") != "trainer", "role", "rank")["label"]
    fig.update_layout(barmode="overlay", yaxis=dict(categoryorder="array", categoryarray=ranks.to_list()[::-1]))
    fig = charts.layout(fig, f"per-rank timeline · {run} · steps {lo}–{hi}", "ms since window start", "",
                        height=max(260, 60 + 40 * len(ranks), 150 + 24 * len(fig.data)))  # room for the legend
    charts.show(fig, "cl_gantt")
    total = int(g["total"][0])
    if total > g.height:
        st.caption(f"Showing the {g.height:,} longest of {total:,} intervals; narrow the step range for all.")
