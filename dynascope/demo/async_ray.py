"""Asynchronous GRPO on a local Ray cluster (Laminar/AReaL style): rollout actors never wait for training.

A trainer actor runs SFT, then consumes rollout batches one at a time and publishes each new version's
weights to the object store (``ray.put``). Rollout actors generate with whatever version they last
pulled, so batches arrive *stale*; the trainer records each sample's ``policy_version`` (the weights
that generated it) and ``trainer_version`` (when it was consumed), corrects the ratio with the behaviour
policy's log-probs (decoupled PPO), and drops batches staler than ``max_staleness``. Every actor runs
dynascope's probes into the same run, so staleness, rollout/train overlap and weight-sync time are measured.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from dynascope.demo.settings import DemoSettings


def publish_weights(model: torch.nn.Module) -> list:
    """Put a copy of ``model``'s weights in the object store; a list, so Ray hands the reference itself on."""
    import ray

    return [ray.put({k: v.detach().clone() for k, v in model.state_dict().items()})]


def load_weights(model: torch.nn.Module, refs: list) -> None:
    """Load the weights ``publish_weights`` put in the object store into ``model``."""
    import ray

    model.load_state_dict(ray.get(refs[0]))


class Trainer:
    """SFT, then one GRPO update per consumed batch; publishes weights after each update."""

    def __init__(self, settings_json: str, world: int) -> None:
        from dynascope.demo.distributed import RLSpectralSchedule, open_scope
        from dynascope.demo.model import TinyLM
        from dynascope.demo.sft import heldout
        from dynascope.demo.task import CharTokenizer

        s = self.s = DemoSettings.from_json(settings_json)
        torch.set_num_threads(s.threads)
        torch.manual_seed(s.seed)
        self.tok, self.model = CharTokenizer(), TinyLM(s.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=s.sft.lr, weight_decay=0.0)
        self.spectral = RLSpectralSchedule(s.spectral_every)
        self.scope = open_scope(s, self.model, self.opt, rank=0, world=world, spectral=self.spectral)
        self.gen = torch.Generator().manual_seed(1000 * s.seed)
        self.evals = heldout(s.task, s.eval_n, s.seed)
        self.version, self.dropped = 0, 0

    def sft(self) -> tuple[int, list]:
        """Supervised warm-up, then switch the probes to RL with θ₀ = the SFT result."""
        from dynascope.demo.distributed import THETA0_FILE, frozen_copy, save_weights
        from dynascope.demo.sft import run_sft

        s = self.s
        out = run_sft(self.model, self.opt, self.scope, self.tok, s.task, s.sft, self.gen, self.evals, s.seed)
        save_weights(self.model, Path(s.run_dir) / THETA0_FILE)
        print(f"SFT: {out['steps']} steps → held-out accuracy {out['eval/accuracy']:.1%}; async GRPO for "
              f"{s.rl.steps} steps", flush=True)
        self.scope.set_stage("rl")
        self.scope.set_reference("init")
        self.scope.event("stage", "RL starts: θ₀ = SFT result", sft_steps=out["steps"], sft_accuracy=out["eval/accuracy"])
        self.ref = frozen_copy(self.model)
        for group in self.opt.param_groups:
            group["lr"] = s.rl.lr
        self.opt.state.clear()
        self.spectral.start, self.spectral.last = self.scope.step_index, self.scope.step_index + s.rl.steps - 1
        return self._publish()

    def _publish(self) -> tuple[int, list]:
        with self.scope.phase("weight_sync"):
            refs = publish_weights(self.model)
        return self.version, refs

    def train(self, batch: dict) -> tuple[int, list]:
        """One decoupled-PPO GRPO update on a (possibly stale) batch; returns the new published version."""
        from dynascope.demo.grpo import record_samples, train_on_batch

        s, r = self.s, batch["rollout"]
        stale = self.version - batch["policy_version"]
        if stale > s.max_staleness:  # too far off-policy: drop it, as AReaL's staleness bound does
            self.dropped += 1
            self.scope.event("stale_batch_dropped", f"staleness {stale} > {s.max_staleness}", staleness=stale)
            return self.version, []
        record_samples(self.scope, batch["expanded"], r, batch["rewards"], s.rl, batch["first_id"],
                       batch["policy_version"], self.version)
        self.scope.log(**{"rl/staleness": float(stale)})
        train_on_batch(policy=self.model, ref=self.ref, opt=self.opt, scope=self.scope, r=r,
                       rewards=batch["rewards"], old_lp=batch["behaviour_logprobs"], cfg=s.rl, world=1)
        self.version += 1
        return self._publish()

    def finish(self) -> dict:
        from dynascope.demo.distributed import FINAL_FILE, save_weights
        from dynascope.demo.sft import log_eval

        out = log_eval(self.scope, self.model, self.tok, self.s.task, self.evals, self.s.seed)
        print(f"RL done: held-out accuracy {out['eval/accuracy']:.1%}; {self.dropped} stale batches dropped", flush=True)
        save_weights(self.model, Path(self.s.run_dir) / FINAL_FILE)
        self.scope.event("async_summary", f"{self.dropped} stale batches dropped", dropped=self.dropped)
        self.scope.close()
        return out


