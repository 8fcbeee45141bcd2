"""DeepSpeed ZeRO-1/2/3 on 2 gloo ranks (real DeepSpeed, CPU): every statistic of every tensor at every
step, combined from the ranks' partial rows, equals a single-process run of the probe over the same fp32
masters and gradients; the fp32 masters equal plain torch training; the step boundary is the engine's.

One torchrun launch runs every case (``tests/deepspeed_worker.py``): DeepSpeed's start-up is most of it.
"""

from __future__ import annotations

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
from dynascope.store.combine import combine_shards
from dynascope.store.schema import TENSOR_STATS_COLUMNS

pytest.importorskip("deepspeed")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import deepspeed_worker as worker  # noqa: E402

# Row metadata compared as equal values; every other registry column as a statistic.
META = ("tensor", "layer", "kind", "shape", "dtype", "numel")
SKIP = ("sharded",)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("deepspeed")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(HERE / "deepspeed_worker.py"),
           str(out), *worker.CASES]
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


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c, v in worker.CASES.items() if not v[4]])
def test_every_statistic_equals_the_single_process_reference(runs: Path, case: str, tmp_path: Path) -> None:
    record = torch.load(runs / f"{case}.pt")
    raw = dynascope.open_store(runs / case).sql("select * from tensor_stats").pl()
    assert raw["sharded"].all() and set(raw["rank"].to_list()) == {0, 1}
    got = combine_shards(raw)
    want = reference_rows(record, tmp_path / "ref", memory_budget=None)
    assert got.height == want.height == worker.STEPS * len(record["theta0"])
    assert sorted(set(got["tensor"])) == sorted(record["theta0"]) == sorted(set(want["tensor"]))
    assert set(got["shards"].to_list()) == {2}
    ref = {(r["step"], r["tensor"]): r for r in want.to_dicts()}
    for r in got.to_dicts():
        assert_rows_equal(r, ref[(r["step"], r["tensor"])], f"{case} step {r['step']} {r['tensor']}")
    ev = events(runs / case)
    assert ev.filter(pl.col("event") == "probe_error").is_empty(), ev.to_dicts()
    runs_ = dynascope.open_store(runs / case).sql("select distinct framework from runs").pl()
    assert runs_["framework"].to_list() == ["deepspeed"]
