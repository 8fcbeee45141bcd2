"""Dynamics analyses on real stores: planted sparsity, rank-1 dominance, linear fit, checkpoint writers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dynascope.analyses import (
    rank1_dominance,
    rank1_linear_fit,
    sparsity_comparison,
    sparsity_over_training,
)
from dynascope.checkpoints import extrapolate, rank1_reconstruction
from dynascope.importers.checkpoint_diff import diff_checkpoints
from dynascope.store import RunWriter, StoreError, open_store

Q, MLP, NORM = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"


def _stats_run(path, rows: list[dict], rank: int = 0):
    with RunWriter(path, rank=rank) as w:
        w.append("tensor_stats", {c: [r.get(c) for r in rows] for c in rows[0]})
    return path


def test_sparsity_over_training_is_numel_weighted_and_combines_ranks(tmp_path):
    run = tmp_path / "r"
    base = {"stage": "rl", "ref_covered": True}
    # step 1: q (100 params) 10 changed, mlp (300) 150 changed; rank 1 holds another shard of mlp (100, 0 changed)
    _stats_run(run, [
        {**base, "step": 1, "tensor": Q, "layer": 0, "kind": "q", "numel": 100, "changed_count": 10,
         "changed_rel_count": 5, "sign_flip_count": 1, "drift_changed_count": 10, "drift_changed_rel_count": 5},
        {**base, "step": 1, "tensor": MLP, "layer": 1, "kind": "mlp", "numel": 300, "changed_count": 150,
         "changed_rel_count": 30, "sign_flip_count": 3, "drift_changed_count": 150, "drift_changed_rel_count": 30,
         "sharded": True},
        {**base, "step": 2, "tensor": Q, "layer": 0, "kind": "q", "numel": 100, "changed_count": 20,
         "changed_rel_count": 20, "sign_flip_count": 0, "drift_changed_count": 25, "drift_changed_rel_count": 22},
    ])
    _stats_run(run, [{**base, "step": 1, "tensor": MLP, "layer": 1, "kind": "mlp", "numel": 100, "sharded": True,
                      "changed_count": 0, "changed_rel_count": 0, "sign_flip_count": 0}], rank=1)
    by_kind = sparsity_over_training(run)
    got = {(r["step"], r["kind"]): r for r in by_kind.iter_rows(named=True)}
    assert got[(1, "mlp")]["changed_frac"] == pytest.approx(150 / 400)
    assert got[(1, "mlp")]["numel"] == 400 and got[(1, "mlp")]["tensors"] == 1
    assert got[(1, "q")]["changed_rel_frac"] == pytest.approx(0.05)
    assert got[(1, "q")]["unchanged_frac"] == pytest.approx(0.9)
    overall = sparsity_over_training(run, by="all")
    assert overall.filter(overall["step"] == 1)["changed_frac"][0] == pytest.approx(160 / 500)
    ref = sparsity_over_training(run, by="layer", against="reference")
    row = ref.filter((ref["step"] == 2) & (ref["layer"] == 0)).row(0, named=True)
    assert row["drift_changed_frac"] == pytest.approx(0.25) and row["drift_changed_rel_frac"] == pytest.approx(0.22)
    # rank 1's mlp shard has no drift columns: the whole tensor has none (never three quarters of it), so
    # the reference view leaves it out
    assert ref.filter((ref["step"] == 1) & (ref["layer"] == 1)).height == 0
    with pytest.raises(ValueError):
        sparsity_over_training(run, by="head")


def test_sparsity_comparison_between_runs_and_stages(tmp_path):
    def rows(stage, changed_q, drift_q, changed_m, drift_m):
        return [
            {"step": s, "stage": stage, "tensor": t, "kind": k, "numel": n, "changed_count": c,
             "drift_changed_count": d * s, "drift_changed_rel_count": d * s // 2}
            for s in (1, 2) for t, k, n, c, d in ((Q, "q", 1000, changed_q, drift_q), (MLP, "mlp", 3000, changed_m, drift_m))
        ]
    _stats_run(tmp_path / "sft", rows("sft", 900, 400, 2700, 1200))
    _stats_run(tmp_path / "rl", rows("rl", 100, 50, 300, 150))
    cmp = sparsity_comparison(tmp_path, "sft", "rl")  # names are both run ids and stages: runs win
    assert cmp["kind"].to_list() == ["mlp", "q", "all"]
    q = cmp.filter(cmp["kind"] == "q").row(0, named=True)
    assert q["unchanged_frac_a"] == pytest.approx(1 - 800 / 1000)  # drift at the last step (2 × 400)
    assert q["unchanged_frac_b"] == pytest.approx(1 - 100 / 1000)
    assert q["unchanged_rel_frac_b"] == pytest.approx(1 - 50 / 1000)
    assert q["step_unchanged_frac_a"] == pytest.approx(0.1) and q["steps_a"] == 2
    allrow = cmp.filter(cmp["kind"] == "all").row(0, named=True)
    assert allrow["unchanged_frac_b"] == pytest.approx(1 - (100 + 300) / 4000)
    assert allrow["a"] == "sft" and allrow["b"] == "rl"
    with pytest.raises(StoreError, match="neither a run id nor a stage"):
        sparsity_comparison(tmp_path, "sft", "ppo")


def _spectra_run(path, records: list[dict]):
    with RunWriter(path) as w:
        w.append("spectra", {c: [r.get(c) for r in records] for c in records[0]})
    return path


def test_rank1_dominance_energy_weighted_per_layer_and_overall(tmp_path):
    recs = [
        {"step": 10, "tensor": Q, "layer": 0, "kind": "q", "drift_norm": 2.0, "sigma": [1.8, 0.5],
         "rank1_energy": 0.81, "topk_energy": (1.8**2 + 0.25) / 4, "stable_rank": 4 / 3.24, "effective_rank": 1.5},
        {"step": 10, "tensor": MLP, "layer": 1, "kind": "mlp", "drift_norm": 1.0, "sigma": [0.5, 0.5],
         "rank1_energy": 0.25, "topk_energy": 0.5, "stable_rank": 4.0, "effective_rank": 2.0},
        {"step": 10, "tensor": "model.layers.1.mlp.down_proj.weight", "layer": 1, "kind": "mlp", "drift_norm": 0.0,
         "sigma": [], "rank1_energy": None},  # ΔW = 0: not counted
    ]
    df = rank1_dominance(_spectra_run(tmp_path / "r", recs))
    overall = df.filter(df["level"] == "overall").row(0, named=True)
    assert overall["rank1_energy"] == pytest.approx((1.8**2 + 0.25) / (4 + 1))
    assert overall["mean_rank1_energy"] == pytest.approx((0.81 + 0.25) / 2)
    assert overall["topk_energy"] == pytest.approx((1.8**2 + 0.25 + 0.5) / 5)
    layer1 = df.filter((df["level"] == "layer") & (df["layer"] == 1)).row(0, named=True)
    assert layer1["tensors"] == 1 and layer1["rank1_energy"] == pytest.approx(0.25)


def _unit(n, rng):
    x = rng.standard_normal(n)
    return x / np.linalg.norm(x)


def test_rank1_linear_fit_on_exactly_linear_records_with_sign_flips(tmp_path):
    rng = np.random.default_rng(0)
    c, p, v = rng.standard_normal(30), rng.standard_normal(30), _unit(20, rng)
    recs = []
    for i, step in enumerate(range(10, 110, 10)):
        m = c + 0.05 * step * p  # σ₁u₁ = m(t), a line in the step; v₁ fixed
        sign = -1.0 if i % 3 == 1 else 1.0  # stored signs flip: the fit must align them
        recs.append({"step": step, "tensor": Q, "layer": 0, "kind": "q", "rows": 30, "cols": 20,
                     "drift_norm": float(np.linalg.norm(m)) * 1.01, "sigma": [float(np.linalg.norm(m))],
                     "u1": (sign * m / np.linalg.norm(m)).astype(np.float32), "v1": (sign * v).astype(np.float32)})
    df = rank1_linear_fit(_spectra_run(tmp_path / "r", recs), fit_frac=0.3)
    row = df.row(0, named=True)
    assert row["records"] == 10 and row["fit_records"] == 3 and row["fit_last_step"] == 30
    assert row["r2_fit"] == pytest.approx(1.0, abs=1e-9) and row["r2_all"] == pytest.approx(1.0, abs=1e-9)
    assert row["rel_error_last"] < 1e-5 and row["rel_error_u_last"] < 1e-5
    assert row["rank1_energy_last"] == pytest.approx(1 / 1.01**2)
    # A curved trajectory is caught: the line fitted early misses the last record.
    for r in recs:
        r["sigma"] = [r["sigma"][0] * (1 + (r["step"] / 50) ** 2)]
    bent = rank1_linear_fit(_spectra_run(tmp_path / "bent", recs), fit_frac=0.3).row(0, named=True)
    assert bent["rel_error_last"] > 0.5 and bent["r2_all"] < 0.9


def test_rank1_linear_fit_fits_the_last_stage_only(tmp_path):
    """SFT's records (ΔW against the pretrained θ₀) before RL's linear ones do not enter RL's line."""
    rng = np.random.default_rng(1)
    c, p, v = rng.standard_normal(30), rng.standard_normal(30), _unit(20, rng)

    def rec(step, m, stage):
        return {"step": step, "stage": stage, "tensor": Q, "layer": 0, "kind": "q", "rows": 30, "cols": 20,
                "drift_norm": float(np.linalg.norm(m)), "sigma": [float(np.linalg.norm(m))],
                "u1": (m / np.linalg.norm(m)).astype(np.float32), "v1": v.astype(np.float32)}

    sft = [rec(s, 5.0 * rng.standard_normal(30), "sft") for s in (0, 5, 9)]  # another θ₀: unrelated records
    rl = [rec(s, c + 0.05 * s * p, "rl") for s in range(10, 110, 10)]
    row = rank1_linear_fit(_spectra_run(tmp_path / "r", sft + rl), fit_frac=0.3).row(0, named=True)
    assert row["records"] == 10 and row["first_step"] == 10 and row["fit_last_step"] == 30
    assert row["r2_all"] == pytest.approx(1.0, abs=1e-9) and row["rel_error_last"] < 1e-5


