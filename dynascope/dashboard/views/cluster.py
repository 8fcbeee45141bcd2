"""Cluster page: per-rank phase timeline, phase breakdown per rank, stragglers with what-if, throughput."""

from __future__ import annotations

import plotly.graph_objects as go
import polars as pl
import streamlit as st

from dynascope import analyses
from dynascope.analyses.findings import MIN_PROBE_PCT, probe_cost_numbers
from dynascope.analyses.findings_text import sentence
from dynascope.analyses.probe_time import probe_cost
from dynascope.analyses.step_shares import phase_shares
from dynascope.core.errors import first_line
from dynascope.core.fmt import fmt_ms, fmt_pct, significant
from dynascope.dashboard import charts, data
from dynascope.dashboard.queries import cluster as Q

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
    span = data.query(Q.timing_span, path, run)
    if span.height == 0 or span["first_step"][0] is None:
        st.info(f"No step timings in {run}.")
        return
    first, last, fine_rows = int(span["first_step"][0]), int(span["last_step"][0]), int(span["fine_rows"][0])
    end = int(span["typical_step"][0]) if span["typical_step"][0] is not None else last
    # The tables below the timeline do not depend on its widgets: start them while the Gantt is drawn.
    data.prefetch(path, queries=[(Q.phase_breakdown, (run,)), (Q.throughput, (run,)), (Q.straggler_table, (run,))],
                  analyses=[(analyses.throughput_mfu,
                             {"run": run, "peak_tflops": st.session_state.get("cl_peak") or None})])
    # One colour per phase for the timeline and the breakdown (the breakdown holds every top-level phase).
    colors = charts.phase_colors(data.query(Q.phase_breakdown, path, run)["phase"].unique().to_list())

    with data.guard("Per-rank timeline"):
        lo, hi = (first, last) if first == last else st.slider(
            "Steps on the timeline", first, last, (max(first, end - 2), end), key="cl_steps")
        fine = st.toggle(f"Kernels, memcpy and CPU ops ({fine_rows:,} rows)", key="cl_fine") if fine_rows else False
        g = data.query(Q.gantt, path, run, lo, hi, fine, GANTT_LIMIT)
        if not data.empty(g, "phase timings in these steps"):
            _gantt(g, run, lo, hi, colors)

    left, right = st.columns(2)
    with left, data.guard("Breakdown per rank"):
        _breakdown(path, run, colors)
        _shares(path, run)
    with right, data.guard("Throughput"):
        tp = data.query(Q.throughput, path, run)
        if not data.empty(tp, "samples with step timings"):
            charts.show(charts.banded(tp, "step", "tok_s", "tok_s_lo", "tok_s_hi", [], "throughput: sample tokens / slowest rank's step",
                                      "tokens / s"), "cl_throughput")
    with data.guard("MFU"):
        _mfu(path, run)
    with data.guard("Stragglers"):
        _stragglers(path, run)
    with data.guard("Schedule what-if"):
        _schedules(path, run)


def _breakdown(path: str, run: str, colors: dict[str, str]) -> None:
    """Mean ms per step of each recurring top-level phase per rank, including the un-instrumented remainder;
    one-off phases and time outside any timed step are listed under it, not averaged into it."""
    bd = data.query(Q.phase_breakdown, path, run)
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
    sh = data.analysis(phase_shares, path, run=run)
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
    cost = data.analysis(probe_cost, path, run=run)
    if cost.height and cost["probe_pct"][0] >= MIN_PROBE_PCT:
        st.caption(f"Probe cost (the phase dynascope), as the report says it: "
                   f"{sentence('probe_cost', probe_cost_numbers(cost.row(0, named=True)))}.")


def _mfu(path: str, run: str) -> None:
    """Tokens/s and MFU per rank and phase; CPU or unknown devices need the peak from the user."""
    peak = st.session_state.get("cl_peak") or None
    try:
        mfu = data.analysis(analyses.throughput_mfu, path, run=run, peak_tflops=peak)
    except ValueError as exc:
        st.info(f"MFU: {first_line(exc)}")
        st.number_input("Peak TFLOP/s per device (for MFU)", min_value=0.0, value=None, key="cl_peak")
        return
    if data.empty(mfu, "phases with token counts"):
        return
    show = mfu.select("role", "rank", "phase", "steps", "tokens", "tokens_per_s", "achieved_tflops", "peak_tflops",
                      "mfu_pct")
    st.dataframe(show, hide_index=True, width="stretch", key="cl_mfu_table")


