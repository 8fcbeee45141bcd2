"""Cluster page, what-if: the stragglers' per-phase scores and simulation, and the replay of the run's
steps under other RL schedules (``dynascope.analyses``), each computed on demand for large runs."""

from __future__ import annotations

import polars as pl
import streamlit as st

from dynascope import analyses
from dynascope.core.fmt import fmt_ms, significant
from dynascope.dashboard import charts, data
from dynascope.dashboard.queries import ranks as R


def stragglers(path: str, run: str, ranks: pl.DataFrame) -> None:
    """Every rank's busy time against the step's median (the table behind the heat map), then the
    per-phase straggler scores and the what-if simulation of ``dynascope.analyses``."""
    st.subheader("Stragglers")
    if not data.on_demand("stragglers", "Per-phase straggler scores and what-if simulation", path, run):
        return
    # One call, the report's own (findings: what_if by phase): every saving below is the report's figure.
    wif = data.analysis(analyses.what_if, path, run=run, by_phase=True)
    # A toggle, not an expander: an expander's table is sent and drawn even while it is closed.
    if ranks.height and st.toggle(f"Every rank's busy time against the step's median ({ranks.height:,} ranks)",
                                  value=ranks.height <= 16, key="cl_step_table_on"):
        st.caption("vs median: the rank's busy time against each step's median rank (negative: faster); saved: "
                   "the step time saved if the rank ran at the cross-rank median in every phase (the What-if "
                   "table's scenario 'rank N', as the report says it).")
        shown = R.with_rank_costs(ranks, wif).select(
            "role", "rank", "host", "score_pct", "mean_busy_ms", "slowest_share_pct", "steps", "whatif_saved_ms",
            "whatif_saved_pct")
        st.dataframe(shown, hide_index=True, width="stretch", key="cl_step_table", column_config={
            "score_pct": st.column_config.NumberColumn("vs median", format="%+.1f%%"),
            "mean_busy_ms": st.column_config.NumberColumn("busy / step", format="%.1f ms"),
            "slowest_share_pct": st.column_config.NumberColumn("slowest", format="%.0f%%"),
            "steps": st.column_config.NumberColumn("steps compared"),
            "whatif_saved_ms": st.column_config.NumberColumn("saved", format="%.0f ms"),
            "whatif_saved_pct": st.column_config.NumberColumn("saved %", format="%.2f%%")})
    scores = data.analysis(analyses.straggler_scores, path, run=run)
    if data.empty(scores, "phases timed on two or more ranks"):
        return
    # One above the other, each the page's width: side by side, eleven columns ran off the right edge.
    st.caption("Score per rank and phase: baseline (fastest rank) median ÷ this rank's median, per window; "
               "below 0.75 is flagged. Sorted by excess_ms, the time spent beyond the cross-rank median.")
    st.dataframe(scores.select("rank", "phase", "status", "score", "excess_ms", "slowdown_x", "median_ms",
                               "cross_rank_median_ms", "slow_steps_pct", "flagged_windows", "windows"),
                 hide_index=True, width="stretch", key="cl_straggler_table",
                 column_config={c: st.column_config.Column(width="small") for c in (
                     "rank", "score", "excess_ms", "slowdown_x", "median_ms", "slow_steps_pct", "flagged_windows",
                     "windows")})
    if not data.empty(wif, "what-if scenarios"):
        st.caption("What-if: that rank runs every phase (scenario 'rank N') or one phase ('rank N phase') at the "
                   "cross-rank median; step time saved over the steps replayed.")
        st.dataframe(wif.select("scenario", "saved_ms", "saved_pct", "steps", "simulated_base_ms",
                                "reproduction_error_pct"),
                     hide_index=True, width="content", key="cl_what_if")


_SCHEDULES = ["one_step_off_policy", "async", "tail_cut", "partial_rollout", "split", "sync"]


def schedules(path: str, run: str) -> None:
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
    from dynascope.analyses.what_if_schedule import LIMITS  # loaded by the analysis above

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
