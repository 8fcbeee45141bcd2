"""The real-model run: SFT (AdamW 1e-5) → GRPO (AdamW 1e-6) on arithmetic, probed, then the rewritten checkpoints.

Stage ``sft`` measures drift against the pretrained weights; at the switch to ``rl`` the probe's θ₀
becomes the SFT result, so RL's cumulative figures are against RL's own base, as the papers define
them. The rollout copy is bf16, as inference engines hold weights: each RL step's ``weight_sync`` casts
the fp32 master weights into it, ``weight_check`` verifies that cast (``verify_weight_sync``), and the
trainer's recomputed log-probs of the sampled tokens are held against the copy's (the log-prob gap,
recorded with each sample); the trainer computes them once more in two micro-batches of half the samples
(the trainer-vs-trainer gap, logged under ``trainer_self/``: the floor two computations of the trainer leave).
Held-out evaluations (``smollm2_eval``) score accuracy, the forward KL to the bases and the plain-text
log-loss on the Python docs' prose (forgetting, ``smollm2_prose``) at the pretrained model, after SFT, every
``eval_every`` RL steps and at the end; then AlphaRL's rank-1 replacement and RELEX's extrapolation are
written and scored (``smollm2_checkpoints``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

import dynascope
from dynascope.demo import arith
from dynascope.demo.clock import Clock
from dynascope.demo.grpo import group_advantages
from dynascope.demo.smollm2 import (
    FINAL_FILE,
    THETA0_FILE,
    SmolSettings,
    clone_frozen,
    generate,
    load_model,
    save_weights,
    token_logprobs,
    token_logprobs_split,
)
from dynascope.demo.smollm2_checkpoints import (
    RANK1_FILE,
    RANK1_REST_RL_FILE,
    rewritten_checkpoints,
    save_delta,
)
from dynascope.demo.smollm2_eval import HeldOut
from dynascope.demo.smollm2_prose import prose_windows
from dynascope.probes.rollout_consistency import logprob_gap_columns, logprob_gap_totals, verify_weight_sync

__all__ = ["RANK1_FILE", "RANK1_REST_RL_FILE", "run_smollm2", "train"]


def _sync(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Push the trainer's weights into the rollout copy (``copy_`` casts to the copy's dtype)."""
    with torch.no_grad():
        for d, s in zip(dst.parameters(), src.parameters(), strict=True):
            d.copy_(s)