def _save_trajectory(tmp_path, steps, target):
    """Checkpoints of W_t = W_0 + (c + t·p)vᵀ + tiny noise: σ₁u₁ is linear in t (and rotates)."""
    g = torch.Generator().manual_seed(0)
    w0 = {Q: torch.randn(48, 32, generator=g), MLP: torch.randn(64, 32, generator=g), NORM: torch.ones(32)}
    save_file(w0, tmp_path / "base.safetensors")
    dirs = {}
    truth = {}
    for name in (Q, MLP):
        rows = w0[name].shape[0]
        c, p = 1e-2 * torch.randn(rows, generator=g), 1e-3 * torch.randn(rows, generator=g)
        v = torch.randn(32, generator=g)
        v /= v.norm()
        truth[name] = lambda t, c=c, p=p, v=v: torch.outer(c + t * p, v)
    for t in steps:
        sd = {n: w0[n] + truth[n](t) + 1e-7 * torch.randn(w0[n].shape, generator=g) for n in (Q, MLP)}
        sd[NORM] = w0[NORM] + 0.01 * t
        dirs[t] = tmp_path / f"checkpoint-{t}"
        dirs[t].mkdir()
        save_file(sd, dirs[t] / "model.safetensors")
    expected = {n: w0[n] + truth[n](target) for n in (Q, MLP)}
    return w0, dirs, expected


