"""A few steps of a small MLP, optionally under ``watch()``, appending 50 scalars per step to a writer."""

from __future__ import annotations

import numpy as np
import torch

import dynascope


def tiny_training(steps, scope=None, writer=None, on_step=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if scope is not None:
        scope = dynascope.watch(model, opt, run=writer.run_dir, writer=writer, system_interval_s=None)
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        writer.append("scalars", {"step": step, "key": [f"fault/m{i}" for i in range(50)], "value": np.full(50, loss.item())})
        if on_step:
            on_step(step)
    if scope is not None:
        scope.close()
    return steps
