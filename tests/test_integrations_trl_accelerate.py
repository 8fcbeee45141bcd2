"""TRL's ``GRPOTrainer`` under ``accelerate launch`` with 2 processes (``--multi_gpu`` on a CPU-only machine:
MULTI_CPU through torchrun over gloo), with ``DynascopeCallback`` (worker: ``tests/helpers/grpo_worker.py``).

Each rank records exactly the phases docs/integrations.md lists for a GRPO step, once each (``train``
twice: around the rollout), each inside its parent's span; one ``samples`` row per completion whose
rewards and lengths average to what TRL logged over both ranks; and ``tensor_stats_global`` gives the
‖W‖, ‖ΔW‖ and changed counts of the weights each rank saved around every optimizer step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import dynascope

from helpers.accelerate_launch import accelerate_launch

pytest.importorskip("trl", reason="TRL is installed with the hf extra")
pytest.importorskip("accelerate", reason="accelerate is installed with the hf extra")

WORKER = Path(__file__).parent / "helpers" / "grpo_worker.py"
STEPS, PER_RANK = 3, 4
# (phase, parent) → rows per step per rank: TRL's profiling contexts, the rollout cut out of train
GRPO_STEP = {("step", None): 1, ("train", None): 2, ("rollout", None): 1, ("generate", "rollout"): 1,
             ("reward", "rollout"): 1, ("reward_len", "reward"): 1, ("loss", "train"): 1, ("logprob", "loss"): 1,
             ("forward", "logprob"): 1, ("backward", "train"): 1, ("optimizer", None): 1, ("dynascope", None): 2}
SLACK_US = 500  # start_us is the wall clock, dur_us the monotonic one: a child may overhang by a hair


@pytest.mark.slow
def test_trl_grpo_under_accelerate_launch(tmp_path: Path) -> None:
    run = tmp_path / "grpo"
    out = accelerate_launch(WORKER, str(run), cwd=tmp_path, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dynascope:" not in out.stderr, out.stderr[-3000:]  # no callback or probe warning
    truth = [json.loads((tmp_path / f"grpo.truth{r}.json").read_text()) for r in (0, 1)]
    assert truth[0] == truth[1] and len(truth[0]) == STEPS  # DDP: the same weights on both ranks
    with dynascope.open_store(run) as con:
        rows = con.rows("SELECT rank, step, phase, parent, category, start_us, dur_us FROM timings")
        got = con.frame("SELECT * FROM tensor_stats_global ORDER BY step, tensor").to_dicts()
        runs = con.rows("SELECT DISTINCT world_size, framework FROM runs")
        samples = con.rows("SELECT step, count(*), count(DISTINCT sample_id), avg(reward), avg(response_len), "
                           "bool_and(group_id = sample_id // 4), bool_and(policy_version = step) "
                           "FROM samples GROUP BY step ORDER BY step")
        per_rank = con.rows("SELECT rank, step, count(*) FROM samples GROUP BY ALL ORDER BY ALL")
        logged = dict(((s, k), v) for s, k, v in con.rows(
            "SELECT step, key, value FROM scalars WHERE rank = 0 AND key IN ('reward', 'completions/mean_length')"))
    assert runs == [(2, "trl")]

    counts: dict[tuple, int] = {}
    for rank, step, phase, parent, category, _, _ in rows:
        assert category == ("step" if phase == "step" else "phase")
        counts[(rank, step, phase, parent)] = counts.get((rank, step, phase, parent), 0) + 1
    assert counts == {(r, s, p, parent): n for r in (0, 1) for s in range(STEPS) for (p, parent), n in GRPO_STEP.items()}
    spans: dict[tuple, list[tuple[int, int]]] = {}
    for rank, step, phase, _, _, start, dur in rows:
        spans.setdefault((rank, step, phase), []).append((start, start + dur))
    for rank, step, phase, parent, _, start, dur in rows:
        if parent is not None:  # a child lies inside one of its parent's rows of the same step
            assert any(a - SLACK_US <= start and start + dur <= b + SLACK_US
                       for a, b in spans[(rank, step, parent)]), (rank, step, phase, parent)
        if phase == "rollout":  # cut out of train: no train row overlaps it
            assert all(b <= start + SLACK_US or a >= start + dur - SLACK_US for a, b in spans[(rank, step, "train")])

    # one samples row per completion, numbered across ranks; TRL logs the mean over both ranks' completions
    assert per_rank == [(r, s, PER_RANK) for r in (0, 1) for s in range(STEPS)]
    assert [row[:3] for row in samples] == [(s, 2 * PER_RANK, 2 * PER_RANK) for s in range(STEPS)]
    for step, _, _, reward, length, grouped, versioned in samples:
        assert reward == pytest.approx(logged[(step, "reward")], rel=1e-6)
        assert length == pytest.approx(logged[(step, "completions/mean_length")], rel=1e-6)
        assert grouped and versioned

    names = set(truth[0][0])
    assert {r["tensor"] for r in got} == names and len(got) == STEPS * len(names)
    assert all(r["shards"] == 1 for r in got)  # DDP copies count once
    for r in got:
        w_norm, update_norm, changed = truth[0][r["step"]][r["tensor"]]
        assert r["w_norm"] == pytest.approx(w_norm, rel=1e-6), r["tensor"]
        assert r["update_norm"] == pytest.approx(update_norm, rel=1e-6), r["tensor"]
        assert r["changed_count"] == changed, r["tensor"]
