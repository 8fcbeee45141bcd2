"""Lightning's own launcher, 2 CPU processes over gloo, started as a user starts it (``python train.py``;
Lightning re-runs the script for rank 1), under ``strategy="ddp"`` and under ``ModelParallelStrategy``
(FSDP2: ``fully_shard`` in ``configure_model``).

Each rank records exactly one ``forward``, one ``backward``, one ``optimizer`` and one ``train`` row per
step, as on one device, though Lightning routes ``training_step`` through the wrapper's forward. The
statistics are held against the weights themselves: each rank saves every parameter (whole:
``full_tensor()`` under FSDP2) before and after each optimizer step, and ``tensor_stats_global`` must give
those tensors' ‖W‖, ‖ΔW‖ and changed counts.

Lightning's FSDP1 (``strategy="fsdp"``) and DeepSpeed strategies do not run on CPU (docs/integrations.md
says why); they are not tested here.
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
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.tensor import DTensor
    from dynascope.integrations.lightning import DynascopeCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            self.truth, self._old = [], None

        def configure_model(self):
            if STRATEGY == "fsdp2":
                from torch.distributed.fsdp import fully_shard
                mesh = self.device_mesh["data_parallel"]
                fully_shard(self.net[0], mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self(x), y)

        def on_before_optimizer_step(self, optimizer):
            self._old = {n: whole(p).clone() for n, p in self.named_parameters()}

        def on_train_batch_end(self, outputs, batch, batch_idx):
            new = {n: whole(p) for n, p in self.named_parameters()}
            self.truth.append({n: [float(new[n].double().norm()), float((new[n].double() - o.double()).norm()),
                                   int((new[n] != o).sum())] for n, o in self._old.items()})

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def whole(p):  # an FSDP2 shard gathered (every rank calls it, in the same order)
        return p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    run, STRATEGY = sys.argv[1], sys.argv[2]
    module = Module()
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if STRATEGY == "fsdp2" else "ddp"
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=2, strategy=strategy, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[DynascopeCallback(run=run, system_interval_s=None, memory_budget=None)],
                         default_root_dir=run + ".root", log_every_n_steps=1)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    json.dump(module.truth, open(f"{run}.truth{trainer.global_rank}.json", "w"))
""")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_lightning_two_processes(tmp_path: Path, strategy: str) -> None:
    script, run = tmp_path / "train.py", tmp_path / "lit"
    script.write_text(SCRIPT)
    env = {**os.environ, "PL_DISABLE_FORK": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(script), str(run), strategy], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    truth = [json.loads((tmp_path / f"lit.truth{r}.json").read_text()) for r in (0, 1)]
    assert truth[0] == truth[1]  # both ranks hold (or gather) the same weights after every step
    with dynascope.open_store(run) as con:
        phases = con.rows("SELECT rank, step, phase, parent, count(*) FROM timings WHERE phase IN "
                          "('forward', 'backward', 'optimizer', 'train') GROUP BY ALL ORDER BY ALL")
        got = con.frame("SELECT * FROM tensor_stats_global ORDER BY step, tensor").to_dicts()
        ranks = con.rows("SELECT rank, world_size, framework FROM runs ORDER BY rank")
    # automatic optimization: training_step and backward run in optimizer.step(closure), inside optimizer
    assert phases == [(r, s, p, parent, 1) for r in (0, 1) for s in range(4) for p, parent in
                      (("backward", "optimizer"), ("forward", "optimizer"), ("optimizer", "train"), ("train", None))]
    assert [r[1:] for r in ranks] == [(2, "lightning")]  # written once, by whichever rank created the run
    assert len(got) == 4 * 4  # one row per tensor and step: DDP's copies count once, FSDP2's shards combine
    assert {r["shards"] for r in got} == {1 if strategy == "ddp" else 2}
    for r in got:
        w_norm, update_norm, changed = truth[0][r["step"]][r["tensor"]]
        assert r["w_norm"] == pytest.approx(w_norm, rel=1e-6), r
        assert r["update_norm"] == pytest.approx(update_norm, rel=1e-6), r
        assert r["changed_count"] == changed, r
