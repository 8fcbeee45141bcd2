"""All knobs of one demo run in one JSON-serialisable object, shared by the parent, torchrun ranks and Ray actors."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from dynascope.demo.grpo import GRPOConfig
from dynascope.demo.model import ModelConfig
from dynascope.demo.sft import SFTConfig
from dynascope.demo.task import CharTokenizer, TaskConfig


@dataclass(frozen=True)
class DemoSettings:
    run_dir: str
    seed: int = 0
    quick: bool = False
    ranks: int = 1
    slow_rank: int | None = None
    slow_factor: float = 2.0
    use_async: bool = False
    alerts: bool = False  # the default alert rules, judged live on rank 0 (``watch(alerts=True)``)
    spike_step: int | None = None  # the RL step whose loss is scaled ×SPIKE_SCALE: a planted gradient spike
    # torch threads per process: 1, because these ops are tiny; a second OpenMP thread buys little on
    # an idle machine and spins badly on a busy one (20× slower measured on a loaded 2-core box), and
    # the probe's writer/resolver threads get the other core.
    threads: int = 1
    eval_n: int = 256           # held-out prompts for greedy accuracy / sampled reward
    spectral_every: int = 10    # RL steps between low-rank summaries of ΔW (the last RL step is always one)
    spectral_k: int = 8
    rollout_workers: int = 2    # async mode: Ray rollout actors
    max_staleness: int = 2      # async mode: drop batches generated more than this many versions ago
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=lambda: ModelConfig(vocab_size=CharTokenizer().vocab_size))
    sft: SFTConfig = field(default_factory=SFTConfig)
    rl: GRPOConfig = field(default_factory=GRPOConfig)

    @classmethod
    def build(cls, run_dir: str, *, quick: bool, ranks: int, slow_rank: int | None, slow_factor: float,
              long_tail: bool, use_async: bool, seed: int, alerts: bool = False,
              spike_step: int | None = None) -> DemoSettings:
        """Defaults (≤ 3 min on 2 cores) or ``quick`` (< 60 s) settings for the requested variant."""
        rl = GRPOConfig(steps=40, prompts=16) if quick else GRPOConfig()
        return cls(run_dir=str(run_dir), seed=seed, quick=quick, ranks=max(ranks, 1), slow_rank=slow_rank,
                   slow_factor=slow_factor, use_async=use_async, alerts=alerts, spike_step=spike_step,
                   eval_n=128 if quick else 256, spectral_every=5 if quick else 10,
                   task=TaskConfig(long_tail=long_tail), rl=rl)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> DemoSettings:
        d = json.loads(text)
        return cls(**{**d, "task": TaskConfig(**d["task"]), "model": ModelConfig(**d["model"]),
                      "sft": SFTConfig(**d["sft"]), "rl": GRPOConfig(**d["rl"])})
