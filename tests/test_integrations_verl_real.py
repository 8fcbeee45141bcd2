"""verl's own code, installed as ``.ci/run`` installs it (verl 0.9.1, no GPU packages): its ``marked_timer``
times the stages, its ``compute_*_metrics`` build the step's dict from a real ``DataProto``, and its real
``Tracking`` logs it to the dynascope backend that ``register_backend`` adds.

Held against verl's own numbers: each stage verl timed is one ``timings`` row per step whose duration is
verl's, to the microsecond; every numeric key verl produced is a scalar; nothing verl did not time becomes
a span; and ``Tracking.finish()`` leaves every row on disk, with no wait for a periodic flush.
"""

from __future__ import annotations

import numbers
from pathlib import Path

import pytest
import torch

import dynascope
from dynascope.integrations import verl as dverl

verl_tracking = pytest.importorskip("verl.utils.tracking", reason="verl is installed by .ci/run")
from verl import DataProto  # noqa: E402
from verl.trainer.ppo.metric_utils import (  # noqa: E402
    compute_data_metrics,
    compute_throughout_metrics,
    compute_timing_metrics,
)
from verl.utils.debug import marked_timer  # noqa: E402

from helpers.verl_agent_loop import performance_metrics  # noqa: E402

STEPS, BATCH, PROMPT, RESPONSE = 3, 4, 5, 6
AGENT_LOOP = performance_metrics()  # verl's timing_s/agent_loop/* summaries (verl ≥ 0.5), or None


def _batch(step: int) -> DataProto:
    g = torch.Generator().manual_seed(step)
    attention = torch.ones(BATCH, PROMPT + RESPONSE, dtype=torch.long)
    attention[:, PROMPT + 2 + step % 3:] = 0  # responses of 2 + step % 3 tokens
    scores = torch.randn(BATCH, RESPONSE, generator=g)
    batch = DataProto.from_dict({
        "prompts": torch.zeros(BATCH, PROMPT, dtype=torch.long), "responses": torch.zeros(BATCH, RESPONSE, dtype=torch.long),
        "attention_mask": attention, "response_mask": attention[:, PROMPT:],
        "token_level_scores": scores, "token_level_rewards": scores, "advantages": torch.randn(BATCH, RESPONSE, generator=g),
        "returns": torch.randn(BATCH, RESPONSE, generator=g)})
    batch.meta_info["global_token_num"] = attention.sum(-1).tolist()
    return batch


def _work(n: int) -> None:
    """Something for verl's timer to time (no sleeps): a few matrix products."""
    a = torch.randn(64, 64)
    for _ in range(n):
        a = torch.tanh(a @ a)


def test_verl_tracking_and_metrics_land_whole_at_finish(tmp_path: Path) -> None:
    run = tmp_path / "verl"
    tracking_cls = dverl.register_backend(verl_tracking.Tracking, run=run)
    tracking = tracking_cls(project_name="p", experiment_name="e", default_backend=["dynascope"], config={"k": 1})
    timed: list[dict[str, float]] = []
    keys: list[set[str]] = []
    for step in range(1, STEPS + 1):
        timing: dict[str, float] = {}
        with marked_timer("step", timing):
            with marked_timer("gen", timing):
                _work(20)
            with marked_timer("adv", timing):
                _work(5)
            with marked_timer("update_actor", timing):
                _work(30)
        batch = _batch(step)
        raw = dict(timing)
        if AGENT_LOOP is not None:  # the rollout's summaries join verl's timing dict, as RayPPOTrainer.fit merges them
            raw.update(AGENT_LOOP(None, [[{"generate_sequences": 0.01 * (i + step), "tool_calls": 0.0,
                                           "compute_score": 0.002 * i, "num_preempted": 0} for i in range(BATCH)]],
                                  batch))
        metrics = {**compute_data_metrics(batch, use_critic=False), **compute_timing_metrics(batch, raw),
                   **compute_throughout_metrics(batch, raw, n_gpus=1)}
        metrics |= {f"timing_s/{k}": v for k, v in timing.items()}
        tracking.log(data=metrics, step=step)
        timed.append(timing)
        keys.append({k for k, v in metrics.items() if isinstance(v, numbers.Real) and not isinstance(v, bool)})  # numpy too
    tracking.finish()  # verl's own: it knows nothing of dynascope
    with dynascope.open_store(run) as con:
        spans = con.rows("SELECT step, phase, dur_us FROM timings WHERE phase IN "
                         "('step', 'gen', 'adv', 'update_actor') ORDER BY step, phase")
        scalars = con.rows("SELECT step, key FROM scalars")
        others = con.rows("SELECT DISTINCT phase FROM timings WHERE phase NOT IN "
                          "('step', 'gen', 'adv', 'update_actor', 'rollout', 'train', 'advantage')")
    want = sorted((s, p, round(t[p] * 1e6)) for s, t in enumerate(timed, 1) for p in t)
    assert spans == want  # one row per stage per step, verl's durations
    assert {(s, k) for s, k in scalars} == {(s, k) for s, ks in enumerate(keys, 1) for k in ks}
    if AGENT_LOOP is not None:  # durations, counts and token lengths of the agent loop: scalars, never spans
        assert {k for _, k in scalars if k.startswith("timing_s/agent_loop/")} >= {
            "timing_s/agent_loop/generate_sequences/max", "timing_s/agent_loop/slowest/prompt_length"}
    assert others == []  # timing_s/ keys that are not a stage's time (verl's per-token figures) are no span