def _stragglers(path: str, run: str) -> None:
    st.subheader("Stragglers")
    sc = data.query(Q.straggler_table, path, run)
    if data.empty(sc, "steps timed on more than one rank"):
        return
    st.caption("Busy time (phases without waits and collectives) per rank against the per-step median across "
               "ranks; what-if caps the rank at the median and the step waits for the next slowest.")
    st.dataframe(sc, hide_index=True, width="stretch", key="cl_step_table")
    if not data.on_demand("stragglers", "Per-phase straggler scores and what-if simulation", path, run):
        return
    scores = data.analysis(analyses.straggler_scores, path, run=run)
    wif = data.analysis(analyses.what_if, path, run=run)
    if data.empty(scores, "phases timed on two or more ranks"):
        return
    # One above the other, each the page's width: side by side, eleven columns ran off the right edge.
    st.caption("Score per rank and phase: reference (fastest rank) median ÷ this rank's median, per window; "
               "below 0.75 is flagged. Sorted by excess_ms, the time spent beyond the cross-rank median.")
    st.dataframe(scores.select("rank", "phase", "status", "score", "excess_ms", "slowdown_x", "median_ms",
                               "cross_rank_median_ms", "slow_steps_pct", "flagged_windows", "windows"),
                 hide_index=True, width="stretch", key="cl_straggler_table",
                 column_config={c: st.column_config.Column(width="small") for c in (
                     "rank", "score", "excess_ms", "slowdown_x", "median_ms", "slow_steps_pct", "flagged_windows",
                     "windows")})
    if not data.empty(wif, "what-if scenarios"):
        st.caption("What-if: that rank runs every phase at the cross-rank median; step time saved.")
        st.dataframe(wif.select("scenario", "saved_ms", "saved_pct", "simulated_base_ms", "reproduction_error_pct"),
                     hide_index=True, width="content", key="cl_what_if")


def _gantt(g: pl.DataFrame, run: str, lo: int, hi: int, colors: dict[str, str]) -> None:
    """Horizontal bars per rank (base = start), one trace per phase so the legend toggles phases."""
    fig = go.Figure()
    colors = colors | charts.phase_colors([p for p in g["phase"].unique().to_list() if p not in colors])
    for (phase,), p in g.sort("phase").group_by("phase", maintain_order=True):
        fig.add_trace(go.Bar(
            y=[f"rank {r}" for r in p["rank"].to_list()], x=p["dur_ms"].to_list(), base=p["start_ms"].to_list(),
            orientation="h", name=str(phase), marker_color=colors[phase],
            customdata=p.select("step", "category").rows(),
            hovertemplate="%{y}<br>" + str(phase) + " · step %{customdata[0]} (%{customdata[1]})<br>"
                          "start %{base:.1f} ms · %{x:.2f} ms<extra></extra>"))
    ranks = sorted(set(g["rank"].to_list()))
    fig.update_layout(barmode="overlay", yaxis=dict(categoryorder="array",
                                                    categoryarray=[f"rank {r}" for r in reversed(ranks)]))
    fig = charts.layout(fig, f"per-rank timeline · {run} · steps {lo}–{hi}", "ms since window start", "",
                        height=max(260, 60 + 40 * len(ranks), 150 + 24 * len(fig.data)))  # room for the legend
    charts.show(fig, "cl_gantt")
    total = int(g["total"][0])
    if total > g.height:
        st.caption(f"Showing the {g.height:,} longest of {total:,} intervals; narrow the step range for all.")


_SCHEDULES = ["one_step_off_policy", "async", "tail_cut", "partial_rollout", "split", "sync"]


