"""Lightning's own DDP launcher, 2 CPU processes over gloo: ``Trainer(strategy="ddp", devices=2)`` started
as a user starts it (``python train.py``; Lightning re-runs the script for rank 1).

Each rank records exactly one ``forward``, one ``backward``, one ``optimizer`` and one ``train`` row per
step, as on one device, though Lightning routes ``training_step`` through DDP's forward. The statistics are
held against the weights themselves: each rank saves every parameter before and after each optimizer
step, and ``tensor_stats_global`` must give those tensors' ‖W‖, ‖ΔW‖ and changed counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dynascope

pytest.importorskip("lightning.pytorch")

SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import lightning.pytorch as pl
    from dynascope.integrations.lightning import DynascopeCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            self.truth, self._old = [], None

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self(x), y)

        def on_before_optimizer_step(self, optimizer):
            self._old = {n: p.detach().clone() for n, p in self.named_parameters()}

        def on_train_batch_end(self, outputs, batch, batch_idx):
            new = {n: p.detach() for n, p in self.named_parameters()}
            self.truth.append({n: [float(new[n].double().norm()), float((new[n].double() - o.double()).norm()),
                                   int((new[n] != o).sum())] for n, o in self._old.items()})

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    run = sys.argv[1]
    module = Module()
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[DynascopeCallback(run=run, system_interval_s=None, memory_budget=None)],
                         default_root_dir=run + ".root", log_every_n_steps=1)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    json.dump(module.truth, open(f"{run}.truth{trainer.global_rank}.json", "w"))
""")


@pytest.mark.slow
def test_lightning_ddp_two_processes(tmp_path: Path) -> None:
    script, run = tmp_path / "train.py", tmp_path / "lit"
    script.write_text(SCRIPT)
    env = {**os.environ, "PL_DISABLE_FORK": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(script), str(run)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    truth = [json.loads((tmp_path / f"lit.truth{r}.json").read_text()) for r in (0, 1)]
    assert truth[0] == truth[1]  # DDP: both ranks hold the same weights after every step
    with dynascope.open_store(run) as con:
        phases = con.rows("SELECT rank, step, phase, count(*) FROM timings WHERE phase IN "
                          "('forward', 'backward', 'optimizer', 'train') GROUP BY ALL ORDER BY ALL")
        got = con.frame("SELECT * FROM tensor_stats_global ORDER BY step, tensor").to_dicts()
        ranks = con.rows("SELECT rank, world_size, framework FROM runs ORDER BY rank")
    assert phases == [(r, s, p, 1) for r in (0, 1) for s in range(4) for p in ("backward", "forward", "optimizer", "train")]
    assert [r[1:] for r in ranks] == [(2, "lightning")]  # written once, by whichever rank created the run
    assert len(got) == 4 * 4 and all(r["shards"] == 1 for r in got)  # DDP copies: one row per tensor and step
    for r in got:
        w_norm, update_norm, changed = truth[0][r["step"]][r["tensor"]]
        assert r["w_norm"] == pytest.approx(w_norm, rel=1e-6), r
        assert r["update_norm"] == pytest.approx(update_norm, rel=1e-6), r
        assert r["changed_count"] == changed, r
