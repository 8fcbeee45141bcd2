"""README's long real-model run section is generated from the committed results file, and its reading of
them holds: the table is exactly ``smollm2_long.py --render --short`` of the file, and each sentence that
compares a figure with a paper is checked against the file's own figures and intervals. The same for the
seeds: docs/dynamics.md holds exactly ``--render-seeds`` of the committed seed files, and README says at how
many seeds each verdict holds, as those files decide it."""

from __future__ import annotations

import json
import math
from pathlib import Path

from dynascope.demo.reproduction import markdown_table
from dynascope.demo.reproduction_seeds import load_seed_files, render
from dynascope.demo.reproduction_seeds_text import verdict_sentence

ROOT = Path(__file__).resolve().parents[1]
DOC = json.loads((ROOT / "benchmarks" / "results" / "smollm2_long.json").read_text())
README = (ROOT / "README.md").read_text()
DYNAMICS = (ROOT / "docs" / "dynamics.md").read_text()
SEEDS = load_seed_files(ROOT / "benchmarks" / "results" / "smollm2_seeds")


def test_readme_holds_the_rendered_table() -> None:
    assert markdown_table(DOC, notes=False) in README


def test_the_run_is_long_enough_to_decide() -> None:
    assert DOC["rl_steps"] >= 200 and DOC["held_out_n"] >= 200
    assert DOC["regime"]["rl_lr"] <= 1e-6 and DOC["regime"]["rollout_dtype"] == "bfloat16"
    for name in ("pulse_s1", "delta_sync"):  # the per-step figures carry intervals over steps
        f = DOC[name]
        assert f["ci_low"] <= f["value"] <= f["ci_high"], name
    for name, f in DOC["accuracy"].items():  # and the accuracies over problems
        assert f["ci_low"] <= f["value"] <= f["ci_high"], name


def test_readme_reading_matches_the_figures() -> None:
    assert DOC["pulse_s1"]["value"] >= 0.99  # "PULSE's bf16 invisibility ... holds" (≈99%)
    assert 0.70 <= DOC["mukherjee_rl"]["value"] <= 0.95  # "... update sparsity hold" (70–95%)
    alpha = DOC["recovery"]["alpharl_rank1"]
    assert alpha["value"] > 0.5 and alpha["ci_high"] < 0.99  # "recovers most ... not all of it"
    for fit in ("relex15", "relex25"):  # "falls short of the final model (intervals exclude 0)"
        assert DOC["minus_final"][fit]["ci_high"] < 0, fit
    kl = [DOC["forward_kl_nats"][p]["pretrained"]["value"] for p in ("sft", "rl@50", "rl@100", "rl@150", "rl")]
    assert kl == sorted(kl) and len(set(kl)) == len(kl)  # "rose at every evaluation point through RL"
    for sentence in ("falls short of the final model", "rose at every evaluation point through RL",
                     "not all of it"):
        assert sentence in README.replace("\n", " ")


def test_the_seeds_ran_at_one_setting_and_docs_hold_their_render() -> None:
    assert len(SEEDS) >= 3 and len({d["regime"]["seed"] for d in SEEDS}) == len(SEEDS)
    settings = [{k: v for k, v in d["regime"].items() if k != "seed"} for d in SEEDS]
    assert all(s == settings[0] for s in settings) and len({d["rl_steps"] for d in SEEDS}) == 1
    assert render(SEEDS) in DYNAMICS


def test_readme_says_at_how_many_seeds_each_verdict_holds() -> None:
    assert verdict_sentence(SEEDS) in README


def test_readme_reading_of_the_seeds_matches_their_figures() -> None:
    from dynascope.demo.reproduction_seeds import forgetting_correlations
    from dynascope.demo.reproduction_seeds_text import forgetting_sentence

    text = README.replace("\n", " ")
    for d in SEEDS:  # "stays below 10⁻⁶ nats per token with no token outside [0.9, 1.1] at every seed"
        floor = d["gap_floor"]
        assert floor["self_mean_nats"]["value"] < 1e-6 and floor["self_ratio_outside_share"]["value"] == 0
        assert floor["excess_mean_nats"]["ci_low"] > 0
        assert d["mukherjee_rl"]["value"] > 0.95  # "sparsity is still above 95%"
    assert forgetting_sentence(SEEDS) in README
    rho = {r["candidate"]: r for r in forgetting_correlations(SEEDS)}
    kl = rho.pop("forward_kl_nats")
    for r in rho.values():  # "the KL's interval overlaps those of the weight measures and of the step count"
        assert kl["ci_low"] <= r["ci_high"] and r["ci_low"] <= kl["ci_high"], r["candidate"]
    low, high = kl["within_step_ci"]  # "the test that holds the step fixed has too few seeds to decide"
    assert low is None or low <= 0 <= high
    for sentence in ("stays below 10⁻⁶ nats per token with no token outside [0.9, 1.1] at every seed",
                     "the KL's interval overlaps those of the weight measures and of the step count",
                     "the test that holds the step fixed has too few seeds to decide",
                     "support no weight measure as a predictor of forgetting"):
        assert sentence in text, sentence


