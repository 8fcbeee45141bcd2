"""Phase 1: supervised warm-up on correct examples, stopped once the policy is partly right.

Stopping early on purpose leaves room for RL: the SFT policy solves short strings and fails long ones,
so GRPO's groups have mixed rewards (and therefore a learning signal) from the first step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dynascope.demo.model import TinyLM, generate
from dynascope.demo.task import CharTokenizer, TaskConfig, prompt_ids, reward, sample_strings, sft_batch


@dataclass(frozen=True)
class SFTConfig:
    max_steps: int = 300
    batch: int = 64
    lr: float = 3e-3
    target_acc: float = 0.3   # stop once greedy held-out accuracy reaches this: "partly right"
    eval_every: int = 5


@torch.no_grad()
def evaluate(model: TinyLM, tok: CharTokenizer, task: TaskConfig, strings: list[str], temperature: float = 0.0,
             seed: int = 0) -> float:
    """Mean exact-match reward on ``strings`` (greedy when ``temperature == 0``)."""
    was_training = model.training
    model.eval()
    r = generate(model, [prompt_ids(s, tok) for s in strings], task.max_new_tokens, temperature,
                 torch.Generator().manual_seed(seed))
    model.train(was_training)
    return sum(reward(s, r.response[i].tolist(), tok) for i, s in enumerate(strings)) / len(strings)


def heldout(task: TaskConfig, n: int, seed: int) -> list[str]:
    """A fixed evaluation set, drawn from its own generator so training never sees its draw order."""
    return sample_strings(n, task, torch.Generator().manual_seed(10_000 + seed))


def log_eval(scope: Any, model: TinyLM, tok: CharTokenizer, task: TaskConfig, strings: list[str], seed: int,
             rank: int = 0, world: int = 1, sampled: bool = True, greedy: bool = True) -> dict:
    """Greedy accuracy and/or the T=1 reward on the held-out set, logged as ``eval/*`` scalars at the step
    whose weights they score: the last optimizer step's (step 0 before any).

    Under torchrun each rank scores its share of the set and one all_reduce adds them up.
    """
    mine = strings[rank::world]
    with scope.phase("eval"):
        sums = torch.tensor([evaluate(model, tok, task, mine) * len(mine) if greedy else 0.0,
                             evaluate(model, tok, task, mine, 1.0, seed + rank) * len(mine) if sampled else 0.0],
                            dtype=torch.float64)
        if world > 1:
            torch.distributed.all_reduce(sums)
    out = {"eval/accuracy": float(sums[0]) / len(strings)} if greedy else {}
    if sampled:
        out["eval/sampled_reward"] = float(sums[1]) / len(strings)
    # The scope is at the step after the last optimizer step: the weights scored are that step's result.
    scope.log(step=max(scope.step_index - 1, 0), **out)
    return out


def run_sft(model: TinyLM, opt: torch.optim.Optimizer, scope: Any, tok: CharTokenizer, task: TaskConfig,
            cfg: SFTConfig, gen: torch.Generator, evals: list[str], seed: int, rank: int = 0, world: int = 1) -> dict:
    """Train on correct demonstrations until held-out greedy accuracy reaches ``cfg.target_acc``."""
    from dynascope.demo.grpo import allreduce_grads

    # Greedy accuracy is the stopping rule; the sampled reward is measured once, where RL starts.
    last = log_eval(scope, model, tok, task, evals, seed, rank, world, sampled=False)
    for step in range(1, cfg.max_steps + 1):
        with scope.phase("data"):
            ids, tgt = sft_batch(sample_strings(cfg.batch, task, gen), tok)
        with scope.phase("train"):
            loss = F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
        if world > 1:
            with scope.phase("grad_allreduce", category="comm"):
                allreduce_grads(model, world)
        scope.log(**{"sft/loss": float(loss.detach())})
        opt.step()  # the probe's step boundary
        if step % cfg.eval_every == 0:
            last = log_eval(scope, model, tok, task, evals, seed, rank, world, sampled=False)
            if last["eval/accuracy"] >= cfg.target_acc:
                break
    # The sampled reward is measured once, where RL starts; greedy accuracy again only if the loop's last
    # step had no evaluation (each scalar once per step).
    evaluated = step % cfg.eval_every == 0
    return {"steps": step, **last, **log_eval(scope, model, tok, task, evals, seed, rank, world, greedy=not evaluated)}
