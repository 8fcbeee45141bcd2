"""DeepSpeed ZeRO-1/2/3 on 2 gloo ranks (real DeepSpeed, CPU): every statistic of every tensor at every
step, combined from the ranks' partial rows, equals a single-process run of the probe over the same fp32
masters and gradients; the fp32 masters equal plain torch training; the step boundary is the engine's.

One torchrun launch runs every case (``tests/helpers/deepspeed_worker.py``): DeepSpeed's start-up is most of it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import torch

import dynascope
from dynascope.core.net import free_port
from dynascope.store.schema import TENSOR_STATS_COLUMNS

pytest.importorskip("deepspeed")

from helpers import deepspeed_worker as worker  # noqa: E402

HERE = Path(__file__).resolve().parent

# Row metadata compared as equal values; every other registry column as a statistic.
META = ("tensor", "layer", "kind", "shape", "dtype", "numel")
SKIP = ("sharded",)
# Statistics declared outside dynascope, recorded by the workers only (this process's registry is fixed).
USER_STATS = "helpers.user_statistics"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("deepspeed")
    path = os.pathsep.join(p for p in (str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, HF_HUB_OFFLINE="1", DYNASCOPE_STATISTICS=USER_STATS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(HERE / "helpers" / "deepspeed_worker.py"),
           str(out), *worker.CASES, "z3-no-optimizer", "hf-z2", "hf-z3", "planted-period"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


def reference_rows(record: dict, run: Path, **kw: object) -> pl.DataFrame:
    """The probe in one process over whole tensors: θ₀ at watch(), then per step the gradients the
    optimizer stepped with and the masters after the step, closed by scope.step()."""
    model = worker.build_model()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(record["theta0"][n])
    scope = dynascope.watch(model, None, run=run, system_interval_s=None, **kw)
    for grads, weights in zip(record["grads"], record["weights"], strict=True):
        with torch.no_grad():
            for n, p in params.items():
                p.grad = grads[n].clone()
                p.copy_(weights[n])
        scope.step()
    scope.close()
    return dynascope.open_store(run).sql("select * from tensor_stats").pl()


def assert_rows_equal(got: dict, want: dict, where: str) -> None:
    for col in TENSOR_STATS_COLUMNS:
        a, b = got.get(col.name), want.get(col.name)
        if col.name in SKIP:
            continue
        if col.name in META or not isinstance(b, float) or a is None or b is None:
            assert a == b, (where, col.name, a, b)
        else:
            assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12), (where, col.name, a, b)


def events(run: Path) -> pl.DataFrame:
    return dynascope.open_store(run).sql("select event, message, rank from events").pl()


def plain_torch_weights(gas: int) -> list[dict[str, torch.Tensor]]:
    """The same training in one process with torch's AdamW: each step's gradient is the mean over the
    ranks' and micro-batches' gradients (what DeepSpeed's reduction and loss scaling compute). One torch
    thread, as each rank ran with."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = worker.build_model()
        opt = torch.optim.AdamW(model.parameters(), lr=worker.LR)
        out = []
        for step in range(worker.STEPS):
            grads: dict[str, torch.Tensor] = {}
            for rank in range(2):
                for micro in range(gas):
                    model.zero_grad()
                    model(worker.batch(step, micro, rank)).pow(2).mean().backward()
                    for n, p in model.named_parameters():
                        grads[n] = grads.get(n, 0) + p.grad / (2 * gas)
            for n, p in model.named_parameters():
                p.grad = grads[n]
            opt.step()
            out.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return out
    finally:
        torch.set_num_threads(threads)  # the rest of the session's tests run with the default


def store(run: Path, table: str) -> pl.DataFrame:
    return dynascope.open_store(run).sql(f"select * from {table}").pl()


CORRECTNESS = [c for c, opts in worker.CASES.items() if "budget" not in opts]


@pytest.mark.slow
@pytest.mark.parametrize("case", CORRECTNESS)
def test_every_statistic_equals_the_single_process_reference(runs: Path, case: str, tmp_path: Path) -> None:
    opts = worker.CASES[case]
    record = torch.load(runs / f"{case}.pt")
    raw = store(runs / case, "tensor_stats")
    assert raw["sharded"].all() and set(raw["rank"].to_list()) == {0, 1}
    got = store(runs / case, "tensor_stats_global")
    want = reference_rows(record, tmp_path / "ref", memory_budget=None, **opts.get("kw", {}))
    # one row per tensor per engine step (not per inner-optimizer step: sub_group_size makes two of those)
    assert got.height == want.height == worker.STEPS * len(record["theta0"])
    assert sorted(set(got["tensor"])) == sorted(record["theta0"]) == sorted(set(want["tensor"]))
    assert set(got["shards"].to_list()) == {2}
    ref = {(r["step"], r["tensor"]): r for r in want.to_dicts()}
    for r in got.to_dicts():
        assert_rows_equal(r, ref[(r["step"], r["tensor"])], f"{case} step {r['step']} {r['tensor']}")
    assert got["drift_norm"].null_count() == 0 and got["grad_zero_count"].null_count() == 0
    if "kw" in opts:  # S_k at step k against the snapshot of step 0
        assert got.filter(pl.col("step") == 2)["bf16_unchanged_k_count"].null_count() == 0
    assert_user_statistics(runs / case, record)
    ev = store(runs / case, "events")
    assert ev.filter(pl.col("event") == "probe_error").is_empty(), ev.to_dicts()
    assert store(runs / case, "runs")["framework"].unique().to_list() == ["deepspeed"]


def assert_user_statistics(run: Path, record: dict) -> None:
    """The statistics of ``USER_STATS``, declared outside dynascope, combine from the ranks' rows to Σ|ΔW|
    and Σ|g| of the gathered masters and gradients: a statistic added later needs no code for ZeRO."""
    import duckdb

    from dynascope.store import live_files

    files = live_files(run, "tensor_stats")  # what a query reads: the writers' files or what they were folded into
    got = duckdb.sql(f"select step, tensor, count(*) n, sum(test_update_l1) u, sum(test_grad_l1) g "
                     f"from read_parquet({files!r}, union_by_name=true) group by step, tensor").fetchall()
    assert len(got) == worker.STEPS * len(record["theta0"])
    for step, tensor, n, u, g in got:
        before = record["weights"][step - 1] if step else record["theta0"]
        want_u = float((record["weights"][step][tensor].double() - before[tensor].double()).abs().sum())
        want_g = float(record["grads"][step][tensor].double().abs().sum())
        assert n == 2 and math.isclose(u, want_u, rel_tol=1e-6), (step, tensor, u, want_u)
        assert math.isclose(g, want_g, rel_tol=1e-6), (step, tensor, g, want_g)


@pytest.mark.slow
def test_watch_module_and_zero_optimizer_attaches(runs: Path) -> None:
    """``watch(engine.module, engine.optimizer)``, what a user writes first, used to raise AttributeError
    (DeepSpeed's optimizer has no register_step_pre_hook) and kill the script; now it records every step
    on both ranks, and so do the inner optimizer and no optimizer, which say where they attached."""
    for case, attached in (("z1-fp32-module-opt", False), ("z2-bf16-inner", True), ("z2-fp32-gas2", True)):
        stats = store(runs / case, "tensor_stats")
        assert sorted(set(stats["step"])) == list(range(worker.STEPS)) and set(stats["rank"]) == {0, 1}
        ev = store(runs / case, "events")
        notes = ev.filter(pl.col("event") == "probe_attach")["message"].to_list()
        assert len(notes) == (2 if attached else 0), notes  # one per rank
        assert all("DeepSpeedZeroOptimizer.step()" in n for n in notes)


@pytest.mark.slow
def test_engine_without_an_optimizer_records_no_figures(runs: Path) -> None:
    """A ZeRO-3 engine without an optimizer partitions its parameters but holds no fp32 master: watch()
    attaches without an error, and each tensor is skipped with its reason instead of written as zeros."""
    run = runs / "z3-no-optimizer"
    assert store(run, "tensor_stats").is_empty()
    ev = store(run, "events")
    assert ev.filter(pl.col("event") == "probe_error").is_empty(), ev.to_dicts()
    skips = ev.filter(pl.col("event") == "probe_skip")
    names = [n for n, _ in worker.build_model().named_parameters()]
    tensors = [json.loads(f)["tensor"] for f in skips["fields_json"]]
    assert sorted(tensors) == sorted(names * 2)  # each tensor on each rank
    assert all("no DeepSpeed optimizer holds an fp32 master" in m for m in skips["message"])
    notes = ev.filter(pl.col("event") == "probe_attach")["message"].to_list()
    assert len(notes) == 2 and all("scope.step() closes each step" in n for n in notes), notes
    steps = store(run, "timings").filter(pl.col("phase") == "step").group_by("rank").len()
    assert sorted(steps["len"].to_list()) == [worker.STEPS, worker.STEPS]


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CORRECTNESS if not worker.CASES[c].get("bf16")])
def test_fp32_masters_equal_plain_torch_training(runs: Path, case: str) -> None:
    """What the statistics describe is the training a user expects: DeepSpeed's fp32 masters after each
    step equal a plain single-process torch run's weights."""
    record = torch.load(runs / f"{case}.pt")
    for got, want in zip(record["weights"], plain_torch_weights(worker.CASES[case].get("gas", 1)), strict=True):
        for n, w in want.items():
            assert torch.linalg.vector_norm(got[n] - w) <= 1e-6 * torch.linalg.vector_norm(w), (case, n)