def test_docs_reading_of_the_seeds_matches_their_figures() -> None:
    from dynascope.demo.reproduction_seeds import verdicts

    text = DYNAMICS.replace("\n", " ")
    held = verdicts(SEEDS)
    assert all(held["pulse"]) and "PULSE's invisibility holds at every seed" in text
    assert not any(held["alpharl_short"]) and not any(held["relex_short"])
    assert "are not shown to fall short at this length" in text
    gains = [d["rl_gain"]["value"] for d in SEEDS]
    sft = [d["accuracy"]["sft"]["value"] for d in SEEDS]
    assert max(gains) < max(sft) - min(sft) and "RL's gain at every seed is smaller than that spread" in text
    for d in SEEDS:
        floor = d["gap_floor"]
        assert floor["self_mean_nats"]["value"] < 5e-7 and floor["self_max_nats"] < 5e-5  # "about 10⁻⁷ ... 2·10⁻⁵"
        assert floor["self_over_share"]["value"] == 0 and floor["rollout_gap_above_floor_share"]["value"] > 0.999
        assert d["forgetting_nats"]["sft"]["rl"]["value"] < 1e-3  # "by a few 10⁻⁴ nats per token"
    rises = [d["forgetting_nats"]["sft"]["rl"]["value"] > 0 for d in SEEDS]
    assert sum(rises) > len(rises) / 2 and "rose over RL at most seeds" in text
    cost = [100 * d["rl_step_s"]["self_check"] / d["rl_step_s"]["step"] for d in SEEDS]
    assert f"{math.floor(min(cost))}–{math.ceil(max(cost))}% of an RL step in these runs" in text
    out = [100 * d["gap_floor"]["rollout_ratio_outside_share"]["value"] for d in SEEDS]
    assert f"{math.floor(min(out))}–{math.ceil(max(out))}% of tokens outside the band" in text
    sft = sum(d["forgetting_nats"]["pretrained"]["sft"]["value"] for d in SEEDS) / len(SEEDS)
    assert sft < 0 and f"SFT had lowered it by about {-sft * 1e3:.1f}·10⁻³" in text
    from dynascope.demo.reproduction_seeds import forgetting_correlations

    rho = {r["candidate"]: r for r in forgetting_correlations(SEEDS)}
    kl = rho.pop("forward_kl_nats")
    assert kl["value"] == max([kl["value"], *(r["value"] for r in rho.values())])  # "the KL's pooled ρ is the highest"
    weights = ("drift_norm", "drift_ratio", "mukherjee_changed_share", "rank1_energy")
    assert all(kl["within_step"] > rho[k]["within_step"] for k in weights)  # "above every weight measure's"
    steps = [d["rl_step_s"]["step"] for d in SEEDS]
    assert f"ran at {math.floor(min(steps))}–{math.ceil(max(steps))} s per step" in text


SEEDS64 = load_seed_files(ROOT / "benchmarks" / "results" / "smollm2_seeds64")


def test_the_64_step_seeds_ran_at_one_setting_and_docs_hold_their_render() -> None:
    assert len(SEEDS64) >= 3 and len({d["regime"]["seed"] for d in SEEDS64}) == len(SEEDS64)
    settings = [{k: v for k, v in d["regime"].items() if k != "seed"} for d in SEEDS64]
    assert all(s == settings[0] for s in settings) and {d["rl_steps"] for d in SEEDS64} == {64}
    assert "<!-- seeds64:begin -->\n\n" + render(SEEDS64) + "\n<!-- seeds64:end -->" in DYNAMICS


def test_the_reading_of_the_64_step_seeds_matches_their_figures() -> None:
    from dynascope.demo.reproduction_seeds import forgetting_correlations, verdicts
    from dynascope.demo.reproduction_seeds_text import forgetting_sentence

    readme, docs = README.replace("\n", " "), DYNAMICS.replace("\n", " ")
    assert verdict_sentence(SEEDS64) in README and forgetting_sentence(SEEDS64) in README
    held = verdicts(SEEDS64)  # "... at one seed of three each", "a different one"
    assert sum(held["alpharl_short"]) == 1 and sum(held["relex_short"]) == 1
    assert held["alpharl_short"] != held["relex_short"]
    assert "at one seed of three each, so at 64 steps neither verdict holds across seeds" in readme
    rises = [d["forgetting_nats"]["sft"]["rl"] for d in SEEDS64]  # "its interval is above 0 at every seed"
    assert all(f["ci_low"] > 0 for f in rises) and "its interval is above 0 at every seed" in docs
    mean24 = sum(d["forgetting_nats"]["sft"]["rl"]["value"] for d in SEEDS) / len(SEEDS)
    mean64 = sum(f["value"] for f in rises) / len(rises)  # "about threefold", "about 1·10⁻³"
    assert 2.5 < mean64 / mean24 < 3.5 and 0.75e-3 < mean64 < 1.25e-3 and "grew about threefold" in docs
    sparsity = [d["mukherjee_rl"]["value"] for d in SEEDS64]  # "still above their 70–95%"
    assert min(sparsity) > 0.95 and "still above their 70–95%" in docs
    rho = {r["candidate"]: r for r in forgetting_correlations(SEEDS64)}
    kl, clock = rho.pop("forward_kl_nats"), rho.pop("rl_step")
    assert clock["value"] > max(r["value"] for r in rho.values()) and clock["value"] > kl["value"]  # "the highest"
    for r in (*rho.values(), clock):  # "its interval overlaps all of theirs"
        assert kl["ci_low"] <= r["ci_high"] and r["ci_low"] <= kl["ci_high"], r["candidate"]
    assert kl["value"] < min(rho[k]["value"] for k in ("drift_norm", "drift_ratio", "mukherjee_changed_share"))
    assert kl["value"] > rho["rank1_energy"]["value"]  # "above the rank-1 energy's"
    assert kl["within_step_ci"][0] <= 0 <= kl["within_step_ci"][1]
    assert "no measure is supported as a predictor of forgetting beyond the step count" in readme
