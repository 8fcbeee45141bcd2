"""A small model with the awkward cases real models have, trained under ``watch()`` beside a naive
per-tensor truth; and rows of a run as dicts."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

import dynascope

from helpers.naive_stats import naive_grad, naive_update


class Awkward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.mid = nn.Linear(8, 8)
        self.lowp = nn.Linear(8, 8).to(torch.bfloat16)
        self.frozen = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)        # in the optimizer, never in the graph: no grad
        self.empty = nn.Parameter(torch.empty(0))
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.embed(x)))
        h = self.lowp(h.bfloat16()).float() + self.frozen(h) + self.empty.sum()
        return self.head(h)


def train(run: Path, steps: int, **kw) -> tuple[list[dict], nn.Module]:
    torch.manual_seed(0)
    model = Awkward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    names = {id(p): n for n, p in model.named_parameters()}
    scope = dynascope.watch(model, opt, run=run, system_interval_s=None, **kw)
    truth: list[dict] = []
    theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(steps):
        x = torch.randint(0, 32, (4, 6))
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        old = {names[id(p)]: p.detach().clone() for g in opt.param_groups for p in g["params"]}
        grads = {names[id(p)]: None if p.grad is None else p.grad.clone()
                 for g in opt.param_groups for p in g["params"]}
        opt.step()
        opt.zero_grad()
        new = {n: p.detach() for n, p in model.named_parameters()}
        truth.append({n: (naive_update(new[n], old[n]), naive_grad(grads[n]) if grads[n] is not None else None,
                          naive_update(new[n], theta0[n])) for n in old})
    scope.close()
    return truth, model


def rows(run: Path, sql: str) -> list[dict]:
    con = dynascope.open_store(run)
    return con.sql(sql).pl().to_dicts()