WINDOWED = ("update_norm", "changed_count", "drift_norm", "grad_zero_count", "bf16_unchanged_count")


def windows_alike_and_exact(runs: Path, case: str, ref_run: Path) -> dict[int, list[str]]:
    """Each step's windowed tensors, asserted the same on every rank (every windowed statistic of a tensor
    on both ranks or on neither), and where combined equal to the single-process reference at full
    coverage; no probe_error. Returns step → the window's tensors."""
    record = torch.load(runs / f"{case}.pt")
    raw = store(runs / case, "tensor_stats")
    steps = len(record["weights"])
    per = raw.group_by("step", "tensor").agg(pl.len().alias("rows"), *[pl.col(c).count() for c in WINDOWED])
    assert per.height == steps * len(record["theta0"]) and set(per["rows"]) == {2}  # every step, both ranks
    for c in WINDOWED:
        assert set(per[c].to_list()) <= {0, 2}, (case, c, per.sort("step", "tensor").to_dicts())
    got = store(runs / case, "tensor_stats_global")
    ref = {(r["step"], r["tensor"]): r for r in reference_rows(record, ref_run, memory_budget=None).to_dicts()}
    for r in got.filter(pl.col("update_norm").is_not_null()).to_dicts():
        want = ref[(r["step"], r["tensor"])]
        for c in WINDOWED + ("w_norm", "grad_norm", "drift_ratio", "changed_frac"):
            assert math.isclose(r[c], want[c], rel_tol=1e-6, abs_tol=1e-12), (case, r["step"], r["tensor"], c)
    ev = store(runs / case, "events")
    assert ev.filter(pl.col("event") == "probe_error").is_empty(), ev.to_dicts()
    window = per.filter(pl.col("update_norm") > 0).group_by("step").agg(pl.col("tensor").sort())
    return {r["step"]: r["tensor"] for r in window.to_dicts()}


