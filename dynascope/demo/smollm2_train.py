"""The real-model run: SFT (AdamW 1e-5) → GRPO (AdamW 1e-6) on arithmetic, probed, then AlphaRL's rank-1 test.

Stage ``sft`` measures drift against the pretrained weights; at the switch to ``rl`` the probe's θ₀
becomes the SFT result, so RL's cumulative figures are against RL's own base, as the papers define
them. After RL, ``dynascope.checkpoints.alpharl_rank1`` writes the rank-1 replacement of RL's update, and
the held-out reward of the base, the RL policy and the replacement are logged as ``alpharl/*`` scalars.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

import dynascope
from dynascope.demo import arith
from dynascope.demo.grpo import group_advantages
from dynascope.demo.smollm2 import (
    FINAL_FILE,
    THETA0_FILE,
    SmolSettings,
    accuracy,
    clone_frozen,
    generate,
    load_model,
    load_weights,
    save_weights,
    token_logprobs,
)

RANK1_FILE = "policy_rank1.safetensors"            # AlphaRL as the authors' upd_rank.py: the rest at base
RANK1_REST_RL_FILE = "policy_rank1_rest_rl.safetensors"  # the rest (embeddings, norms) with RL's full update


def _sync(src: torch.nn.Module, dst: torch.nn.Module) -> None:
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
             batch: list[arith.Problem], cfg: arith.ArithConfig) -> float:
    """weight_sync → rollout → reward → train → optimizer step (on-policy, one update per batch, no KL term)."""
    with scope.phase("weight_sync"):
        _sync(model, rollout)
    expanded = [p for p in batch for _ in range(s.group)]
    with scope.phase("rollout"):
        r = generate(rollout, tok, [arith.prompt(p, tok) for p in expanded], cfg.max_new_tokens, s.temperature)
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
    scope.log(**{"rl/reward": float(rewards.mean()), "rl/loss": float(loss.detach()),
                 "rl/mixed_groups": float((rewards.view(-1, s.group).std(1) > 0).float().mean())})
    opt.step()
    return float(rewards.mean())


def train(s: SmolSettings, say=print) -> dict[str, float]:
    """The whole run into ``s.run_dir``; returns the held-out accuracies it logged."""
    from dynascope.checkpoints import alpharl_rank1

    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    run_dir = Path(s.run_dir)
    t0 = time.perf_counter()
    model, tok = load_model(s.device)
    rollout = clone_frozen(model)  # the "inference engine"; also evaluates the rank-1 checkpoints
    say(f"SmolLM2-135M-Instruct loaded (fp32, {s.device}) in {time.perf_counter() - t0:.0f} s", flush=True)
    cfg = arith.ArithConfig()
    held_out = arith.problems(s.eval_n, cfg, seed=10_000 + s.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=s.sft_lr, weight_decay=0.0)
    # Every tensor every step (no rotating window, no time budget): S₁ is a per-step, whole-model figure.
    scope = dynascope.watch(model, opt, run=s.run_dir, stage="sft", every=1, memory_budget=None, time_budget=None,
                            bf16_k=s.bf16_k, system_interval_s=5.0,
                            config={"demo": "smollm2", "settings": s.to_json()})
    out: dict[str, float] = {}
    with scope.phase("eval"):
        out["pretrained"] = accuracy(model, tok, held_out, cfg.max_new_tokens)
    scope.log(**{"eval/accuracy": out["pretrained"]})
    say(f"pretrained: held-out accuracy {out['pretrained']:.1%}; SFT for {s.sft_steps} steps at lr {s.sft_lr:g}",
        flush=True)
    _sft(s, model, tok, opt, scope, cfg)
    with scope.phase("eval"):
        out["sft"] = accuracy(model, tok, held_out, cfg.max_new_tokens)
    scope.log(**{"eval/accuracy": out["sft"]})
    say(f"SFT: held-out accuracy {out['sft']:.1%}; GRPO for {s.rl_steps} steps at lr {s.rl_lr:g}", flush=True)

    save_weights(model, run_dir / THETA0_FILE)
    scope.set_stage("rl")
    scope.set_reference("init")
    scope.event("stage", "RL starts: θ₀ = SFT result", sft_steps=s.sft_steps, sft_accuracy=out["sft"])
    for group in opt.param_groups:  # a fresh optimizer state at the RL learning rate
        group["lr"] = s.rl_lr
    opt.state.clear()
    train_set = arith.problems(s.rl_steps * s.prompts, cfg, seed=1 + s.seed)
    recent: list[float] = []
    for i in range(s.rl_steps):
        recent.append(_rl_step(s, model, rollout, tok, opt, scope, train_set[i * s.prompts:(i + 1) * s.prompts], cfg))
        if (i + 1) % max(1, s.rl_steps // 4) == 0:
            say(f"  RL step {i + 1}/{s.rl_steps}: training reward {sum(recent) / len(recent):.1%} "
                f"(last {len(recent)} steps)", flush=True)
            recent.clear()
    with scope.phase("eval"):
        out["rl"] = accuracy(model, tok, held_out, cfg.max_new_tokens)
    scope.log(**{"eval/accuracy": out["rl"]})
    save_weights(model, run_dir / FINAL_FILE)
    say(f"RL done: held-out accuracy {out['rl']:.1%}", flush=True)

    # AlphaRL: rank-1 replacement of RL's update, evaluated on the rollout copy (not the probed model).
    with scope.phase("alpharl"):
        alpharl_rank1(run_dir / THETA0_FILE, run_dir / FINAL_FILE, run_dir / RANK1_FILE, rest="base",
                      other_rest_path=run_dir / RANK1_REST_RL_FILE)  # one SVD per weight for both variants
        for key, name in (("rank1", RANK1_FILE), ("rank1_rest_rl", RANK1_REST_RL_FILE)):
            load_weights(rollout, run_dir / name)
            out[key] = accuracy(rollout, tok, held_out, cfg.max_new_tokens)
    scope.log(**{f"alpharl/{k}_accuracy": v for k, v in out.items()})
    say(f"AlphaRL rank-1 replacement: held-out accuracy {out['rank1']:.1%} (rest at base), "
        f"{out['rank1_rest_rl']:.1%} (rest with RL's update)", flush=True)
    scope.close()
    return out


def run_smollm2(run_dir: str | Path, steps: int | None = None, device: str = "cpu", seed: int = 0,
                console: Any = None) -> Path:
    """``dynascope demo --model smollm2``: check the install, train into ``run_dir``, print the report."""
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
                     **({} if steps is None else {"rl_steps": steps}))
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "demo_settings.json").write_text(s.to_json())
    console.print(f"[bold]dynascope demo --model smollm2[/] → {run_dir}", highlight=False)
    t0 = time.perf_counter()
    train(s, say=print)
    print_reproduction(s, console, train_s=time.perf_counter() - t0)
    return run_dir
