"""The multi-seed render on planted results files: each seed's figure with its own interval, the mean with a t
interval over seeds, each verdict counted per seed, and Spearman's ρ of forgetting with each candidate."""

from __future__ import annotations

import math

import pytest

from dynascope.demo.reproduction_seeds import (
    correlation_table,
    forgetting_correlations,
    points_table,
    seeds_table,
    spearman,
    verdicts,
)


def _iv(v: float, lo: float, hi: float) -> dict[str, float]:
    return {"value": v, "ci_low": lo, "ci_high": hi}


def _doc(seed: int, pulse: float, alpha_hi: float, kl: list[float], forget: list[float], drift: list[float]) -> dict:
    labels = ["sft", "rl@2", "rl"]
    return {"regime": {"seed": seed}, "rl_steps": 4, "held_out_n": 8, "rl_steps_evaluated": [2, 4],
            "pulse_s1": _iv(pulse, pulse - 0.001, pulse + 0.001), "mukherjee_rl": {"value": 0.9},
            "recovery": {"alpharl_rank1": _iv(0.8, 0.6, alpha_hi)},
            "minus_final": {"relex15": _iv(-0.1, -0.2, -0.05), "relex25": _iv(-0.1, -0.2, 0.01)},
            "forward_kl_nats": {lab: {"pretrained": {"value": k}} for lab, k in zip(labels, kl, strict=True)},
            "gap_floor": {"excess_mean_nats": _iv(0.05, 0.04, 0.06), "self_mean_nats": _iv(1e-6, 0.0, 2e-6)},
            "forgetting_points": [{"rl_step": 2 * (i + 1), "forgetting_nats": f, "forward_kl_nats": f * 10,
                                   "drift_norm": d, "drift_ratio": None, "mukherjee_changed_share": 0.05,
                                   "rank1_energy": 0.1 * (i + 1)} for i, (f, d) in enumerate(zip(forget, drift, strict=True))]}


DOCS = [_doc(0, 0.995, 0.95, [1.0, 2.0, 3.0], [0.01, 0.02], [0.5, 0.4]),
        _doc(1, 0.997, 0.995, [1.0, 2.5, 2.4], [0.03, 0.04], [0.6, 0.7]),
        _doc(2, 0.999, 0.9, [1.0, 1.1, 1.2], [0.005, 0.05], [0.3, 0.2])]


