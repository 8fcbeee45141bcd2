"""The probe's forward/backward timing against outputs the way trainers use them: backward through any
tensor of the output (TRL's fused LM head returns a ``loss`` first and backpropagates its ``log_probs``),
and no forward rows while an integration has paused the model hooks (TRL's decoding loop)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

import dynascope


class FusedHead(nn.Module):
    """Returns ``{"loss", "log_probs"}`` like TRL's fused LM head: the caller's loss uses ``log_probs`` only."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        log_probs = torch.log_softmax(self.net(x), dim=-1)
        return {"loss": -log_probs.sum(), "log_probs": log_probs}


def test_backward_through_a_later_output_and_paused_forwards(tmp_path: Path) -> None:
    model = FusedHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "fused"
    with dynascope.watch(model, opt, run=run, system_interval_s=None, time_budget=None) as scope:
        for _ in range(3):
            scope.timing.model_paused += 1
            with scope.phase("generate"), torch.no_grad():
                for _ in range(5):  # one forward per decoded token: covered by generate, no rows of their own
                    model(torch.randn(2, 8))
            scope.timing.model_paused -= 1
            with scope.phase("train"):
                out = model(torch.randn(2, 8))
                (-out["log_probs"][:, 0].mean()).backward()  # out["loss"] is never backpropagated
                opt.step()
                opt.zero_grad()
    with dynascope.open_store(run) as con:
        got = con.rows("SELECT step, phase, parent, count(*) FROM timings WHERE phase IN "
                       "('forward', 'backward', 'generate') GROUP BY ALL ORDER BY ALL")
    assert got == [(s, p, parent, 1) for s in range(3)
                   for p, parent in (("backward", "train"), ("forward", "train"), ("generate", None))]
