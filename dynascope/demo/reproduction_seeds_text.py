"""README's reading of the multi-seed results, generated from them so that it says what they decide: at how
many seeds each paper verdict holds, and the figures on forgetting with their intervals."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dynascope.demo.reproduction_seeds import forgetting_correlations, rho_text, verdicts

__all__ = ["PHRASES", "forgetting_sentence", "verdict_sentence"]

# how README reads each verdict: "<phrase> at every seed / at k of n seeds / at no seed"
PHRASES = {"pulse": "PULSE's ≥99% bf16 invisibility per step holds",
           "mukherjee": "Mukherjee et al.'s 70–95% RL update sparsity holds",
           "alpharl_short": "AlphaRL's rank-1 replacement stays below 99% of RL's gain (interval below 99%)",
           "relex_short": "RELEX's extrapolations fall short of the final model (both intervals below 0)",
           "kl_rises": "the forward KL to the pretrained model rises at every evaluation point",
           "gap_above_floor": "the trainer↔rollout gap exceeds the trainer's own floor (interval above 0)"}


def verdict_sentence(docs: Sequence[dict[str, Any]]) -> str:
    """One sentence naming, for each verdict, whether it holds at every seed (README's reading)."""
    n = len(docs)
    parts = []
    for key, held in verdicts(docs).items():
        measured = [h for h in held if h is not None]
        k = sum(measured)
        where = ("at every seed" if k == n else "at no seed" if k == 0 and len(measured) == n
                 else f"at {k} of {n} seeds")
        parts.append(f"{PHRASES[key]} {where}" + (f" ({n - len(measured)} without the figure)" if len(measured) < n else ""))
    return f"Across {n} seeds: " + "; ".join(parts) + "."


def forgetting_sentence(docs: Sequence[dict[str, Any]]) -> str:
    """README's figures on forgetting: at how many seeds it rose over RL, and each candidate's pooled ρ."""
    rise = [d.get("forgetting_nats", {}).get("sft", {}).get("rl") for d in docs]
    up = sum(1 for r in rise if r and r.get("value") is not None and r["value"] > 0)
    sure = sum(1 for r in rise if r and r.get("ci_low") is not None and r["ci_low"] > 0)
    rho = {r["candidate"]: r for r in forgetting_correlations(docs)}

    def pooled(key: str) -> str:
        r = rho[key]
        return rho_text(r["value"]) + (f" [{rho_text(r['ci_low'])}, {rho_text(r['ci_high'])}]" if r.get("ci_low") is not None else "")

    kl = rho["forward_kl_nats"]
    within = rho_text(kl["within_step"]) + (f" [{rho_text(kl['within_step_ci'][0])}, {rho_text(kl['within_step_ci'][1])}]"
                                        if kl["within_step_ci"][0] is not None else "")
    where = "every seed" if up == len(docs) else f"{up} of {len(docs)} seeds"
    return (f"Forgetting (the log-loss on held-out Python-docs prose, from the SFT point to the end of RL) rose at "
            f"{where}, its interval above 0 at {sure}. Over every seed's evaluation points, "
            f"Spearman's ρ with forgetting is {pooled('forward_kl_nats')} for the KL to the SFT base on the training "
            f"task, {pooled('drift_norm')} for ‖W − θ₀‖, {pooled('mukherjee_changed_share')} for Mukherjee's changed "
            f"share, {pooled('rank1_energy')} for the rank-1 energy and {pooled('rl_step')} for the number of RL "
            f"steps; across seeds at the same step, the KL's is {within}.")