def test_spearman_ranks_ties_and_constants():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties get their average rank: ranks x (0.5, 0.5, 2, 3), y (0, 1, 2, 3) → Pearson of the ranks
    assert spearman([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833, abs=1e-6)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_each_seed_beside_the_mean_with_a_t_interval_over_seeds():
    table = seeds_table(DOCS)
    row = next(r for r in table.splitlines() if r.startswith("| PULSE"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "99.50% [99.40%, 99.60%]" and cells[3] == "99.90% [99.80%, 100.00%]"
    # mean 0.997, s = 0.002, t(2) = 4.303: ± 4.303 · 0.002 / √3 = 0.00497
    assert cells[4] == "99.70% [99.20%, 100.20%]"
    assert "mean of 3 seeds [95% t interval over seeds]" in table
    floor = "1.00 [0.00, 2.00]"  # in 10⁻⁶ nats; the measure's own "|" escaped, so the row keeps its columns
    assert (f"| Trainer↔trainer floor: mean \\|Δ\\| per token, 10⁻⁶ nats | {floor} | {floor} | {floor} | 1.00 [1.00, 1.00] |"
            in table)


def test_verdicts_are_counted_at_every_seed():
    held = verdicts(DOCS)
    assert held["pulse"] == [True, True, True]
    assert held["alpharl_short"] == [True, False, True]  # seed 1's interval reaches 99.5%
    assert held["relex_short"] == [False, False, False]  # relex25's interval reaches above 0
    assert held["kl_rises"] == [True, False, True]       # seed 1 fell from rl@2 to the end
    assert held["gap_above_floor"] == [True, True, True]
    table = seeds_table(DOCS)
    assert "| PULSE: ≥99% of bf16 weights unchanged per step | yes | yes | yes | 3 of 3 seeds |" in table
    assert "| KL to the pretrained model rose at every evaluation point | yes | no | yes | 2 of 3 seeds |" in table


def test_the_readme_sentence_says_at_how_many_seeds_each_verdict_holds():
    from dynascope.demo.reproduction_seeds_text import verdict_sentence

    text = verdict_sentence(DOCS)
    assert text.startswith("Across 3 seeds: PULSE's ≥99% bf16 invisibility per step holds at every seed; ")
    assert "AlphaRL's rank-1 replacement stays below 99% of RL's gain (interval below 99%) at 2 of 3 seeds;" in text
    assert "RELEX's extrapolations fall short of the final model (both intervals below 0) at no seed;" in text


def test_correlations_pool_points_over_seeds_and_report_each_seed():
    rows = {r["candidate"]: r for r in forgetting_correlations(DOCS)}
    assert rows["forward_kl_nats"]["value"] == pytest.approx(1.0) and rows["forward_kl_nats"]["points"] == 6
    assert rows["forward_kl_nats"]["per_seed"] == {0: None, 1: None, 2: None}  # two points a seed: no ρ
    forget = [0.01, 0.02, 0.03, 0.04, 0.005, 0.05]
    drift = [0.5, 0.4, 0.6, 0.7, 0.3, 0.2]
    assert rows["drift_norm"]["value"] == pytest.approx(spearman(drift, forget))
    assert rows["drift_norm"]["ci_low"] <= rows["drift_norm"]["value"] <= rows["drift_norm"]["ci_high"]
    assert rows["drift_ratio"]["points"] == 0 and rows["drift_ratio"]["value"] is None  # never recorded: no ρ
    assert math.isnan(spearman([0.05] * 6, forget)) and rows["mukherjee_changed_share"]["value"] is None
    # across seeds at the same step: step 2 ranks drift (0.5, 0.6, 0.3) as forgetting (0.01, 0.03, 0.005): ρ = 1;
    # step 4: drift (0.4, 0.7, 0.2) against (0.02, 0.04, 0.05): ρ = −0.5; their mean 0.25
    assert rows["drift_norm"]["within_step"] == pytest.approx(0.25)
    assert rows["forward_kl_nats"]["within_step"] == pytest.approx(1.0)
    assert rows["rl_step"]["within_step"] is None  # the clock cannot rank seeds at one step
    assert rows["rl_step"]["value"] == pytest.approx(spearman([2, 4, 2, 4, 2, 4], forget))
    table = correlation_table(DOCS)
    assert "| KL(π_SFT‖π) on the training task | 6 | +1.00 [" in table
    assert "| RL steps taken (the clock) | 6 |" in table
    assert points_table(DOCS).count("\n") == 2 + 6


def test_a_seed_without_a_figure_is_not_counted_as_failing_it(tmp_path):
    import json

    from dynascope.demo.reproduction_seeds import load_seed_files, render

    partial = {k: v for k, v in _doc(3, 0.995, 0.9, [1, 2, 3], [0.01, 0.02], [0.1, 0.2]).items() if k != "recovery"}
    docs = [*DOCS, partial]
    assert verdicts(docs)["alpharl_short"] == [True, False, True, None]
    assert ("| AlphaRL's >99% recovery not reached (interval below 99%) | yes | no | yes | — | 2 of 3 seeds "
            "(1 without the figure) |") in seeds_table(docs)
    for i, d in enumerate(reversed(docs)):  # files in any order come back by seed
        (tmp_path / f"seed{3 - i}.json").write_text(json.dumps({**d, "command": f"run {3 - i}", "wall_s": 600}))
    loaded = load_seed_files(tmp_path)
    assert [d["regime"]["seed"] for d in loaded] == [0, 1, 2, 3]
    assert render(loaded).startswith("4 seeds (0, 1, 2, 3), 4 RL steps, 8 held-out problems each. Commands: `run 0` (10 min);")


def test_the_forgetting_sentence_counts_seeds_and_quotes_each_pooled_rho():
    from dynascope.demo.reproduction_seeds_text import forgetting_sentence

    docs = [{**d, "forgetting_nats": {"sft": {"rl": _iv(f, f - 0.01, f + 0.01)}}} for d, f in zip(DOCS, [0.02, -0.01, 0.005], strict=True)]
    text = forgetting_sentence(docs)
    assert "rose at 2 of 3 seeds, its interval above 0 at 1." in text
    assert "Spearman's ρ with forgetting is +1.00 [+1.00, +1.00] for the KL to the SFT base" in text
    everywhere = [{**d, "forgetting_nats": {"sft": {"rl": _iv(0.02, 0.01, 0.03)}}} for d in DOCS]
    assert "rose at every seed, its interval above 0 at 3." in forgetting_sentence(everywhere)
