"""combine_shards: per-shard rows combine into exactly the whole tensor's statistics."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import torch

from dynascope.stats.base import TENSOR_COLUMNS
from dynascope.stats.builtin.bf16_visibility import S_K
from dynascope.stats.builtin.grad import GRAD_COUNTS, grad_counts, grad_norms
from dynascope.stats.engine import (
    DRIFT_STAT_COLUMNS,
    UPDATE_STAT_COLUMNS,
    compute,
    weight_drift_stats,
    weight_update_stats,
)
from dynascope.stats.rows import PartialResults, tensor_stats_columns
from dynascope.store.combine import combine_shards


def tensor_row(values: dict, numel: int) -> dict:
    """The row the registry derives from one tensor's named values (the live probe's and the diff's)."""
    cols = tensor_stats_columns(PartialResults.of_dicts([values]), np.array([numel]))
    meta = {c.name: values.get(c.name) for c in TENSOR_COLUMNS}
    return {**meta, "numel": numel, **{k: v[0].as_py() for k, v in cols.items()}}


def row_for(name: str, rank: int, sharded: bool, new: torch.Tensor, old: torch.Tensor, ref: torch.Tensor,
            grad: torch.Tensor) -> dict:
    """The row a rank records for its piece, built the way the scope builds it (named statistics, then the
    registry's row derivation); ``ref`` doubles as the weights k steps back for S_k."""
    gn = grad_norms([grad])
    values = {**dict(zip(UPDATE_STAT_COLUMNS, weight_update_stats([new], [old])[0].tolist(), strict=True)),
              **dict(zip(DRIFT_STAT_COLUMNS, weight_drift_stats([new], [ref])[0].tolist(), strict=True)),
              **dict(zip(GRAD_COUNTS.outputs, grad_counts([grad], gn[:, 0])[0].tolist(), strict=True)),
              "grad_norm": gn[0, 0].item(), "bf16_k_steps": 2,
              "bf16_unchanged_k_count": compute((S_K,), {"new": new, "k_snapshot": ref.bfloat16()})[0].item(),
              "tensor": name, "kind": "mlp", "layer": 0, "shape": "8x6", "dtype": "float32", "sharded": sharded}
    return {"run_id": "r", "role": "trainer", "rank": rank, "step": 3, "stage": "rl",
            **tensor_row(values, new.numel())}


def test_shards_combine_to_the_whole_tensor() -> None:
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(8, 6, generator=g)
    old = ref + 0.1 * torch.randn(8, 6, generator=g)
    new = torch.where(torch.rand(8, 6, generator=g) < 0.4, old, old - 0.05 * torch.randn(8, 6, generator=g))
    new[:2] = ref[:2] + 1e-6  # some elements whose drift bf16 cannot see
    grad = torch.randn(8, 6, generator=g)
    grad[grad.abs() < 0.3] = 0.0
    whole = row_for("w", 0, False, new, old, ref, grad)
    pieces = [row_for("w", r, True, new[a:b], old[a:b], ref[a:b], grad[a:b])
              for r, (a, b) in enumerate([(0, 3), (3, 8)])]
    out = combine_shards(pl.DataFrame(pieces))
    assert out.height == 1
    got = out.to_dicts()[0]
    assert got["shards"] == 2 and got["sharded"] is True and got["numel"] == 48
    for col in ("bf16_unchanged_count", "bf16_unchanged_k_count", "drift_unchanged_count", "drift_zero_count"):
        assert 0 < whole[col] < 48, col  # planted so every new count is partial
    for col, want in whole.items():
        if col in ("rank", "sharded"):
            continue
        if isinstance(want, float):
            assert got[col] == pytest.approx(want, rel=1e-6), col
        else:
            assert got[col] == want, col


def test_replicas_pass_through_and_nulls_stay_null() -> None:
    t = torch.randn(4, 4)
    a = row_for("rep", 0, False, t, t, t, t)
    b = dict(a, rank=1)
    s0 = row_for("sh", 0, True, t[:2], t[:2], t[:2], t[:2])
    s1 = dict(row_for("sh", 1, True, t[2:], t[2:], t[2:], t[2:]), grad_zero_count=None, update_norm=None)
    out = {r["tensor"]: r for r in combine_shards(pl.DataFrame([b, a, s0, s1])).to_dicts()}
    assert out["rep"]["shards"] == 1 and out["rep"]["w_norm"] == pytest.approx(a["w_norm"])
    assert out["sh"]["grad_zero_count"] is None and out["sh"]["update_norm"] is None
    assert out["sh"]["update_ratio"] is None
    assert out["sh"]["w_norm"] == pytest.approx(float(t.norm()))
    assert out["sh"]["drift_norm"] == 0.0 and out["sh"]["drift_ratio"] == 0.0


def test_a_missing_shard_gives_null_not_a_smaller_tensor() -> None:
    g = torch.Generator().manual_seed(1)
    old = torch.randn(8, 6, generator=g)
    new = old + 0.01 * torch.randn(8, 6, generator=g)
    halves = [(0, 3), (3, 8)]
    rows = [dict(row_for("w", r, True, new[a:b], old[a:b], old[a:b], new[a:b]), step=step)
            for step in (3, 4) for r, (a, b) in enumerate(halves) if (step, r) != (4, 1)]  # rank 1 lost step 4
    out = {r["step"]: r for r in combine_shards(pl.DataFrame(rows)).to_dicts()}
    assert out[3]["w_norm"] == pytest.approx(float(new.norm()), rel=1e-6) and out[3]["numel"] == 48
    lost = out[4]
    assert lost["shards"] == 1 and lost["numel"] == 18  # what was seen, said as such
    stats = [c for c, v in out[3].items() if isinstance(v, float)]
    assert "w_norm" in stats and "update_norm" in stats and "changed_frac" in stats
    assert all(lost[c] is None for c in stats), {c: lost[c] for c in stats if lost[c] is not None}
    assert lost["tensor"] == "w" and lost["dtype"] == "float32"
