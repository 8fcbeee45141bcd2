"""The HF ``Trainer`` under ``accelerate launch`` with 2 processes (``--multi_gpu`` on a CPU-only machine runs
MULTI_CPU through torchrun over gloo; ``--cpu --num_processes 2`` would start one process without mpirun).

Each rank saves every parameter before and after each optimizer step (``on_pre_optimizer_step`` /
``on_optimizer_step``); ``tensor_stats_global`` must give those tensors' ‖W‖, ‖ΔW‖ and changed counts at
every step, with one ``train``, ``forward``, ``backward`` and ``optimizer`` row per step per rank.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

import dynascope

from helpers.accelerate_launch import accelerate_launch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = textwrap.dedent("""
    import json, os, sys, torch, transformers
    from dynascope.integrations.hf import DynascopeCallback

    class Truth(transformers.TrainerCallback):
        def __init__(self):
            self.steps, self._old = [], None
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            self._old = {n: p.detach().clone() for n, p in model.named_parameters()}
        def on_optimizer_step(self, args, state, control, model=None, **kw):
            new = {n: p.detach() for n, p in model.named_parameters()}
            self.steps.append({n: [float(new[n].double().norm()), float((new[n].double() - o.double()).norm()),
                                   int((new[n] != o).sum())] for n, o in self._old.items()})

    run = sys.argv[1]
    transformers.set_seed(0)
    cfg = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (32, 12), generator=g)
    data = [{"input_ids": x, "labels": x} for x in ids]
    truth = Truth()
    args = transformers.TrainingArguments(output_dir=run + ".out", max_steps=3, per_device_train_batch_size=4,
                                          logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                                          dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   callbacks=[truth, DynascopeCallback(run=run, system_interval_s=None,
                                                                       memory_budget=None)])
    trainer.train()
    json.dump(truth.steps, open(f"{run}.truth{int(os.environ['RANK'])}.json", "w"))
""")


@pytest.mark.slow
def test_hf_trainer_under_accelerate_launch(tmp_path: Path) -> None:
    script, run = tmp_path / "train.py", tmp_path / "hf"
    script.write_text(SCRIPT)
    out = accelerate_launch(script, str(run), cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    truth = [json.loads((tmp_path / f"hf.truth{r}.json").read_text()) for r in (0, 1)]
    assert truth[0] == truth[1] and len(truth[0]) == 3  # DDP: the same weights on both ranks
    with dynascope.open_store(run) as con:
        phases = con.rows("SELECT rank, step, phase, parent, count(*) FROM timings WHERE phase IN "
                          "('train', 'optimizer', 'forward', 'backward') GROUP BY ALL ORDER BY ALL")
        got = con.frame("SELECT * FROM tensor_stats_global ORDER BY step, tensor").to_dicts()
        world = con.rows("SELECT DISTINCT world_size FROM runs")
    assert world == [(2,)]
    # one forward and one backward per step, inside train, though DDP's wrapper runs the module's forward
    assert phases == [(r, s, p, parent, 1) for r in (0, 1) for s in range(3)
                      for p, parent in (("backward", "train"), ("forward", "train"), ("optimizer", None), ("train", None))]
    names = set(truth[0][0])
    assert {r["tensor"] for r in got} <= {n.removeprefix("module.") for n in names} and len(got) >= 3 * 4
    for r in got:
        step = {n.removeprefix("module."): v for n, v in truth[0][r["step"]].items()}
        w_norm, update_norm, changed = step[r["tensor"]]
        assert r["w_norm"] == pytest.approx(w_norm, rel=1e-6), r["tensor"]
        assert r["update_norm"] == pytest.approx(update_norm, rel=1e-6), r["tensor"]
        assert r["changed_count"] == changed, r["tensor"]
