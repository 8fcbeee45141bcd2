"""Findings on trainer↔rollout consistency and on what RL did to the policy against what it did to the weights.

- ``weight_sync_mismatch``: a weight-sync check (``verify_weight_sync``) found the rollout copy different
  from the trainer's weights cast to its dtype;
- ``logprob_gap``: how far the rollout engine's log-probs of the sampled tokens were from the trainer's;
- ``kl_to_base``: RL's Razor (arXiv 2509.04259) pairs forgetting with the forward KL to the base on the
  task, not with weight change: the held-out KL the run logged beside how far the weights moved.

Each generator returns ``Finding`` objects (``_findings.found``) with their numbers and a query
(``findings_sql``) returning them.
"""

from __future__ import annotations

from typing import Any

from dynascope.analyses import findings_sql as S
from dynascope.analyses._findings import Finding, first_row, found, rnd
from dynascope.analyses.rollouts import logprob_gap_by_step, weight_sync_checks

__all__: list[str] = []  # generators for ``findings.GENERATORS``, not public analyses

WARN_GAP_OVER_PCT = 1.0  # a percent of tokens whose engines disagree by over the threshold biases every step


def weight_sync_mismatch(con: Any, run: str) -> list[Finding]:
    df = weight_sync_checks(con, run)
    bad = df.filter(df["mismatched_tensors_count"] > 0)
    if bad.is_empty():
        return []
    first = bad.row(0, named=True)
    n = {"syncs_checked": df.height, "mismatched_syncs": bad.height, "first_step": first["step"],
         "mismatched_tensors": first["mismatched_tensors_count"], "tensors_checked": first["tensors_checked_count"],
         "message": first["message"]}
    return [found(run, "weight_sync_mismatch", "error", n, S.weight_sync_check_sql(run))]


def logprob_gap(con: Any, run: str) -> list[Finding]:
    df = logprob_gap_by_step(con, run)
    if df.is_empty():
        return []
    over = float(df["logprob_gap_over_pct"].median())
    n = {"steps": df.height, "median_gap_nats": rnd(df["logprob_gap_mean_nats"].median(), 6),
         "max_gap_nats": rnd(df["logprob_gap_max_nats"].max(), 6), "median_over_pct": rnd(over),
         "threshold_nats": rnd(df["threshold_nats"][0])}
    return [found(run, "logprob_gap", "warning" if over >= WARN_GAP_OVER_PCT else "info", n, S.logprob_gap_sql(run))]


def kl_to_base(con: Any, run: str) -> list[Finding]:
    """The held-out forward KL to the bases at the last RL evaluation, beside the weights' change over RL."""
    kl = first_row(con, S.kl_to_base_sql(run))
    if not kl or kl.get("kl_rl_base_nats") is None:
        return []
    n = {k: (None if v is None else float(v)) if k != "steps" else v for k, v in kl.items()}  # small: no rounding
    return [found(run, "kl_to_base", "info", n, S.kl_to_base_sql(run))]