def _schedules(path: str, run: str) -> None:
    """Pick a schedule and its parameters; the replay of the run's measured steps predicts the rest."""
    st.subheader("Schedule what-if")
    if not data.on_demand("schedules", "Replay this run's steps under other RL schedules", path, run):
        return
    c = st.columns(4)
    name = c[0].selectbox("Schedule", _SCHEDULES, key="cl_sched")
    devices = c[1].number_input("Devices the ranks ran on (0: one per rank)", 0.0, value=0.0, step=1.0,
                                format="%g", key="cl_sched_dev")
    background = c[2].number_input("Other runnable processes", 0.0, value=0.0, step=1.0, format="%g",
                                   key="cl_sched_bg")
    tail = c[3].slider("Tail cut percentile", 50, 100, 90, key="cl_sched_tail")
    c = st.columns(4)
    workers = c[0].number_input("Rollout workers", 1, value=2, key="cl_sched_workers")
    staleness = c[1].number_input("Staleness bound", 0, value=1, key="cl_sched_stale")
    policy = c[2].selectbox("Stale batches", ["block", "drop"], key="cl_sched_policy")
    g_r = c[3].number_input("Rollout devices (split; 0: proportional)", 0.0, value=0.0, step=1.0, format="%g",
                            key="cl_sched_gr")
    c = st.columns(4)
    publish = c[0].number_input("Publish ms per version (trainer)", 0.0, value=0.0, step=1.0, format="%g",
                                key="cl_sched_pub")
    load = c[1].number_input("Load ms per version (worker; 0: the measured copy)", 0.0, value=0.0, step=1.0,
                             format="%g", key="cl_sched_load")
    timeslice = c[2].number_input("Time-slice efficiency (oversubscribed devices)", 0.05, 1.0, value=1.0, step=0.05,
                                  format="%g", key="cl_sched_ts")
    params = dict(run=run, devices=devices or None, background=background, workers=int(workers),
                  staleness=int(staleness), staleness_policy=policy, tail_pct=float(tail), publish_ms=float(publish),
                  load_ms=float(load) or None, timeslice_efficiency=float(timeslice))
    if g_r:
        total = devices or g_r + 1
        params.update(rollout_devices=g_r, train_devices=max(total - g_r, 1.0))
    df = data.analysis(analyses.schedule_what_if, path, **params)
    if data.empty(df, "synchronous RL steps (a rollout phase inside the trainer's steps)"):
        return
    row = df.filter(pl.col("schedule") == name)
    if row.is_empty():
        st.info(f"{name} needs at least two devices.")
        return
    from dynascope.analyses.schedules import LIMITS  # loaded by the analysis above

    r = row.row(0, named=True)
    m = st.columns(5)
    m[0].metric("step time", fmt_ms(r["step_ms"]), f"{r['speedup_x']:.2f}× samples/s", delta_color="off")
    m[1].metric("samples / s", f"{r['samples_per_s']:.1f}")
    m[2].metric("idle: trainer / rollout", f"{r['trainer_idle_pct']:.0f}% / {r['rollout_idle_pct']:.0f}%")
    m[3].metric("staleness (mean / max)", f"{r['staleness_mean']:.2f} / {r['staleness_max']}")
    m[4].metric("weight sync exposed", f"{r['weight_sync_exposed_pct']:.1f}%")
    st.caption(f"{r['params']}. Replay of the measured synchronous steps (sync row: "
               f"{df['calibration_error_pct'][0]:.1f}% off the measured step time). Not modelled: "
               f"{LIMITS.removesuffix(' are not modelled')} (docs/schedules.md).")
    # One column per schedule, one row per figure: a row per schedule put most of the figures off the right edge.
    # The parameters, too long for a cell, are said under the table.
    figures = [c for c in df.columns if c not in ("run_id", "schedule", "params")]
    wide = pl.DataFrame({"figure": figures, **{str(row["schedule"]): [_cell(row[c]) for c in figures]
                                                for row in df.iter_rows(named=True)}})
    st.dataframe(wide, hide_index=True, width="stretch", key="cl_sched_table", height=35 * (wide.height + 1) + 3)
    st.caption("Parameters: " + "; ".join(f"{a}: {b}" for a, b in df.select("schedule", "params").iter_rows()) + ".")
    stale = data.analysis(analyses.schedule_staleness, path, **params).filter(pl.col("schedule") == name)
    if stale.height > 1:
        charts.show(charts.bars(stale.with_columns(pl.col("staleness").cast(pl.String)), "staleness", "share_pct",
                                None, f"staleness of trained samples: {name}", "% of samples"), "cl_sched_stale_chart")


def _cell(v: object) -> str:
    """A what-if figure as text (the transposed table mixes numbers and words): four significant digits."""
    if v is None:
        return "—"
    return significant(float(v), 4) if isinstance(v, float) else str(v)
