"""A model spread over two devices in one process (host and accelerator, as ``device_map="auto"`` with
offloaded layers places it) records every tensor's statistics, held against float64 references.

It needs an accelerator: this machine's host alone has one device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import dynascope

from helpers.probe_runs import rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device beside the host")


class _Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(64, 64)  # on the host
        self.second = nn.Linear(64, 8).cuda()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)).cuda())


def test_split_model_records_every_tensor(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Split()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    names = {id(p): n for n, p in model.named_parameters()}
    grads: list[dict[str, float]] = []
    weights: list[dict[str, float]] = []
    opt.register_step_pre_hook(lambda o, a, k: grads.append(
        {names[id(p)]: float(p.grad.double().norm()) for p in model.parameters()}))
    opt.register_step_post_hook(lambda o, a, k: weights.append(
        {names[id(p)]: float(p.detach().double().norm()) for p in model.parameters()}))
    run = tmp_path / "split"
    with dynascope.watch(model, opt, run=run, system_interval_s=None, memory_budget=None, time_budget=None):
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(16, 64)).pow(2).mean().backward()
            opt.step()
    got = rows(run, "select step, tensor, grad_norm, w_norm, update_norm, grad_near_zero_count from tensor_stats")
    assert len(got) == 3 * 4
    for r in got:
        assert r["grad_norm"] == pytest.approx(grads[r["step"]][r["tensor"]], rel=1e-6), r
        assert r["w_norm"] == pytest.approx(weights[r["step"]][r["tensor"]], rel=1e-6), r
        assert r["update_norm"] > 0 and r["grad_near_zero_count"] is not None
    assert "probe_error" not in {r["event"] for r in rows(run, "select event from events")}
