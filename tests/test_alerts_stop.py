"""An alert rule's stop action ends the HF Trainer and a Lightning fit, cleanly and within one step of the
request: at most one step starts after the alert's event was written, and the run's rows are all there."""

from __future__ import annotations

import os

import pytest
import torch

import dynascope
from dynascope.alerts import Rule

os.environ["HF_HUB_OFFLINE"] = "1"
MAX_STEPS = 100_000  # the stop must end the run, not max_steps


@pytest.fixture(autouse=True)
def _fast_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default writer flushes every 10 s; the rule sees rows once flushed. A short flush keeps the tiny
    # runs short; what is tested is the chain from a flushed row to the trainer's end.
    monkeypatch.setattr("dynascope.probes.attach.WRITER_FLUSH_S", 0.1)


def _after_request(run) -> tuple[int, int, int]:
    """(steps started after the alert's event, steps recorded, alert events)."""
    with dynascope.open_store(run) as con:
        (t_alert, n_alerts), = con.rows("SELECT min(time_us), count(*) FROM events WHERE event = 'alert'")
        (after, steps), = con.rows(f"SELECT count(*) FILTER (WHERE start_us > {int(t_alert or 0)}), count(*) "
                                   "FROM timings WHERE category = 'step'")
    return after, steps, n_alerts


RULES = [Rule("loss", "> 0", action="stop", hold_down=MAX_STEPS)]  # fires on the first judged step


@pytest.mark.slow
def test_stop_ends_the_hf_trainer(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    from dynascope.integrations.hf import DynascopeCallback

    transformers.set_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=16,
                                                                 n_layer=1, n_head=2))
    ids = torch.randint(0, 16, (32, 8)).tolist()
    ds = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                                          max_steps=MAX_STEPS, logging_steps=1, report_to=[], use_cpu=True,
                                          save_strategy="no", disable_tqdm=True)
    run = tmp_path / "hf"
    callback = DynascopeCallback(run=str(run), system_interval_s=None, alerts=RULES, alert_interval_s=0.05)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback])
    trainer.train()
    after, steps, alerts = _after_request(run)
    assert trainer.state.global_step < MAX_STEPS and alerts == 1
    assert after <= 1 and steps == trainer.state.global_step


class _Regressor:
    """A LightningModule built on first use (lightning is imported only by the test that needs it)."""

    @staticmethod
    def make():
        pl = pytest.importorskip("lightning.pytorch")

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = torch.nn.Linear(6, 1)

            def training_step(self, batch, batch_idx):
                x, y = batch
                loss = torch.nn.functional.mse_loss(self.net(x), y)
                self.log("loss", loss, on_step=True)
                return loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=1e-3)

        return pl, Module()


@pytest.mark.slow
def test_stop_ends_a_lightning_fit(tmp_path) -> None:
    pl, module = _Regressor.make()
    from dynascope.integrations.lightning import DynascopeCallback

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    run = tmp_path / "lit"
    callback = DynascopeCallback(run=str(run), system_interval_s=None, alerts=RULES, alert_interval_s=0.05)
    trainer = pl.Trainer(max_steps=MAX_STEPS, max_epochs=-1, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1, callbacks=[callback], default_root_dir=str(tmp_path))
    trainer.fit(module, loader)
    after, steps, alerts = _after_request(run)
    assert trainer.global_step < MAX_STEPS and alerts == 1
    assert after <= 1 and steps == trainer.global_step
