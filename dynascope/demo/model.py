"""A tiny decoder-only transformer (pre-norm, learned positions) built from code, plus batched sampling.

Parameter names follow the Llama convention (``layers.N.attn.q_proj.weight`` …) so dynascope's tensor
classifier sees q/k/v/o/mlp/embed/head/norm exactly as it would on a real model. Prompts are left-padded
so every sequence's newest token sits in the last column during generation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dynascope.demo.task import EOS, PAD


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 14
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    max_seq: int = 40


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.attn_norm = nn.LayerNorm(d)
        self.attn = nn.ModuleDict({n: nn.Linear(d, d, bias=False) for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
        self.mlp_norm = nn.LayerNorm(d)
        self.mlp = nn.ModuleDict({"up_proj": nn.Linear(d, 4 * d), "down_proj": nn.Linear(4 * d, d)})

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (self.attn[n](h).view(b, t, self.n_heads, -1).transpose(1, 2) for n in ("q_proj", "k_proj", "v_proj"))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.attn["o_proj"](a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp["down_proj"](F.gelu(self.mlp["up_proj"](self.mlp_norm(x))))


class TinyLM(nn.Module):
    """Decoder-only LM: ``forward(ids, keep)`` → logits, where ``keep`` marks real (non-pad) tokens."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_positions = nn.Embedding(cfg.max_seq, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        if keep is None:
            keep = ids != PAD
        t = ids.shape[1]
        pos = (keep.long().cumsum(-1) - 1).clamp(min=0)  # left padding: positions count real tokens only
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        # Each query sees real keys at or before it, and always itself (so pad rows never go all-masked → NaN).
        mask = (causal & keep[:, None, :]) | torch.eye(t, dtype=torch.bool, device=ids.device)
        x = self.embed_tokens(ids) + self.embed_positions(pos)
        for layer in self.layers:
            x = layer(x, mask[:, None])
        logits = self.lm_head(self.norm(x))
        # <pad> is never a valid output; a large finite negative (not −inf) keeps entropy NaN-free.
        return logits.index_fill(-1, torch.tensor([PAD], device=ids.device), -1e9)


def left_pad(prompts: list[list[int]]) -> torch.Tensor:
    width = max(len(p) for p in prompts)
    out = torch.full((len(prompts), width), PAD, dtype=torch.long)
    for i, p in enumerate(prompts):
        out[i, width - len(p):] = torch.tensor(p)
    return out


@dataclass
class Rollout:
    """A generated batch: prompt (left-padded), response (PAD after <eos>) and per-sample timing."""

    prompt: torch.Tensor          # [B, P]
    response: torch.Tensor        # [B, R]
    response_mask: torch.Tensor   # [B, R] bool: tokens up to and including <eos>
    gen_start_us: int
    gen_end_us: list[int]         # when each sample emitted <eos> (or hit the length cap)

    @property
    def lengths(self) -> list[int]:
        return self.response_mask.sum(1).tolist()


@torch.no_grad()
def generate(model: TinyLM, prompts: list[list[int]], max_new: int, temperature: float = 1.0,
             gen: torch.Generator | None = None, extra_forward: Callable[[torch.Tensor], None] | None = None) -> Rollout:
    """Sample responses for ``prompts`` (greedy when ``temperature == 0``).

    The batch runs until every sample has emitted <eos>, so one long response holds the whole batch:
    that is the synchronous long tail. ``extra_forward`` (the slow-rank knob) gets each step's input.
    """
    start = time.time_ns() // 1000
    ids = left_pad(prompts)
    b = ids.shape[0]
    done = torch.zeros(b, dtype=torch.bool)
    end_us = [0] * b
    out = []
    for _ in range(max_new):
        logits = model(ids)[:, -1]
        if extra_forward is not None:
            extra_forward(ids)
        if temperature > 0:
            nxt = torch.multinomial(F.softmax(logits / temperature, -1), 1, generator=gen).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
        out.append(nxt)
        ids = torch.cat([ids, nxt[:, None]], 1)
        now = time.time_ns() // 1000
        for i in (~done & (nxt == EOS)).nonzero().flatten().tolist():
            end_us[i] = now
        done |= nxt == EOS
        if bool(done.all()):
            break
    now = time.time_ns() // 1000
    end_us = [e or now for e in end_us]
    resp = torch.stack(out, 1)
    return Rollout(prompt=ids[:, : ids.shape[1] - resp.shape[1]], response=resp, response_mask=resp != PAD,
                   gen_start_us=start, gen_end_us=end_us)


def token_logprobs(model: nn.Module, r: Rollout, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of each response token under ``model`` ([B, R]); optionally the entropy per token."""
    ids = torch.cat([r.prompt, r.response], 1)
    keep = torch.cat([r.prompt != PAD, r.response_mask], 1)
    logits = model(ids, keep)[:, r.prompt.shape[1] - 1 : -1].float()
    logp = F.log_softmax(logits, -1)
    tok = logp.gather(-1, r.response.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return tok, ent