class RolloutWorker:
    """Generates GRPO groups with the newest weights it has pulled; probes record its phases."""

    def __init__(self, settings_json: str, index: int, world: int) -> None:
        from dynascope.demo.distributed import open_scope
        from dynascope.demo.model import TinyLM
        from dynascope.demo.task import CharTokenizer

        s = self.s = DemoSettings.from_json(settings_json)
        torch.set_num_threads(s.threads)
        self.index, self.world = index, world
        self.tok, self.model = CharTokenizer(), TinyLM(s.model).requires_grad_(False)
        self.scope = open_scope(s, self.model, None, rank=index + 1, world=world, role="rollout", stage="rl")
        self.gen = torch.Generator().manual_seed(1000 * s.seed + index + 1)
        self.version, self.batches = -1, 0

    def generate(self, version: int, weights: list) -> dict:
        from dynascope.demo.grpo import generate_groups, score
        from dynascope.demo.model import token_logprobs

        if version != self.version:
            with self.scope.phase("weight_sync"):
                load_weights(self.model, weights)
                self.version = version
        with self.scope.phase("rollout"):
            expanded, r = generate_groups(self.model, self.tok, self.s.task, self.s.rl, self.gen)
        with self.scope.phase("reward"):
            rewards = score(expanded, r, self.tok)
        with self.scope.phase("old_logprob"), torch.no_grad():
            behaviour, _ = token_logprobs(self.model, r)
        self.scope.step()
        n = len(expanded)
        first_id = (self.batches * (self.world - 1) + self.index) * n
        self.batches += 1
        return {"expanded": expanded, "rollout": r, "rewards": rewards, "behaviour_logprobs": behaviour,
                "policy_version": self.version, "first_id": first_id}

    def close(self) -> None:
        self.scope.close()


def _drive(ray: Any, trainer: Any, workers: list, steps: int) -> None:
    """Keep every rollout actor busy; feed finished batches to the trainer in arrival order.

    Generation never waits for training: a worker restarts at once with the newest published weights,
    so a batch can be trained several versions after the weights that generated it.
    """
    latest = ray.get(trainer.sft.remote())
    gen = {w.generate.remote(*latest): w for w in workers}
    training: list = []
    submitted = done = 0
    while done < steps:
        ready, _ = ray.wait([*gen, *training], num_returns=1)
        f = ready[0]
        if f in gen:
            w = gen.pop(f)
            if submitted < steps:
                training.append(trainer.train.remote(f))  # Ray hands the finished batch to the trainer
                submitted += 1
            gen[w.generate.remote(*latest)] = w
        else:
            training.remove(f)
            version, refs = ray.get(f)
            if refs:
                latest = (version, refs)
                done += 1
            else:  # dropped as too stale: one more batch is needed
                submitted -= 1
    ray.get(list(gen))  # let the last generations finish before the actors close their probes


def _start_ray(ray: Any, tmp: str, num_cpus: int, attempts: int = 3) -> None:
    """A lean local node (no dashboard, small object store), retried: on a saturated machine Ray's agent can
    miss the raylet's fixed start-up wait (ray-project/ray#65983), and a second try usually fits."""
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")  # honoured by Ray builds that read it
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address="local", include_dashboard=False, num_cpus=num_cpus, _temp_dir=tmp,
                     object_store_memory=80 * 1024 * 1024, configure_logging=False, log_to_driver=True)
            return
        except Exception as exc:
            ray.shutdown()
            if attempt == attempts:
                raise RuntimeError(f"Ray could not start a local node after {attempts} tries ({exc}); its agent "
                                   "misses Ray's fixed start-up wait on a busy machine") from exc


def run_async(s: DemoSettings, console: Console) -> None:
    """Start a local Ray cluster, run SFT + asynchronous GRPO, and shut it down."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    tmp = tempfile.mkdtemp(prefix="dsray", dir="/tmp")  # Ray's socket paths must stay short
    world = 1 + s.rollout_workers
    try:
        _start_ray(ray, tmp, world)
        env = {"env_vars": {"OMP_NUM_THREADS": "1"}}
        trainer = ray.remote(num_cpus=1, runtime_env=env)(Trainer).remote(s.to_json(), world)
        workers = [ray.remote(num_cpus=1, runtime_env=env)(RolloutWorker).remote(s.to_json(), i, world)
                   for i in range(s.rollout_workers)]
        console.print(f"Ray: 1 trainer + {len(workers)} rollout actors", highlight=False)
        _drive(ray, trainer, workers, s.rl.steps)
        ray.get([w.close.remote() for w in workers])
        ray.get(trainer.finish.remote())
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
