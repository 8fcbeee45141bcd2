"""Rollouts page, trainer↔rollout consistency: the per-token log-prob gap and the weight-sync checks.

Both come from ``dynascope.analyses.rollouts`` (``logprob_gap_by_step``, ``weight_sync_checks``), which read
what ``probes.rollout_consistency`` recorded: ``logprob_gap_*`` columns of ``samples``, ``weight_sync/*``
scalars and ``weight_sync_mismatch`` events.
"""

from __future__ import annotations

import plotly.graph_objects as go
import polars as pl
import streamlit as st

from dynascope import analyses
from dynascope.dashboard import charts, data


def section(path: str, runs: tuple[str, ...]) -> None:
    """Log-prob gap per step (mean and max |Δ|, share over the threshold) and what each weight-sync check found."""
    st.subheader("Trainer ↔ rollout consistency")
    gap = data.per_run(analyses.logprob_gap_by_step, path, runs)
    if gap.height == 0:
        st.info("No log-prob gaps recorded: pass the rollout engine's and the trainer's log-probs of the sampled "
                "tokens to `scope.samples(..., **logprob_gap_columns(rollout_lp, trainer_lp, mask))`.")
    else:
        threshold = gap["threshold_nats"].drop_nulls()
        gap = data.downsample(gap, "step", ["logprob_gap_mean_nats", "logprob_gap_max_nats", "logprob_gap_over_pct"],
                              ["run_id"])
        left, right = st.columns(2)
        with left:
            fig = go.Figure()
            for i, ((run,), g) in enumerate(gap.group_by("run_id", maintain_order=True)):
                color = charts.PALETTE[i % len(charts.PALETTE)]
                fig.add_trace(go.Scatter(x=g["step"].to_list(), y=g["logprob_gap_mean_nats"].to_list(), mode="lines",
                                         name=f"mean |Δ| · {run}", line=dict(color=color)))
                fig.add_trace(go.Scatter(x=g["step"].to_list(), y=g["logprob_gap_max_nats"].to_list(), mode="lines",
                                         name=f"max |Δ| · {run}", line=dict(color=color, dash="dot")))
            pos = pl.concat([gap["logprob_gap_mean_nats"], gap["logprob_gap_max_nats"]]).filter(
                pl.concat([gap["logprob_gap_mean_nats"], gap["logprob_gap_max_nats"]]) > 0)
            if pos.len():
                charts.log_axis(fig, pos.min(), pos.max())
            charts.show(charts.place_legend(charts.layout(
                fig, "log-prob gap |log π_rollout − log π_trainer| per token", "step", "nats")), "ro_gap")
        with right:
            what = f"tokens with |Δ| > {threshold[0]:g} nats" if threshold.len() else "tokens over the threshold"
            charts.show(charts.banded(gap, "step", "logprob_gap_over_pct", None, None, ["run_id"], what,
                                      "% of the step's tokens"), "ro_gap_over")
        st.caption("Mean |Δ| is Σ|Δ| / Σ tokens over the step's samples; a gap means the sampled tokens' "
                   "probabilities under the engine that drew them differ from the trainer's, so the policy "
                   "gradient is computed off-policy by that much.")
    _checks(path, runs)


def _checks(path: str, runs: tuple[str, ...]) -> None:
    checks = data.per_run(analyses.weight_sync_checks, path, runs)
    if checks.height == 0:
        st.caption("No weight-sync checks recorded (`verify_weight_sync` after each sync).")
        return
    bad = checks.filter(pl.col("mismatched_tensors_count") > 0)
    n, tensors = checks.height, int(checks["tensors_checked_count"].max() or 0)
    if bad.height == 0:
        st.success(f"Weight sync verified after {n} syncs: every one of {tensors} tensors in the rollout copy equals "
                   "the trainer's weights cast to the rollout dtype.")
        return
    st.error(f"{bad.height} of {n} weight syncs left the rollout copy different from the trainer's weights cast to "
             "its dtype (beyond the cast): the rollout sampled from other weights than the trainer trained.")
    st.dataframe(bad.select("run_id", "step", "mismatched_tensors_count", "message"), hide_index=True,
                 width="stretch", key="ro_sync_mismatch")
