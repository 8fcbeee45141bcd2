"""FSDP2 (``fully_shard``) on 2 gloo ranks on CPU: probes record local shards (``sharded=True``) and
``tensor_stats_global`` rebuilds each tensor's global statistics, checked against the full tensors."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import polars as pl
import pytest

import dynascope

from helpers.naive_stats import assert_row_matches
from helpers.torchrun import torchrun

WORKER = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist, torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    import dynascope
    from helpers.naive_stats import naive_update, naive_grad
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scope = dynascope.watch(model, opt, run=sys.argv[1], system_interval_s=None, memory_budget=None)
    theta0 = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    truth = []
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(2):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        old = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        new = {n: p.full_tensor() for n, p in model.named_parameters()}
        truth.append({n: [naive_update(new[n], old[n]), naive_grad(grads[n]), naive_update(new[n], theta0[n])]
                      for n in new})
    scope.close()
    if dist.get_rank() == 0:
        json.dump(truth, open(sys.argv[1] + ".truth.json", "w"))
    # under a memory budget, with tensors that do not split evenly (33 and 17 rows over 2 ranks)
    model = nn.Sequential(nn.Linear(7, 33), nn.ReLU(), nn.Linear(33, 17), nn.ReLU(), nn.Linear(17, 3))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    timed = dynascope.watch(model, opt, run=sys.argv[1] + "-timed", system_interval_s=None, memory_budget=0.4)
    # the time budget's agreement group is made by watch(), never lazily inside a training step
    assert timed.stats.window._agreement._group is not None
    timed.close()
    scope = dynascope.watch(model, opt, run=sys.argv[1] + "-budget", system_interval_s=None, memory_budget=0.4,
                            time_budget=None)
    for _ in range(4):
        model(torch.randn(4, 7)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    scope.close()
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One torchrun launch for the module's tests: the run, and beside it ``<run>-budget``."""
    tmp = tmp_path_factory.mktemp("fsdp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
        torchrun(tmp, WORKER, tmp / "fsdp")
    return tmp / "fsdp"


@pytest.mark.slow
def test_fsdp2_shards_combine_to_global_stats(fsdp_run: Path) -> None:
    run = fsdp_run
    truth = json.loads(Path(str(run) + ".truth.json").read_text())
    con = dynascope.open_store(run)
    raw = con.sql("select * from tensor_stats").pl()
    assert set(raw["rank"].to_list()) == {0, 1} and raw["sharded"].all()
    # each rank holds half of the 16-row weight: local numel, not the global one
    w0 = raw.filter(raw["tensor"] == "0.weight")
    assert sorted(set(w0["numel"].to_list())) == [64] and w0["shape"][0] == "16x8"
    out = con.sql("select * from tensor_stats_global").pl()  # the canonical view pools the shards
    assert out.height == 2 * 4 and set(out["shards"].to_list()) == {2}
    for r in out.to_dicts():
        assert_row_matches(r, *truth[r["step"]][r["tensor"]])


@pytest.mark.slow
def test_fsdp2_budgeted_windows_combine(fsdp_run: Path) -> None:
    """Under a memory budget both ranks take the same tensors at the same records, uneven shards too
    (every rank sizes a shard as its tensor's largest), so each windowed statistic has both shards."""
    raw = dynascope.open_store(Path(str(fsdp_run) + "-budget")).sql("select * from tensor_stats").pl()
    per = raw.group_by("step", "tensor").agg(pl.col("update_norm").count().alias("n"))
    assert set(per["n"].to_list()) == {0, 2}, per.sort("step", "tensor").to_dicts()  # a window, never half of one
    taken = per.filter(pl.col("n") == 2).group_by("step").len()
    assert taken.height == 4  # a window at every record