def _sft(s: SmolSettings, model: Any, tok: Any, opt: torch.optim.Optimizer, scope: Any, cfg: arith.ArithConfig) -> None:
    train = arith.problems(s.sft_steps * s.sft_batch, cfg, seed=s.seed)
    model.train()
    for i in range(s.sft_steps):
        with scope.phase("data"):
            batch = arith.sft_batch(train[i * s.sft_batch:(i + 1) * s.sft_batch], tok, s.device)
        with scope.phase("train"):
            loss = model(**batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
        scope.log(**{"sft/loss": float(loss.detach())})
        opt.step()  # the probe's step boundary


def _rl_step(s: SmolSettings, model: Any, rollout: Any, tok: Any, opt: torch.optim.Optimizer, scope: Any,
             batch: list[arith.Problem], cfg: arith.ArithConfig, first: int) -> float:
    """weight_sync → weight_check → rollout → reward → train → optimizer step (on-policy, no KL term).

    ``first``: the index of this step's first prompt in the RL stage (sample and group ids count from it).
    """
    version = scope.step_index  # the trainer's weights that the rollout copy receives and is trained on
    with scope.phase("weight_sync"):
        _sync(model, rollout)
    with scope.phase("weight_check"):
        verify_weight_sync(scope, model, rollout)
    expanded = [p for p in batch for _ in range(s.group)]
    with scope.phase("rollout"):
        r = generate(rollout, tok, [arith.prompt(p, tok) for p in expanded], cfg.max_new_tokens, s.temperature,
                     logprobs=True)
    with scope.phase("reward"):
        rewards = torch.tensor([arith.reward(p, t) for p, t in zip(expanded, r.texts, strict=True)])
    with scope.phase("train"):
        adv = group_advantages(rewards, s.group).to(s.device)
        new = token_logprobs(model, r)
        m = r.response_mask.float()
        ratio = torch.exp(new - new.detach())  # exactly 1; its gradient is the policy gradient
        loss = -(ratio * adv[:, None] * m).sum() / m.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
    n = len(expanded)
    with scope.phase("self_check"):  # the trainer's own floor: the same tokens, fp32 again, in two micro-batches
        again = token_logprobs_split(model, r, max(1, n // 2))
        scope.log(**logprob_gap_totals(logprob_gap_columns(again, new, r.response_mask)))
    scope.samples(sample_id=[first * s.group + j for j in range(n)], group_id=[first + j // s.group for j in range(n)],
                  prompt_len=r.prompt_mask.sum(1).tolist(), response_len=r.response_mask.sum(1).tolist(),
                  reward=rewards.tolist(), gen_start_us=[r.start_us] * n, gen_end_us=[r.end_us] * n,
                  policy_version=[version] * n, trainer_version=[version] * n,
                  **logprob_gap_columns(r.logprobs, new, r.response_mask))
    scope.log(**{"rl/reward": float(rewards.mean()), "rl/loss": float(loss.detach()),
                 "rl/mixed_groups": float((rewards.view(-1, s.group).std(1) > 0).float().mean())})
    opt.step()
    return float(rewards.mean())


def _evaluate(held: HeldOut, model: Any, scope: Any, label: str, stage: str, rl_step: int | None) -> float:
    with scope.phase("eval"):
        point = held.evaluate(model, label, stage=stage, rl_step=rl_step)
    return sum(point["correct"]) / len(point["correct"])


def train(s: SmolSettings, say=print) -> dict[str, float]:
    """The whole run into ``s.run_dir``; returns the held-out accuracies it logged, by evaluation point."""
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    run_dir = Path(s.run_dir)
    t0 = time.perf_counter()
    model, tok = load_model(s.device)
    rollout = clone_frozen(model).to(getattr(torch, s.rollout_dtype))  # the "inference engine"
    say(f"SmolLM2-135M-Instruct loaded (fp32, {s.device}) in {time.perf_counter() - t0:.0f} s; rollout copy in "
        f"{s.rollout_dtype}", flush=True)
    cfg = arith.ArithConfig()
    opt = torch.optim.AdamW(model.parameters(), lr=s.sft_lr, weight_decay=0.0)
    # Every tensor at every recorded step (no rotating window, no time budget): S₁ is a whole-model figure.
    spectral = dict(k=8, every=s.spectral_every, time_budget=None) if s.spectral_every else False
    scope = dynascope.watch(model, opt, run=s.run_dir, stage="sft", every=s.stats_every, memory_budget=None,
                            time_budget=None, bf16_k=s.bf16_k, spectral=spectral, system_interval_s=5.0,
                            config={"demo": "smollm2", "settings": s.to_json()})
    prose = prose_windows(tok, s.prose_n, s.prose_tokens) if s.prose_n else None
    held = HeldOut(arith.problems(s.eval_n, cfg, seed=10_000 + s.seed), tok, cfg, run_dir, s.seed, scope, prose)
    out: dict[str, float] = {}
    with scope.phase("eval"):
        held.add_base("pretrained", model)
    out["pretrained"] = _evaluate(held, model, scope, "pretrained", "sft", None)
    say(f"pretrained: held-out accuracy {out['pretrained']:.1%} on {s.eval_n} problems; SFT for {s.sft_steps} "
        f"steps at lr {s.sft_lr:g}", flush=True)
    _sft(s, model, tok, opt, scope, cfg)
    with scope.phase("eval"):
        held.add_base("sft", model)
    out["sft"] = _evaluate(held, model, scope, "sft", "sft", 0)
    say(f"SFT: held-out accuracy {out['sft']:.1%}; GRPO for {s.rl_steps} steps at lr {s.rl_lr:g}", flush=True)

    save_weights(model, run_dir / THETA0_FILE)
    scope.set_stage("rl")
    scope.set_reference("init")
    scope.event("stage", "RL starts: θ₀ = SFT result", sft_steps=s.sft_steps, sft_accuracy=out["sft"])
    for group in opt.param_groups:  # a fresh optimizer state at the RL learning rate
        group["lr"] = s.rl_lr
    opt.state.clear()
    train_set = arith.problems(s.rl_steps * s.prompts, cfg, seed=1 + s.seed)
    deltas = set(s.relex_steps())
    recent: list[float] = []
    for i in range(s.rl_steps):
        batch = train_set[i * s.prompts:(i + 1) * s.prompts]
        recent.append(_rl_step(s, model, rollout, tok, opt, scope, batch, cfg, i * s.prompts))
        done = i + 1
        if done in deltas:
            with scope.phase("relex_save"):
                save_delta(model, run_dir, done)
        if done % max(1, s.rl_steps // 4) == 0:
            say(f"  RL step {done}/{s.rl_steps}: training reward {sum(recent) / len(recent):.1%} "
                f"(last {len(recent)} steps)", flush=True)
            recent.clear()
        if done % s.eval_every == 0 and done < s.rl_steps:
            out[f"rl@{done}"] = _evaluate(held, model, scope, f"rl@{done}", "rl", done)
            say(f"  held-out accuracy after {done} RL steps: {out[f'rl@{done}']:.1%}", flush=True)
    out["rl"] = _evaluate(held, model, scope, "rl", "rl", s.rl_steps)
    save_weights(model, run_dir / FINAL_FILE)
    scope.log(**{f"alpharl/{k}_accuracy": out[k] for k in ("pretrained", "sft", "rl")})
    say(f"RL done: held-out accuracy {out['rl']:.1%}", flush=True)
    out.update(rewritten_checkpoints(s, model, held, scope, say))
    scope.close()
    return out


def run_smollm2(run_dir: str | Path, steps: int | None = None, device: str = "cpu", seed: int = 0,
                console: Any = None, **overrides: Any) -> Path:
    """``dynascope demo --model smollm2``: check the install, train into ``run_dir``, print the report.

    ``overrides`` set other ``SmolSettings`` fields (the long-run benchmark's held-out size, cadences).
    """
    from rich.console import Console

    from dynascope.demo.reproduction import print_reproduction
    from dynascope.demo.smollm2 import model_files

    console = console or Console()
    model_files()  # one line naming the install command, before anything is created
    run_dir = Path(run_dir).expanduser().resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(f"{run_dir} already exists and is not empty; pass another --run or remove it")
    if steps is not None and steps < 1:
        raise ValueError("--steps must be at least 1")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available")
    s = SmolSettings(run_dir=str(run_dir), seed=seed, device=device,
                     **({} if steps is None else {"rl_steps": steps}), **overrides)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "demo_settings.json").write_text(s.to_json())
    console.print(f"[bold]dynascope demo --model smollm2[/] → {run_dir}", highlight=False)
    clock = Clock()
    train(s, say=print)
    print_reproduction(s, console, train_s=clock.wall_s(), cpu_s=clock.cpu_s())
    return run_dir
