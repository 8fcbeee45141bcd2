"""verl metric dicts → timings / scalars / samples, and verl's Tracking backend registry."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import dynascope
from dynascope.integrations import verl

# One step's dict as verl's RayPPOTrainer.fit logs it: compute_data_metrics + compute_timing_metrics +
# compute_throughout_metrics + the actor/critic workers' reduced metrics (keys as in verl's metric_utils.py).
STEP_METRICS = {
    "training/global_step": 3, "training/epoch": 0,
    "critic/score/mean": 0.375, "critic/score/max": 1.0, "critic/score/min": 0.0,
    "critic/rewards/mean": 0.375, "critic/rewards/max": 1.0, "critic/rewards/min": 0.0,
    "critic/advantages/mean": 0.0, "critic/advantages/max": 1.2, "critic/advantages/min": -0.9,
    "critic/returns/mean": 0.0, "critic/returns/max": 1.2, "critic/returns/min": -0.9,
    "response_length/mean": 211.5, "response_length/max": 512.0, "response_length/min": 17.0,
    "response_length/clip_ratio": 0.0625, "response/aborted_ratio": 0.0,
    "prompt_length/mean": 96.0, "prompt_length/max": 128.0, "prompt_length/min": 64.0, "prompt_length/clip_ratio": 0.0,
    "actor/pg_loss": np.float32(-0.012), "actor/pg_clipfrac": 0.004, "actor/ppo_kl": 1.5e-4, "actor/entropy": 0.81,
    "actor/grad_norm": torch.tensor(0.42), "actor/lr": 1e-6, "perf/mfu/actor": 0.31,
    "perf/max_memory_allocated_gb": 61.2, "perf/total_num_tokens": 78336, "perf/time_per_step": 42.0,
    "perf/throughput": 233.1,
    "timing_s/start_profile": 0.001, "timing_s/gen": 20.0, "timing_s/generate_sequences": 19.5,
    "timing_s/generation_timing/max": 19.5, "timing_s/generation_timing/min": 11.25,
    "timing_s/generation_timing/topk_ratio": 0.25,
    # verl 0.9's agent loop: spreads, counts and token lengths under timing_s/, none of them a stage's time
    "timing_s/agent_loop/slowest/prompt_length": 6.0, "timing_s/agent_loop/generate_sequences/max": 3.5,
    "timing_s/agent_loop/num_preempted/mean": 2.0,
    "timing_s/reward": 1.5, "timing_s/old_log_prob": 4.0, "timing_s/ref": 3.5, "timing_s/adv": 0.25,
    "timing_s/update_actor": 12.0, "timing_s/step": 42.0, "timing_s/stop_profile": 0.002,
    "timing_per_token_ms/gen": 0.118, "timing_per_token_ms/update_actor": 0.153,
    "val-core/openai/gsm8k/reward/mean@1": 0.5, "note": "text values are skipped",
}


def _rows(run, sql):
    with dynascope.open_store(run) as con:
        return con.sql(sql).fetchall()


def test_metric_dict_to_store(tmp_path):
    run = tmp_path / "ppo"
    backend = verl.DynascopeTracking(run)
    backend.log(STEP_METRICS, step=3)
    backend.finish()

    timings = {(p, parent): (start, dur, cat, step) for p, parent, start, dur, cat, step in _rows(
        run, "SELECT phase, parent, start_us, dur_us, category, step FROM timings")}
    step_start, step_dur, cat, step = timings[("step", None)]
    assert (step_dur, cat, step) == (42_000_000, "step", 3)
    # verl's name is kept, enclosed by the canonical phase with the same span
    assert timings[("rollout", None)][:2] == timings[("gen", "rollout")][:2] == (step_start, 20_000_000)
    assert timings[("train", None)][1] == timings[("update_actor", "train")][1] == 12_000_000
    assert timings[("ref_logprob", None)][1] == 3_500_000
    # generate_sequences runs inside gen; stages are laid end to end in verl's order
    assert timings[("generate", "gen")][:2] == (step_start, 19_500_000)
    assert timings[("reward", None)][0] == step_start + 20_000_000
    assert timings[("old_logprob", None)][0] == step_start + 21_500_000
    assert timings[("start_profile", None)][0] == step_start - 1_000
    assert timings[("stop_profile", None)][0] == step_start + step_dur
    assert not [k for k in timings if k[0].startswith(("generation_timing", "agent_loop"))]

    scalars = dict(_rows(run, "SELECT key, value FROM scalars WHERE step = 3"))
    assert scalars["perf/mfu/actor"] == pytest.approx(0.31)
    assert scalars["response_length/mean"] == pytest.approx(211.5)
    assert scalars["critic/score/mean"] == pytest.approx(0.375)
    assert scalars["actor/grad_norm"] == pytest.approx(0.42)      # tensors and numpy scalars convert
    assert scalars["actor/pg_loss"] == pytest.approx(-0.012)
    assert scalars["timing_s/generation_timing/min"] == pytest.approx(11.25)
    assert "note" not in scalars
    assert _rows(run, "SELECT DISTINCT role, framework FROM runs") == [("driver", "verl")]


def test_without_step_timer_and_unknown_stage(tmp_path):
    cols = verl.timing_rows({"timing_s/gen": 2.0, "timing_s/my_filter": 0.5}, end_us=10_000_000)
    rows = list(zip(cols["phase"], cols["parent"], cols["start_us"], cols["dur_us"], strict=True))
    # no step row; known stages first, unknown ones after, ending at the log time
    assert ("rollout", None, 7_500_000, 2_000_000) in rows
    assert ("my_filter", None, 9_500_000, 500_000) in rows
    assert "step" not in cols["phase"]


def test_module_log_and_samples(tmp_path):
    run = tmp_path / "m"
    verl.log({"timing_s/step": 1.0, "timing_s/gen": 0.6, "perf/mfu/actor": 0.2}, step=1, run=run)
    verl.log({"timing_s/step": 1.1, "timing_s/gen": 0.7, "perf/mfu/actor": 0.25}, step=2, run=run)
    verl.finish()
    assert _rows(run, "SELECT step, value FROM scalars WHERE key='perf/mfu/actor' ORDER BY step") == [(1, 0.2), (2, 0.25)]
    assert _rows(run, "SELECT count(*) FROM timings WHERE phase='rollout'") == [(2,)]

    # a DataProto after the reward stage: 4 samples of 2 prompts; prompt width 4, response width 4
    attn = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1],
                         [0, 0, 1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0, 0, 0]])
    scores = torch.zeros(4, 4)
    scores[0, 1], scores[1, 3], scores[3, 0] = 1.0, 0.5, 1.0
    batch = types.SimpleNamespace(batch={"responses": torch.zeros(4, 4), "attention_mask": attn,
                                         "token_level_scores": scores},
                                  non_tensor_batch={"uid": np.array(["a", "a", "b", "b"], dtype=object)})
    backend = verl.DynascopeTracking(tmp_path / "s")
    backend.samples(batch, step=5)
    backend.finish()
    got = _rows(tmp_path / "s", "SELECT sample_id, group_id, prompt_len, response_len, reward, step FROM samples "
                                "ORDER BY sample_id")
    assert got == [(0, 0, 3, 2, 1.0, 5), (1, 0, 4, 4, 0.5, 5), (2, 1, 2, 0, 0.0, 5), (3, 1, 2, 1, 1.0, 5)]


class _Tracking:
    """verl.utils.tracking.Tracking's registry contract, reduced to what register_backend relies on."""

    supported_backend = ["wandb", "console"]

    def __init__(self, project_name, experiment_name, default_backend="console", config=None):
        backends = [default_backend] if isinstance(default_backend, str) else default_backend
        for b in backends:
            assert b in self.supported_backend, f"{b} is not supported"
        self.logger = {}

    def log(self, data, step, backend=None):
        for name, logger in self.logger.items():
            if backend is None or name in backend:
                logger.log(data=data, step=step)


def test_register_backend_by_name(tmp_path):
    with pytest.raises(AssertionError):
        _Tracking("p", "e", default_backend=["dynascope"])
    cls = verl.register_backend(_Tracking, run=tmp_path / "t")
    assert verl.register_backend(cls) is cls  # idempotent
    tracking = cls("p", "e", default_backend=["console", "dynascope"], config={"trainer": {"n_gpus": 8}})
    tracking.log(data={"timing_s/step": 2.0, "timing_s/update_actor": 1.0}, step=7)
    tracking.logger["dynascope"].finish()
    assert _rows(tmp_path / "t", "SELECT phase, parent, dur_us FROM timings WHERE step=7 ORDER BY phase") == [
        ("step", None, 2_000_000), ("train", None, 1_000_000), ("update_actor", "train", 1_000_000)]
    assert "n_gpus" in _rows(tmp_path / "t", "SELECT config_json FROM runs")[0][0]
