"""Every sentence a finding says, in one place: ``sentence(finding, numbers)``.

A sentence is a function of the finding's ``numbers`` only, so what the report says is exactly what its
numbers (and its SQL, see ``findings``) show.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any

from dynascope.core.fmt import fmt_ms, fmt_pct

__all__ = ["INSTABILITY_LABELS", "fmt_ms", "fmt_pct", "sentence"]

N = dict[str, Any]


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:5])) + (f" and {len(steps) - 5} more" if len(steps) > 5 else "")


class _Formatter(string.Formatter):
    """``{x!t}`` formats milliseconds with ``fmt_ms``, ``{x!p}`` a percentage with ``fmt_pct``."""

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion == "t":
            return fmt_ms(value)
        if conversion == "p":
            return fmt_pct(value)
        return super().convert_field(value, conversion)


_fmt = _Formatter().format


def _straggler(n: N) -> str:
    role = f" ({n['role']})" if n["role"] else ""
    what = f"its {n['whatif_phase']}"  # the phase the what-if replaced (a nested phase's top-level parent)
    cut = (_fmt("; making {what} median would cut step time {saved_pct!p} ({saved_ms!t} over {whatif_steps} steps)",
                what=what, **n) if n["saved_pct"] is not None
           else _fmt("; {excess_ms!t} beyond the cross-rank median over the run", **n))
    if n.get("rank_saved_pct") is not None:  # the whole rank, as the dashboard's tables price it
        cut += _fmt("; the whole rank at the median, {rank_saved_pct!p} ({rank_saved_ms!t})", **n)
    if "median_slowdown_x" in n:  # judged against the healthy ranks' spread (cluster_outliers)
        how = ("{median_slowdown_x:.2f}× the cross-rank median over the run" if n["status"] == "persistent" else
               "over the healthy spread in {slow_steps} of {steps} steps")
        return _fmt("rank {rank}{role_} is slower in {phase}: " + how + " (healthy ranks within "
                    "{healthy_x:.2f}×; {status} straggler)", role_=role, **n) + cut
    return _fmt("rank {rank}{role_} is {slowdown_x:.2f}× slower in {phase} than the fastest rank in "
                "{slow_steps_pct:.0f}% of steps ({status} straggler, score {score:.2f})", role_=role, **n) + cut


def _rank_cost(n: N) -> str:
    worst = _fmt("; most of it in {worst_phase} ({worst_phase_saved_pct!p})", **n) if n["worst_phase"] else ""
    return _fmt("rank {rank} costs {saved_pct!p} of step time: at the cross-rank median in every phase it would "
                "save {saved_ms!t} over {steps} steps", **n) + worst


def _rollout_tail(n: N) -> str:
    where = "RL step time" if n["step_source"] == "step_rows" else "rollout time"
    return _fmt("{tail_wait_pct!p} of {where} is tail wait after the median rollout finished ({median_tail_wait_ms!t} "
                "per step at the median, {tail_wait_ms!t} in all)", where=where, **n)


def _zero_variance(n: N) -> str:
    cost = _fmt(" (~{wasted_rollout_ms!t} of rollout time)", **n) if n["wasted_rollout_ms"] else ""
    return _fmt("{zero_variance_pct!p} of GRPO groups ({zero_variance_groups} of {groups}) had zero reward variance: "
                "their {wasted_samples} rollouts carried no learning signal", **n) + cost


def _async_overlap(n: N) -> str:
    sync = _fmt("; weight sync took {weight_sync_ms!t} over {weight_syncs} syncs", **n) if n["weight_syncs"] else ""
    return _fmt("rollout and training overlapped {overlap_pct!p} of wall time ({overlap_ms!t}); {alone_ms!t} of the "
                "shorter side ran alone", **n) + sync


def _goodput(n: N) -> str:
    parts = []
    ckpt = n["checkpoint_save_ms"] + n["checkpoint_load_ms"]
    if ckpt:
        parts.append(_fmt("checkpointing took {share:.1f}% of wall time ({checkpoint_saves} saves, {checkpoint_loads} "
                          "loads, {ckpt!t})", share=100 * ckpt / n["wall_ms"], ckpt=ckpt, **n))
    if n["restarts"]:
        parts.append(_fmt("{restarts} restart(s) lost {lost_work_ms!t} of work since the last checkpoint plus "
                          "{downtime_ms!t} down", **n))
    return "; ".join(parts) + _fmt("; goodput {goodput_pct:.0f}%", **n)


INSTABILITY_LABELS = {"grad_norm_spike": "grad-norm spikes", "loss_spike": "loss spikes",
                      "entropy_collapse": "entropy collapse", "nan_inf": "NaN/Inf values"}


def _instability(label: str) -> Callable[[N], str]:
    def say(n: N) -> str:
        ranks = n.get("ranks") or []
        on = f" on ranks {', '.join(map(str, ranks))}" if len(ranks) > 1 else ""
        return f"{label} at step {_steps(n['steps'])}{on}: {n['message']}"

    return say


def _kl_to_base(n: N) -> str:
    pre = (_fmt(" (KL to the pretrained model {kl_sft_nats:.3g} → {kl_final_nats:.3g})", **n)
           if n["kl_sft_nats"] is not None and n["kl_final_nats"] is not None else "")
    moved = [_fmt("‖ΔW‖/‖W‖ = {drift_ratio:.2e}", **n)] if n["drift_ratio"] is not None else []
    if n["bf16_changed_pct"] is not None:
        moved.insert(0, _fmt("its bf16 weights changed on {bf16_changed_pct:.2f}% of elements", **n))
    weights = f" while {', '.join(moved)}" if moved else ""
    forgot = (_fmt("; forgetting over the same steps (log-loss on held-out prose) {forgetting_nats:+.3g} nats per token",
                   **n) if n.get("forgetting_nats") is not None else "")
    return (_fmt("over {steps} RL steps the policy moved KL(π_SFT‖π) = {kl_rl_base_nats:.3g} nats per held-out "
                 "prompt", **n) + pre + weights + forgot
            + "; RL's Razor ties forgetting to this KL, not to the weight change")


def _idle(n: N) -> str:
    text = "ranks spend {idle_pct!p} of step time waiting for peers in collectives and barriers"
    if n.get("waited_for_rank") is not None:  # the cause: the rank the others' wait is charged to
        role = f" ({n['waited_for_role']})" if n.get("waited_for_role") else ""
        host = f" on {n['waited_for_host']}" if n.get("waited_for_host") else ""
        text += (", most often for rank {waited_for_rank}" + role + host + ", which arrived last: "
                 "{waited_for_pct!p} of step time waiting for it, most in {waited_for_phase}")
    return _fmt(text, **n)


def _template(text: str) -> Callable[[N], str]:
    return lambda n: _fmt(text, **n)


# What one step changes, by the run's regime (``findings_dynamics``): with fp32 master weights the bf16
# measure leads and the bit-exact share follows; otherwise the bit-exact share in the stored dtype.
_UPDATE_SPARSITY = {
    "bf16": _template("changed in bf16 (1 − PULSE S₁): a {stage_b} step changed {bf16_changed_pct_b:.2f}% of "
                      "parameters vs {bf16_changed_pct_a:.2f}% in {stage_a} (medians of {bf16_steps_b} and "
                      "{bf16_steps_a} steps, each stage's first left out); bit-exact in the stored {dtype} "
                      "weights a {stage_b} step left {step_unchanged_frac_b:.1%} unchanged vs "
                      "{step_unchanged_frac_a:.1%} in {stage_a}"),
    "bit_exact": _template("a {stage_b} step left {step_unchanged_frac_b:.1%} of parameters bit-identical in the "
                           "stored {dtype} weights vs {step_unchanged_frac_a:.1%} in {stage_a}"),
}

SENTENCES: dict[str, Callable[[N], str]] = {
    "straggler": _straggler, "rank_cost": _rank_cost, "rollout_tail": _rollout_tail,
    "zero_variance_groups": _zero_variance, "async_overlap": _async_overlap, "goodput": _goodput,
    **{k: _instability(label) for k, label in INSTABILITY_LABELS.items()},
    "imbalance": _template("ranks are unevenly fast: if every rank ran at the cross-rank median, step time would "
                           "drop {saved_pct!p} ({saved_ms!t})"),
    "idle": _idle,
    "clock_offset": _template("{worst_role} rank {worst_rank}'s wall clock was {offset_ms:+.1f} ms from rank "
                              "{reference_rank}'s (±{uncertainty_ms:.2f} ms, measured at watch() over {ranks} "
                              "ranks): every time it recorded is off by as much; the Perfetto export aligns it"),
    "gpu_idle": _template("the GPUs sat idle {mean_idle_pct:.1f}% of their busy span on average over {ranks} "
                          "ranks (rank {worst_rank}: {worst_rank_idle_pct:.1f}%), {idle_ms!t} idle in all: "
                          "work the host did not launch in time, or waits on other ranks"),
    "slow_node": _template("node {host}: its {ranks_count} {role} ranks are {min_slowdown_pct:.0f}–"
                           "{max_slowdown_pct:.0f}% slower in {phases} than the cross-rank median; at the median "
                           "they would cut step time {saved_pct!p} ({saved_ms!t} over {steps} steps)"),
    "uninstrumented": _template("{uninstrumented_pct:.0f}% of step time is outside every instrumented phase (data "
                                "loading, host work, logging?)"),
    "probe_cost": _template("the probe's own work on the training thread took {probe_pct!p} of step time "
                            "({probe_ms!t} over {steps} steps): this run computed the update statistics for "
                            "{coverage_pct!p} of the tensors at each of {recorded_steps} recorded steps; watch()'s "
                            "defaults (a rotating window under a 1% time budget) cost {default_cost}"),
    "staleness": _template("samples were on average {mean_staleness:.2f} policy versions stale when trained on "
                           "(max {max_staleness})"),
    "weight_sync": _template("weight sync took {weight_sync_ms!t} over {weight_syncs} syncs"),
    "mfu": _template("{phase} MFU is {mfu_pct:.1f}% of the {peak_tflops:g} TFLOP/s peak ({achieved_tflops:.3g} "
                     "TFLOP/s and {tokens_per_s:.0f} tokens/s per rank)"),
    "rank1_dominance": _template("at step {step} the cumulative update ΔW is {rank1_energy:.0%} rank-1 (σ₁² share "
                                 "of ‖ΔW‖², {tensors} tensors)"),
    "delta_sync": lambda n: _fmt("a bf16 delta weight sync would send {delta_pct:.2f}% of the full bf16 bytes per "
                                 "{stage} step ({encoding}; changed in bf16 (1 − PULSE S₁): {changed_pct:.2f}% of "
                                 "elements; medians of {steps} steps, the stage's first left out)", **n)
    + (_fmt(": {delta_sync_ms!t} instead of {full_bf16_sync_ms!t} at the measured sync bandwidth", **n)
       if n.get("delta_sync_ms") is not None else ""),
    "schedule": _template("replaying this run's measured steps under other schedules, {schedule} ({params}) would "
                          "give {speedup_x:.2f}× the samples/s: {step_ms!t} per step instead of {replayed_step_ms!t} "
                          "synchronous (measured {measured_step_ms!t}, replay off by {calibration_error_pct!p}), "
                          "staleness {staleness_mean:.2f} on average, {truncated_pct!p} of responses cut short; rollout is {rollout_ms!t} and weight sync "
                          "{weight_sync_ms!t} of each step. The model assumes {devices}; {limits}"),
    "weight_sync_mismatch": _template("{mismatched_syncs} of {syncs_checked} weight syncs left the rollout copy "
                                      "different from the trainer's weights cast to its dtype; first at step "
                                      "{first_step}: {message}"),
    "logprob_gap": _template("the rollout engine's log-probs of the sampled tokens differ from the trainer's by "
                             "{median_gap_nats:.2g} nats per token (median of {steps} steps; largest "
                             "{max_gap_nats:.2g}); {median_over_pct:.2f}% of tokens differ by more than "
                             "{threshold_nats:g} nats"),
    "kl_to_base": _kl_to_base,
    "update_sparsity": lambda n: _UPDATE_SPARSITY[n.get("measure", "bit_exact")](n),
}


def sentence(finding: str, numbers: N) -> str:
    """The plain sentence for one finding, from its numbers."""
    return SENTENCES[finding](numbers)
