"""Held-out evaluation of the real-model run, per problem: greedy accuracy and the forward KL to a base.

Every evaluation point (the pretrained model, after SFT, every ``eval_every`` RL steps, the final policy,
and the rank-1 / extrapolated checkpoints) scores the same held-out problems, so figures of two points
pair problem by problem and their bootstrap intervals (``demo.intervals``) resample problems together.
The per-problem results go to ``<run>/heldout_eval.json``; their means go to the ``scalars`` table.

KL to the base follows RL's Razor (Shenfeld, Pari & Agrawal, arXiv 2509.04259): forgetting tracks the
forward KL from the base policy π₀ to the trained π on the new task's distribution,
E_{x∼task}[KL(π₀(·|x) ‖ π(·|x))] over whole responses y. Per held-out prompt it is estimated on one
response sampled from π₀ (T = 1, the task's 4-token budget), summing the exact next-token KL along it:
KL̂(x) = Σ_t Σ_v π₀(v|x, y<t)·(log π₀(v|x, y<t) − log π(v|x, y<t)), an unbiased estimate of the sequence
KL with less variance than log π₀(y|x) − log π(y|x) (the Rao-Blackwellized estimator of Amini et al.,
arXiv 2504.10637). The bases' samples are drawn once, from their own random stream, and reused at every
point, so points differ only by π. Two bases: the pretrained model (the paper's π₀: the model before any
training on the task) and the SFT result (RL's own base, θ₀ of the ``rl`` stage's drift columns).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dynascope.demo import arith
from dynascope.demo.smollm2 import Rollout, generate
from dynascope.demo.smollm2_prose import prose_nll

EVAL_FILE = "heldout_eval.json"
_CHUNK = 32  # prompts per forward pass: bounds the [chunk, R, vocab] log-prob tensors


@dataclass
class _Base:
    rollout: Rollout       # one response per held-out prompt, sampled from the base
    logp: torch.Tensor     # [N, R, V] float32: the base's next-token log-probs along those responses


def _log_softmax_along(model: Any, r: Rollout, lo: int, hi: int) -> torch.Tensor:
    """log π(· | x, y<t) [hi − lo, R, V] at each response position of prompts lo..hi (float32)."""
    ids = torch.cat([r.prompt_ids[lo:hi], r.response[lo:hi]], 1)
    attn = torch.cat([r.prompt_mask[lo:hi], r.response_mask[lo:hi].long()], 1)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    width = r.response.shape[1]
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=width + 1).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1)


class HeldOut:
    """The held-out problems and every evaluation point's per-problem results."""

    def __init__(self, problems: list[arith.Problem], tok: Any, cfg: arith.ArithConfig, run_dir: Path,
                 seed: int, scope: Any = None, prose: torch.Tensor | None = None) -> None:
        self.problems, self.tok, self.cfg, self.run_dir, self.seed = problems, tok, cfg, Path(run_dir), seed
        self.prose = prose  # [n, tokens] windows of held-out prose (smollm2_prose), scored at logged points
        self.prompts = [arith.prompt(p, tok) for p in problems]
        self.bases: dict[str, _Base] = {}
        self.points: list[dict[str, Any]] = []
        self.scope = scope

    @torch.no_grad()
    def add_base(self, name: str, model: Any) -> None:
        """Sample one response per prompt from ``model`` (T = 1, a stream of its own) and keep its log-probs."""
        was = model.training
        model.eval()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + len(self.bases) + 1)
            r = generate(model, self.tok, self.prompts, self.cfg.max_new_tokens, 1.0)
        logp = torch.cat([_log_softmax_along(model, r, lo, lo + _CHUNK) for lo in range(0, len(self.prompts), _CHUNK)])
        model.train(was)
        self.bases[name] = _Base(r, logp)

    @torch.no_grad()
    def forward_kl(self, name: str, model: Any) -> list[float]:
        """KL̂(π_base ‖ π_model) per held-out prompt, in nats (see the module docstring)."""
        base = self.bases[name]
        out: list[torch.Tensor] = []
        for lo in range(0, len(self.prompts), _CHUNK):
            hi = lo + _CHUNK
            lp = _log_softmax_along(model, base.rollout, lo, hi)
            lp0 = base.logp[lo:hi]
            per_pos = (lp0.exp() * (lp0 - lp)).sum(-1)  # exact KL of the next-token distributions
            out.append((per_pos * base.rollout.response_mask[lo:hi].to(per_pos.dtype)).sum(1))
        return torch.cat(out).double().cpu().tolist()

    @torch.no_grad()
    def evaluate(self, model: Any, label: str, *, stage: str | None, rl_step: int | None, log: bool = True) -> dict:
        """Score ``model`` (greedy exact match, KL to each base held): one point, saved, and with ``log`` its
        means logged as ``eval/accuracy`` and ``eval/forward_kl_<base>_nats`` at the step whose weights were scored;
        logged points also score the prose windows (``prose_nll_nats`` per window, ``eval/prose_nll_nats``)."""
        was = model.training
        model.eval()
        r = generate(model, self.tok, self.prompts, self.cfg.max_new_tokens, 0.0)
        correct = [int(arith.reward(p, t)) for p, t in zip(self.problems, r.texts, strict=True)]
        kls = {name: self.forward_kl(name, model) for name in self.bases}
        model.train(was)
        point = {"label": label, "stage": stage, "rl_step": rl_step, "correct": correct,
                 "forward_kl_nats": kls}
        prose = {}
        if log and self.prose is not None:
            point["prose_nll_nats"] = nll = prose_nll(model, self.prose)
            prose = {"eval/prose_nll_nats": sum(nll) / len(nll)}
        self.points.append(point)
        if log and self.scope is not None:
            # at the step whose weights were scored (the scope has already moved one past it), as the tiny demo
            self.scope.log(step=max(self.scope.step_index - 1, 0), **{"eval/accuracy": sum(correct) / len(correct)},
                           **{f"eval/forward_kl_{n}_nats": sum(v) / len(v) for n, v in kls.items()}, **prose)
        self.save()
        return point

    def save(self) -> None:
        doc = {"problems": [[p.a, p.op, p.b] for p in self.problems], "points": self.points}
        tmp = self.run_dir / (EVAL_FILE + ".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.run_dir / EVAL_FILE)


def load_heldout(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's per-problem evaluation results (``HeldOut.save``), or None when the run has none."""
    p = Path(run_dir) / EVAL_FILE
    return json.loads(p.read_text()) if p.exists() else None
