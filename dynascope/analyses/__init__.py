"""Analyses: pure functions over a store (a path or an open ``StoreConnection``) → polars DataFrame.

Each analysis lives in a submodule named for its subject; the names below are re-exported here and
imported on first use, so importing ``dynascope.analyses`` stays cheap (some analyses need torch, and a
SQL-only one should not pay for that import): ``from dynascope.analyses import straggler_scores`` works
for every name in a public submodule's ``__all__``. A new public name goes into the three lists below
(``tests/test_analyses_exports.py`` holds them to the submodules' ``__all__``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, for IDEs and type checkers
    from dynascope.analyses.clocks import clock_offsets
    from dynascope.analyses.delta_sync import (
        DTYPE_BYTES,
        delta_sync_bytes,
        delta_sync_summary,
        summarize_delta_sync,
    )
    from dynascope.analyses.dynamics import rank1_dominance, sparsity_comparison, sparsity_over_training
    from dynascope.analyses.dynamics_layers import update_share_by_layer
    from dynascope.analyses.dynamics_rank1 import rank1_linear_fit
    from dynascope.analyses.findings import (
        Finding,
        collect_findings,
        probe_cost_numbers,
        ranked_findings,
        tail_wait_numbers,
    )
    from dynascope.analyses.findings_dynamics import delta_sync_numbers
    from dynascope.analyses.findings_text import INSTABILITY_LABELS, fmt_ms, fmt_pct, sentence
    from dynascope.analyses.fleet import FLEET_COLUMNS, fleet_summary
    from dynascope.analyses.forgetting import FORGETTING_CANDIDATES, forgetting_by_point
    from dynascope.analyses.gap_floor import SELF_PREFIX, logprob_gap_floor_by_step
    from dynascope.analyses.goodput import EVENT_KINDS, goodput_incidents, goodput_summary
    from dynascope.analyses.gpu_timeline import comm_comp_overlap, kernel_type_breakdown, temporal_breakdown
    from dynascope.analyses.instability import detect_instability
    from dynascope.analyses.outliers import cluster_outliers
    from dynascope.analyses.probe_time import DEFAULT_PROBE_COST, PROBE_PHASE, probe_cost
    from dynascope.analyses.rollouts import (
        async_staleness,
        logprob_gap_by_step,
        rollout_long_tail,
        rollout_train_overlap,
        tail_wait_share,
        tail_wait_summary,
        weight_sync_checks,
        zero_variance_groups,
    )
    from dynascope.analyses.slower_ranks import rank_busy
    from dynascope.analyses.step_shares import phase_shares
    from dynascope.analyses.steps import critical_path, idle_time, step_breakdown
    from dynascope.analyses.stragglers import straggler_scores
    from dynascope.analyses.throughput import PEAK_TFLOPS, peak_tflops_for, throughput_mfu
    from dynascope.analyses.what_if_hosts import what_if_node
    from dynascope.analyses.what_if_rank import what_if, what_if_steps
    from dynascope.analyses.what_if_rank_shared import what_if_shared
    from dynascope.analyses.what_if_schedule import rl_throughput, schedule_staleness, schedule_what_if
    from dynascope.analyses.what_if_schedule_inputs import schedule_inputs

# submodule → the public names it gives (what __getattr__ imports on first use)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "clocks": ("clock_offsets",),
    "delta_sync": ("DTYPE_BYTES", "delta_sync_bytes", "delta_sync_summary", "summarize_delta_sync"),
    "dynamics": ("rank1_dominance", "sparsity_comparison", "sparsity_over_training"),
    "dynamics_layers": ("update_share_by_layer",),
    "dynamics_rank1": ("rank1_linear_fit",),
    "fleet": ("FLEET_COLUMNS", "fleet_summary"),
    "forgetting": ("FORGETTING_CANDIDATES", "forgetting_by_point"),
    "gap_floor": ("SELF_PREFIX", "logprob_gap_floor_by_step"),
    "findings": ("Finding", "collect_findings", "probe_cost_numbers", "ranked_findings", "tail_wait_numbers"),
    "findings_dynamics": ("delta_sync_numbers",),
    "findings_text": ("INSTABILITY_LABELS", "fmt_ms", "fmt_pct", "sentence"),
    "goodput": ("EVENT_KINDS", "goodput_incidents", "goodput_summary"),
    "gpu_timeline": ("comm_comp_overlap", "kernel_type_breakdown", "temporal_breakdown"),
    "instability": ("detect_instability",),
    "outliers": ("cluster_outliers",),
    "step_shares": ("phase_shares",),
    "probe_time": ("DEFAULT_PROBE_COST", "PROBE_PHASE", "probe_cost"),
    "slower_ranks": ("rank_busy",),
    "rollouts": ("async_staleness", "logprob_gap_by_step", "rollout_long_tail", "rollout_train_overlap",
                 "tail_wait_share", "tail_wait_summary", "weight_sync_checks", "zero_variance_groups"),
    "steps": ("critical_path", "idle_time", "step_breakdown"),
    "stragglers": ("straggler_scores",),
    "throughput": ("PEAK_TFLOPS", "peak_tflops_for", "throughput_mfu"),
    "what_if_hosts": ("what_if_node",),
    "what_if_rank": ("what_if", "what_if_steps"),
    "what_if_rank_shared": ("what_if_shared",),
    "what_if_schedule": ("rl_throughput", "schedule_staleness", "schedule_what_if"),
    "what_if_schedule_inputs": ("schedule_inputs",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = ["DEFAULT_PROBE_COST", "DTYPE_BYTES", "EVENT_KINDS", "FLEET_COLUMNS", "FORGETTING_CANDIDATES", "Finding", "INSTABILITY_LABELS", "PEAK_TFLOPS",
           "PROBE_PHASE", "SELF_PREFIX", "async_staleness", "clock_offsets", "cluster_outliers", "collect_findings", "comm_comp_overlap", "critical_path",
           "delta_sync_bytes", "delta_sync_numbers", "delta_sync_summary", "detect_instability", "fmt_ms",
           "fmt_pct", "fleet_summary", "forgetting_by_point", "goodput_incidents", "goodput_summary", "idle_time", "kernel_type_breakdown",
           "logprob_gap_by_step", "logprob_gap_floor_by_step", "peak_tflops_for", "phase_shares", "probe_cost", "probe_cost_numbers",
           "rank1_dominance", "rank1_linear_fit", "rank_busy", "ranked_findings", "rl_throughput", "rollout_long_tail",
           "rollout_train_overlap", "schedule_inputs", "schedule_staleness", "schedule_what_if", "sentence",
           "sparsity_comparison", "sparsity_over_training", "step_breakdown", "straggler_scores", "summarize_delta_sync",
           "tail_wait_numbers", "tail_wait_share", "tail_wait_summary", "temporal_breakdown", "throughput_mfu",
           "update_share_by_layer", "weight_sync_checks", "what_if", "what_if_node", "what_if_shared", "what_if_steps",
           "zero_variance_groups"]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"dynascope.analyses has no analysis {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
