"""PyTorch Lightning: a 5-step fit with DynascopeCallback; rows asserted."""

from __future__ import annotations

import pytest
import torch

import dynascope

pl = pytest.importorskip("lightning.pytorch")

from dynascope.integrations.lightning import DynascopeCallback  # noqa: E402


class _Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.grad_norms: list[dict[str, float]] = []  # this step's ‖g‖ per tensor, seen after backward

    def on_after_backward(self) -> None:
        self.grad_norms.append({n: float(p.grad.norm()) for n, p in self.named_parameters()})

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    y = x.sum(dim=1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _q(run, sql):
    with dynascope.open_store(run) as con:
        return con.sql(sql).fetchall()


@pytest.mark.slow
def test_lightning_five_steps(tmp_path):
    run = tmp_path / "lit"
    callback = DynascopeCallback(run=str(run), system_interval_s=None, stage="sft")
    trainer = pl.Trainer(max_steps=5, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         callbacks=[callback], default_root_dir=str(tmp_path))
    module = _Regressor()
    trainer.fit(module, _loader())
    assert callback.scope is None

    n_params = len(list(module.parameters()))
    assert _q(run, "SELECT count(DISTINCT step), min(step), max(step), count(*) FROM tensor_stats") == [
        (5, 0, 4, 5 * n_params)]
    assert _q(run, "SELECT count(*) FROM tensor_stats WHERE grad_norm IS NULL OR NOT (update_ratio > 0 AND "
                   "grad_norm > 0)") == [(0,)]
    # the closure computes each step's gradients inside optimizer.step: the recorded ones are that step's
    got = _q(run, "SELECT step, tensor, grad_norm FROM tensor_stats ORDER BY step, tensor")
    assert [g for _, _, g in got] == pytest.approx([module.grad_norms[s][t] for s, t, _ in got], rel=1e-6)
    assert set(_q(run, "SELECT DISTINCT tensor FROM tensor_stats")) == {(n,) for n, _ in module.named_parameters()}
    phases = dict(_q(run, "SELECT phase, count(*) FROM timings GROUP BY phase"))
    assert phases["step"] == 5 and phases["train"] == 5 and phases["optimizer"] == 5
    assert phases["forward"] == 5 and phases["backward"] == 5
    # automatic optimization runs the closure (training_step, backward) inside optimizer.step
    assert _q(run, "SELECT DISTINCT phase, parent FROM timings WHERE phase IN ('forward', 'backward', 'optimizer') "
                   "ORDER BY phase") == [("backward", "optimizer"), ("forward", "optimizer"), ("optimizer", "train")]
    assert "training_step" not in vars(module)  # the instance wrapper is gone after fit
    # the logged metric, on dynascope's step numbering, equals what the module logged last
    losses = _q(run, "SELECT step, value FROM scalars WHERE key = 'train_loss' ORDER BY step")
    assert [s for s, _ in losses] == [0, 1, 2, 3, 4]
    assert losses[-1][1] == pytest.approx(float(trainer.callback_metrics["train_loss"]))
    assert _q(run, "SELECT framework, role, rank, world_size FROM runs") == [("lightning", "trainer", 0, 1)]


class _CallsItself(_Regressor):
    """training_step through the module's own forward, as Lightning's DDP wrapper routes it."""

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)


@pytest.mark.slow
def test_forward_through_the_module_is_timed_once(tmp_path):
    run = tmp_path / "lit"
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[DynascopeCallback(run=str(run), system_interval_s=None)],
                         default_root_dir=str(tmp_path))
    trainer.fit(_CallsItself(), _loader())
    phases = dict(_q(run, "SELECT phase, count(*) FROM timings GROUP BY phase"))
    assert phases["forward"] == 4 and phases["backward"] == 4  # one of each per step, not the probe's beside
