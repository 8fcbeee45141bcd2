"""README's long real-model run section is generated from the committed results file, and its reading of
them holds: the table is exactly ``smollm2_long.py --render --short`` of the file, and each sentence that
compares a figure with a paper is checked against the file's own figures and intervals."""

from __future__ import annotations

import json
from pathlib import Path

from dynascope.demo.reproduction import markdown_table

ROOT = Path(__file__).resolve().parents[1]
DOC = json.loads((ROOT / "benchmarks" / "results" / "smollm2_long.json").read_text())
README = (ROOT / "README.md").read_text()


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
