"""Real torchrun, 2 gloo ranks on CPU, DDP: both ranks' rows land, timing rows carry the right ranks."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import dynascope

from helpers.torchrun import torchrun

WORKER = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, torch.nn as nn
    import dynascope
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scope = dynascope.watch(model, opt, run=sys.argv[1], system_interval_s=0.05, memory_budget=None)
    torch.manual_seed(1 + dist.get_rank())  # different data per rank
    for _ in range(3):
        with scope.phase("train"):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    scope.close()
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_ddp_two_ranks(tmp_path: Path) -> None:
    run = tmp_path / "ddp"
    torchrun(tmp_path, WORKER, run)
    con = dynascope.open_store(run)
    q = lambda sql: con.sql(sql).pl().to_dicts()  # noqa: E731
    stats = q("select rank, count(*) as n, count(distinct step) as steps from tensor_stats group by rank "
              "order by rank")
    assert [(r["rank"], r["n"], r["steps"]) for r in stats] == [(0, 12, 3), (1, 12, 3)]
    names = {r["tensor"] for r in q("select distinct tensor from tensor_stats")}
    assert names == {"0.weight", "0.bias", "2.weight", "2.bias"}  # DDP's module. prefix is not recorded
    # DDP all-reduces gradients and keeps replicas in sync: both ranks see the same update
    same = q("select count(*) as n from tensor_stats a join tensor_stats b using (step, tensor) "
             "where a.rank = 0 and b.rank = 1 and abs(a.update_norm - b.update_norm) <= 1e-6 * a.update_norm "
             "and abs(a.grad_norm - b.grad_norm) <= 1e-5 * a.grad_norm")
    assert same[0]["n"] == 12
    t = q("select rank, phase, count(*) as n from timings group by rank, phase order by rank, phase")
    got = {(r["rank"], r["phase"]): r["n"] for r in t}
    for rank in (0, 1):
        for phase in ("step", "forward", "backward", "optimizer", "train"):
            assert got[(rank, phase)] == 3, (rank, phase, got)
    parents = q("select distinct rank, parent from timings where phase = 'backward'")
    assert {(r["rank"], r["parent"]) for r in parents} == {(0, "train"), (1, "train")}
    assert {r["rank"] for r in q("select distinct rank from system")} == {0, 1}
    assert q("select max(world_size) as ws from runs")[0]["ws"] == 2
