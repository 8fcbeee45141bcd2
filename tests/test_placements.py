"""HSDP and tensor parallel under real torchrun (gloo, CPU ranks): each row records its place on the mesh,
replicas count once, shards combine within a replica, and the combined statistics equal the ones computed
from the full tensors (``full_tensor()``) of the same run."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

import dynascope
from dynascope.store.pooling import counted_sql

from helpers.naive_stats import assert_row_matches
from helpers.torchrun import torchrun

# One worker for every layout: argv[2] names it. The truth is computed on rank 0 from full tensors.
WORKER = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist, torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    import dynascope
    from helpers.naive_stats import naive_update, naive_grad
    dist.init_process_group("gloo")
    layout, world = sys.argv[2], dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if layout.startswith("hsdp"):
        from torch.distributed.fsdp import fully_shard
        shape = (2, world // 2)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        torch.manual_seed(1 + dist.get_rank())  # each rank its own batch: the replicas' gradients average
    elif layout == "2d":  # FSDP2 over "dp" on top of tensor parallel over "tp" (torchtitan's 2-D layout)
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        torch.manual_seed(1 + dist.get_rank() // (world // 2))  # one batch per TP group, its own per dp rank
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        torch.manual_seed(1)  # tensor parallel: every rank sees the same batch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scope = dynascope.watch(model, opt, run=sys.argv[1], system_interval_s=None, memory_budget=None)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
    theta0 = {n: full(p).clone() for n, p in model.named_parameters()}
    truth = []
    for _ in range(2):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        old = {n: full(p).clone() for n, p in model.named_parameters()}
        grads = {n: full(p.grad).clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        new = {n: full(p) for n, p in model.named_parameters()}
        truth.append({n: [naive_update(new[n], old[n]), naive_grad(grads[n]), naive_update(new[n], theta0[n]),
                          new[n].numel()] for n in new})
    scope.close()
    if dist.get_rank() == 0:
        json.dump(truth, open(sys.argv[1] + ".truth.json", "w"))
    dist.destroy_process_group()
""")


def _launch(tmp: Path, layout: str, nproc: int) -> Path:
    run = tmp / layout
    torchrun(tmp, WORKER.replace("sys.argv[2]", repr(layout)), run, nproc=nproc)
    return run


def _check_against_full_tensors(run: Path) -> dict:
    truth = json.loads(Path(str(run) + ".truth.json").read_text())
    with dynascope.open_store(run) as con:
        raw = con.frame("SELECT * FROM tensor_stats")
        out = con.frame("SELECT * FROM tensor_stats_global")  # the canonical view: replicas once
    assert out.height == 2 * 4
    for r in out.to_dicts():
        upd, grad, drift, numel = truth[r["step"]][r["tensor"]]
        assert r["numel"] == numel, r["tensor"]
        assert_row_matches(r, upd, grad, drift)
    # The SQL readers' rule (store.pooling) counts the same elements: the model's, once.
    with dynascope.open_store(run) as con:
        counted = con.rows(f"""SELECT step, sum(numel) FROM (SELECT *, min(rank) OVER (PARTITION BY step, tensor)
                               AS first_rank FROM tensor_stats) WHERE {counted_sql('first_rank')} GROUP BY step""")
    assert {n for _, n in counted} == {sum(v[3] for v in truth[0].values())}
    return {(r["tensor"], r["rank"]): r for r in raw.filter(raw["step"] == 0).to_dicts()}


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "nproc"), [("hsdp-2x1", 2), ("hsdp-2x2", 4)])
def test_hsdp_replicas_count_once(tmp_path: Path, layout: str, nproc: int) -> None:
    rows = _check_against_full_tensors(_launch(tmp_path, layout, nproc))
    mesh = "2x1" if nproc == 2 else "2x2"
    for (tensor, rank), r in rows.items():
        # mesh rank = replicate coordinate * shard size + shard coordinate
        assert (r["mesh"], r["sharded"], r["replica"]) == (mesh, True, rank // (nproc // 2)), (tensor, rank)
        assert r["shard"] == str(rank % (nproc // 2))


@pytest.mark.slow
def test_tensor_parallel_shards_and_a_replicated_bias(tmp_path: Path) -> None:
    rows = _check_against_full_tensors(_launch(tmp_path, "tp", 2))
    # Colwise shards the first layer's weight and bias on dim 0; Rowwise the second's weight on dim 1, and
    # leaves its bias replicated: a whole tensor on each rank, counted once.
    for rank in (0, 1):
        assert rows[("0.weight", rank)]["sharded"] and rows[("0.weight", rank)]["numel"] == 64
        assert rows[("2.weight", rank)]["sharded"] and rows[("2.weight", rank)]["shard"] == str(rank)
        bias = rows[("2.bias", rank)]
        assert (bias["sharded"], bias["replica"], bias["numel"], bias["mesh"]) == (False, rank, 4, "2")


@pytest.mark.slow
def test_fsdp2_over_tensor_parallel(tmp_path: Path) -> None:
    """2-D: each parameter is a DTensor on the (dp, tp) mesh. The row-parallel bias is sharded by FSDP
    over dp and replicated over tp: its rows on the second TP rank are replicas and count once."""
    rows = _check_against_full_tensors(_launch(tmp_path, "2d", 4))
    for rank in range(4):
        assert rows[("0.weight", rank)]["sharded"] and rows[("0.weight", rank)]["mesh"] == "2x2"
        bias = rows[("2.bias", rank)]
        assert bias["sharded"] and bias["replica"] == rank % 2, (rank, bias)


def test_kl_finding_reads_drift_over_the_rows_that_carry_it(tmp_path: Path) -> None:
    """Under a memory budget only the window's tensors carry drift: the finding's share of changed elements
    is over those, not over every row of the step (a covered tensor that changed everywhere reads 100%)."""
    from dynascope.analyses.findings_sql import kl_to_base_sql
    from dynascope.store import RunWriter

    w = RunWriter(tmp_path / "run", flush_secs=60)
    w.append("tensor_stats", {"step": 5, "stage": "rl", "tensor": ["a", "b"], "numel": [100, 900],
                              "w_norm": [2.0, 6.0], "drift_norm": [1.0, None], "drift_zero_count": [0, None]})
    w.append("scalars", {"step": [1, 5, 1, 5], "key": ["eval/forward_kl_sft_nats"] * 2 + ["eval/forward_kl_pretrained_nats"] * 2,
                         "value": [0.0, 0.2, 0.1, 0.3], "time_us": 1, "stage": "rl"})
    run_id = w.run_id
    w.close()
    with dynascope.open_store(tmp_path / "run") as con:
        (row,) = con.rows(kl_to_base_sql(run_id))
    *_, drift_ratio, changed_pct = row
    assert changed_pct == pytest.approx(100.0) and drift_ratio == pytest.approx(0.5)  # ‖ΔW‖/‖W‖ of tensor a