def test_planted_linear_trajectory_extrapolates(tmp_path):
    steps, target = [10, 20, 30, 40, 50], 200
    w0, dirs, expected = _save_trajectory(tmp_path, steps, target)
    run = tmp_path / "run"
    diff_checkpoints(tmp_path / "base.safetensors", [dirs[t] for t in steps], run, k=4)
    fit = rank1_linear_fit(run, fit_frac=0.6)
    assert fit.height == 2 and (fit["rel_error_last"] < 1e-3).all() and (fit["r2_all"] > 0.999).all()
    report = extrapolate(run, tmp_path / "base.safetensors", target, tmp_path / "pred.safetensors")
    assert dict(zip(report["tensor"], report["action"], strict=True)) == {Q: "changed", MLP: "changed", NORM: "copied"}
    pred = load_file(tmp_path / "pred.safetensors")
    for name in (Q, MLP):
        rel = float((pred[name] - expected[name]).norm() / (expected[name] - w0[name]).norm())
        assert rel < 1e-3, (name, rel)
    assert torch.equal(pred[NORM], w0[NORM])  # 1-D tensors are W_0, documented


def test_rank1_reconstruction_writes_norm_scaled_top_direction(tmp_path):
    steps = [10, 20, 30]
    w0, dirs, _ = _save_trajectory(tmp_path, steps, 0)
    run = tmp_path / "run"
    diff_checkpoints(tmp_path / "base.safetensors", [dirs[t] for t in steps], run, k=4)
    report = rank1_reconstruction(run, tmp_path / "base.safetensors", tmp_path / "r1.safetensors", step=25)
    assert set(report.filter(report["action"] == "changed")["step"].to_list()) == {20.0}
    out = load_file(tmp_path / "r1.safetensors")
    w20 = load_file(dirs[20] / "model.safetensors")
    with open_store(run) as con:
        u1, v1, fro = con.execute(f"SELECT u1, v1, drift_norm FROM spectra WHERE tensor = '{Q}' AND step = 20").fetchone()
    want = w0[Q] + fro * torch.outer(torch.tensor(u1), torch.tensor(v1))
    torch.testing.assert_close(out[Q], want, rtol=1e-5, atol=1e-6)
    # The planted update is rank-1 up to 1e-7 noise, so the reconstruction is the checkpoint itself.
    assert float((out[Q] - w20[Q]).norm() / (w20[Q] - w0[Q]).norm()) < 1e-3
    bad = {Q: torch.zeros(5, 5), MLP: w0[MLP], NORM: w0[NORM]}
    save_file(bad, tmp_path / "bad.safetensors")
    with pytest.raises(StoreError, match="recorded"):
        rank1_reconstruction(run, tmp_path / "bad.safetensors", tmp_path / "x.safetensors")
    assert math.isfinite(float(report["delta_fro"].drop_nulls().sum()))
