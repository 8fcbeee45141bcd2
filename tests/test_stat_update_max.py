"""max |ΔW| (``update_max_abs``): planted values in the kernel, chunked and sharded alike, and the column the
live probe, its rollups and ``dynascope diff`` write."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import dynascope
from dynascope.importers.checkpoint_diff import diff_checkpoints
from dynascope.stats.builtin.update_max import UPDATE_MAX_ABS
from dynascope.stats.engine import UPDATE_STAT_COLUMNS, compute, weight_update_stats
from dynascope.stats.rows import PartialResults, tensor_stats_columns
from dynascope.store import open_store
from dynascope.store.combine import combine_shards


def naive(new: torch.Tensor, old: torch.Tensor) -> float:
    """The largest |difference|, element by element, each difference formed as the kernel forms it (in fp32,
    or fp64 for fp64 weights)."""
    dtype = torch.float64 if torch.float64 in (new.dtype, old.dtype) else torch.float32
    d = (new.to(dtype) - old.to(dtype)).reshape(-1).tolist()
    return max((abs(x) for x in d), default=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("chunk", [1, 7, None])
def test_planted_maximum_whatever_the_chunking(dtype: torch.dtype, chunk: int | None) -> None:
    old = torch.linspace(-1, 1, 50, dtype=torch.float64).to(dtype)
    new = old.clone()
    new[17] += 0.25  # the planted largest move, mid-tensor and inside a chunk of 7
    new[3] -= 0.125
    got = compute((UPDATE_MAX_ABS,), {"new": new, "old": old}, chunk_elems=chunk).item()
    assert got == naive(new, old)
    assert got == pytest.approx(0.25, rel=1e-2)  # bf16 rounds the planted weights, not the maximum's order


def test_edge_cases_empty_unchanged_nan_and_mixed_dtypes() -> None:
    z = torch.zeros(0)
    assert compute((UPDATE_MAX_ABS,), {"new": z, "old": z}).item() == 0.0
    w = torch.randn(9)
    assert compute((UPDATE_MAX_ABS,), {"new": w, "old": w.clone()}).item() == 0.0
    nan = w.clone()
    nan[4] = float("nan")
    assert math.isnan(compute((UPDATE_MAX_ABS,), {"new": nan, "old": w}, chunk_elems=2).item())  # NaN is not lost
    half = w.bfloat16()
    assert compute((UPDATE_MAX_ABS,), {"new": half, "old": w}).item() == naive(half, w)  # bf16 against its master
    assert UPDATE_STAT_COLUMNS[-1] == "update_max_abs"  # in the update pass, after the built-in columns


def test_shards_combine_to_the_whole_tensor_maximum() -> None:
    g = torch.Generator().manual_seed(0)
    old = torch.randn(8, 6, generator=g)
    new = old + 1e-3 * torch.randn(8, 6, generator=g)
    col = UPDATE_STAT_COLUMNS.index("update_max_abs")
    rows = []
    for rank, (a, b) in enumerate([(0, 3), (3, 8)]):
        values = dict(zip(UPDATE_STAT_COLUMNS, weight_update_stats([new[a:b]], [old[a:b]])[0].tolist(), strict=True))
        cols = tensor_stats_columns(PartialResults.of_dicts([values]), np.array([new[a:b].numel()]))
        rows.append({"run_id": "r", "role": "t", "rank": rank, "step": 1, "tensor": "w", "sharded": True,
                     "numel": new[a:b].numel(), **{k: v[0].as_py() for k, v in cols.items()}})
    whole = combine_shards(pl.DataFrame(rows)).row(0, named=True)
    assert whole["update_max_abs"] == weight_update_stats([new], [old])[0, col].item() == naive(new, old)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def test_the_live_probe_its_rollup_and_the_diff_write_it(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 6)
    save_file({n: p.detach().clone() for n, p in model.named_parameters()}, str(tmp_path / "base.safetensors"))
    want: dict[tuple[int, str], float] = {}
    with dynascope.watch(model, opt, run=tmp_path / "live", memory_budget=None, system_interval_s=None):
        for step in (0, 1, 2):  # the first optimizer step is step 0
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            for n, p in model.named_parameters():
                want[(step, n)] = naive(p.detach(), before[n])
            save_file({n: p.detach().clone() for n, p in model.named_parameters()},
                      str(tmp_path / f"step_{step}.safetensors"))
    with open_store(tmp_path / "live") as s:
        got = {(st, t): v for st, t, v in s.rows("SELECT step, tensor, update_max_abs FROM tensor_stats")}
        by_kind = s.rows("SELECT step, max(update_max_abs) FROM tensor_stats_by_kind GROUP BY step ORDER BY step")
    assert got == pytest.approx(want, rel=1e-6) and min(want.values()) > 0
    assert by_kind == [(st, pytest.approx(max(v for (s2, _), v in want.items() if s2 == st))) for st in (0, 1, 2)]
    diff_checkpoints(tmp_path / "base.safetensors", [tmp_path / f"step_{i}.safetensors" for i in (0, 1, 2)],
                     tmp_path / "diff", k=0, device="cpu")
    with open_store(tmp_path / "diff") as s:
        offline = {(st, t): v for st, t, v in s.rows("SELECT step, tensor, update_max_abs FROM tensor_stats")}
    assert offline == got  # the same kernel on the same weights: exactly the live probe's