@pytest.mark.slow
def test_budgeted_windows_are_the_same_tensors_on_every_rank(runs: Path, tmp_path: Path) -> None:
    """Under a memory budget each rank's window is planned from rank-invariant sizes, so the shards of a
    windowed statistic are recorded at the same steps and combine; where combined, they are exact."""
    windows = windows_alike_and_exact(runs, "z3-budget", tmp_path / "ref")
    n = len(worker.build_model().state_dict())
    assert sorted(windows) == list(range(worker.STEPS))
    assert all(0 < len(w) < n for w in windows.values()), windows  # a window, not everything


@pytest.mark.slow
@pytest.mark.parametrize("case", ["z2-time-budget", "z3-time-budget"])
def test_time_budgeted_windows_are_the_same_tensors_on_every_rank(runs: Path, case: str, tmp_path: Path) -> None:
    """Under a time budget far below a window's share of the step, each rank measures its own window time
    and step time, yet every rank takes the same window at the same steps (the period the ranks agree on,
    probes.agreement) and the combined figures are exact. The budget binds: the first two records take a
    window (the first period is agreed before any window is measured), then at most every other one."""
    windows = windows_alike_and_exact(runs, case, tmp_path / "ref")
    n = len(worker.build_model().state_dict())
    steps = worker.CASES[case]["steps"]
    assert 0 in windows and all(0 < len(w) < n for w in windows.values()), windows
    assert len(windows) <= steps - 3, windows  # a period of 2 or more from the third record on


