"""combine_shards: per-shard rows combine into exactly the whole tensor's statistics."""

from __future__ import annotations

import polars as pl
import pytest
import torch

from dynascope.probes.grad_stats import grad_counts, grad_norms
from dynascope.probes.update_stats import weight_update_stats
from dynascope.store.combine import combine_shards


def row_for(name: str, rank: int, sharded: bool, new: torch.Tensor, old: torch.Tensor, ref: torch.Tensor,
            grad: torch.Tensor) -> dict:
    """The row a rank records for its piece, built the way the scope builds it."""
    u = weight_update_stats([new], [old])[0].tolist()
    d = weight_update_stats([ref], [new])[0].tolist()
    gn = grad_norms([grad])[0].tolist()
    gc = grad_counts([grad], torch.tensor([gn[0]], dtype=torch.float64))[0].tolist()
    n = new.numel()
    return {"run_id": "r", "role": "trainer", "rank": rank, "step": 3, "tensor": name, "stage": "rl",
            "kind": "mlp", "layer": 0, "shape": "8x6", "dtype": "float32", "numel": n, "sharded": sharded,
            "w_norm": u[0], "update_norm": u[1], "update_ratio": u[1] / u[0],
            "changed_count": int(u[2]), "changed_frac": u[2] / n, "changed_bf16_count": int(u[3]),
            "changed_bf16_frac": u[3] / n, "sign_flip_count": int(u[4]), "sign_flip_frac": u[4] / n,
            "w_nan_count": int(u[5]), "w_inf_count": int(u[6]), "ref_covered": True, "drift_norm": d[1],
            "drift_ratio": d[1] / d[0], "drift_changed_count": int(d[2]), "drift_changed_frac": d[2] / n,
            "drift_changed_bf16_count": int(d[3]), "drift_changed_bf16_frac": d[3] / n,
            "grad_norm": gn[0], "grad_max_abs": gc[0], "grad_zero_count": int(gc[1]),
            "grad_zero_frac": gc[1] / n, "grad_near_zero_count": int(gc[2]), "grad_near_zero_frac": gc[2] / n,
            "grad_nan_count": int(gc[3]), "grad_inf_count": int(gc[4])}


def test_shards_combine_to_the_whole_tensor() -> None:
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(8, 6, generator=g)
    old = ref + 0.1 * torch.randn(8, 6, generator=g)
    new = torch.where(torch.rand(8, 6, generator=g) < 0.4, old, old - 0.05 * torch.randn(8, 6, generator=g))
    grad = torch.randn(8, 6, generator=g)
    grad[grad.abs() < 0.3] = 0.0
    whole = row_for("w", 0, False, new, old, ref, grad)
    pieces = [row_for("w", r, True, new[a:b], old[a:b], ref[a:b], grad[a:b])
              for r, (a, b) in enumerate([(0, 3), (3, 8)])]
    out = combine_shards(pl.DataFrame(pieces))
    assert out.height == 1
    got = out.to_dicts()[0]
    assert got["shards"] == 2 and got["sharded"] is True and got["numel"] == 48
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