@pytest.mark.slow
def test_ranks_agree_on_the_time_budgets_period(runs: Path) -> None:
    """The planted boundary (tests/helpers/deepspeed_worker.py): windows costing 1.9% and 2.1% of a record
    under a 1% budget ask for periods of 2 and 4. Each rank on its own period takes the window alone at
    the odd multiples of 2 (the shards do not combine there); with the agreed period both take the same
    windows at the same records, every 4th, and every window of the rotation comes round."""
    (r0, r1) = torch.load(runs / "planted-period.pt")
    own = [{k: w for k, w, _ in r["own"]} for r in (r0, r1)]
    alone = sorted(set(own[0]) ^ set(own[1]))
    assert alone and all(k % 4 == 2 for k in alone), alone  # the risk is real without the agreement
    assert r0["agreed"] == r1["agreed"]  # the same records, windows and drift on both ranks
    records = [k for k, _, _ in r0["agreed"]]
    assert records[:2] == [0, 1] and all(k % 4 == 0 for k in records[2:]), records
    assert len(records) == 2 + (worker.PLANTED_RECORDS - 1) // 4
    assert set().union(*(w for _, w, _ in r0["agreed"])) == set(range(10))


@pytest.mark.slow
def test_timings_come_from_the_engine(runs: Path) -> None:
    """forward = the engine's forward, backward = engine.backward() (gradient reduction included),
    optimizer = the ZeRO step; one step row per engine step on each rank; with gradient accumulation,
    one forward and backward per micro-batch."""
    for case, opts in worker.CASES.items():
        t = store(runs / case, "timings")
        n = t.group_by("rank", "phase").len()
        count = {(r["rank"], r["phase"]): r["len"] for r in n.to_dicts()}
        steps = opts.get("steps", worker.STEPS)
        micro = steps * opts.get("gas", 1)
        for rank in (0, 1):
            assert count[(rank, "step")] == count[(rank, "optimizer")] == steps, (case, count)
            assert count[(rank, "forward")] == count[(rank, "backward")] == micro, (case, count)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_hf_trainer_under_deepspeed(runs: Path, stage: int) -> None:
    """DynascopeCallback in a Trainer run by accelerate's DeepSpeed plugin (ZeRO-2 and ZeRO-3): the engine
    is found, each rank records its slices under the model's names, and they combine to the gathered
    masters' figures."""
    pytest.importorskip("transformers")
    run = runs / f"hf-z{stage}"
    weights = torch.load(runs / f"hf-z{stage}.pt")["weights"]  # θ₀, then after each step
    raw = store(run, "tensor_stats")
    assert raw["sharded"].all() and set(raw["rank"].to_list()) == {0, 1}
    got = store(run, "tensor_stats_global")
    assert sorted(set(got["tensor"])) == sorted(weights[0]) and sorted(set(got["step"])) == [0, 1, 2]
    assert set(got["shards"].to_list()) == {2} and got["grad_norm"].null_count() == 0
    for r in got.to_dicts():
        new, old, base = (weights[i][r["tensor"]] for i in (r["step"] + 1, r["step"], 0))
        for col, want in (("w_norm", new), ("update_norm", new - old), ("drift_norm", new - base)):
            assert math.isclose(r[col], float(torch.linalg.vector_norm(want)), rel_tol=1e-6, abs_tol=1e-12), (
                r["step"], r["tensor"], col)
    ev = store(run, "events")
    assert ev.filter(pl.col("event") == "probe_error").is_empty(), ev.to_dicts()
    t = store(run, "timings").group_by("rank", "phase", "parent").len()
    count = {(r["rank"], r["phase"], r["parent"]): r["len"] for r in t.to_dicts()}
    for rank in (0, 1):
        for phase in ("forward", "backward", "optimizer"):
            assert count[(rank, phase, "train")] == worker.STEPS, count
        assert count[(rank, "step", None)] == worker.STEPS, count
