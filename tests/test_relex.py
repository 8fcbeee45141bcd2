"""RELEX (rank-1 trajectory extrapolation) on planted trajectories, against a direct numpy computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dynascope.checkpoints import relex_extrapolate


def _write_run(tmp_path, base: dict[str, torch.Tensor], deltas: dict[int, dict[str, torch.Tensor]], dtype=torch.float32):
    save_file(base, tmp_path / "base.safetensors")
    files = []
    for step, d in deltas.items():
        path = tmp_path / f"delta-{step}.safetensors"
        save_file({k: v.to(dtype).contiguous() for k, v in d.items()}, path)
        files.append((step, path))
    return tmp_path / "base.safetensors", files


def test_an_exactly_rank1_linear_trajectory_extrapolates_exactly(tmp_path):
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(37, 11, generator=g), "b": torch.randn(5, generator=g), "frozen": torch.randn(4, 4, generator=g)}
    v = {k: torch.randn(t.shape, generator=g) for k, t in base.items() if k != "frozen"}
    steps = [1, 2, 4, 5, 7]
    coef = {s: 0.3 * s - 0.1 for s in steps}  # c(t) = a·t + b along one direction per tensor
    deltas = {s: {**{k: coef[s] * v[k] for k in v}, "frozen": torch.zeros(4, 4)} for s in steps}
    base_path, files = _write_run(tmp_path, base, deltas)
    # a chunk of a few rows forces the two chunked passes to stitch rows back together
    report = relex_extrapolate(base_path, files, 40, tmp_path / "out.safetensors", chunk_bytes=4 * 11 * 5 * 3)
    out = load_file(tmp_path / "out.safetensors")
    for k in v:
        assert torch.allclose(out[k], base[k] + (0.3 * 40 - 0.1) * v[k], rtol=1e-5, atol=1e-5), k
    assert torch.equal(out["frozen"], base["frozen"])
    got = {r["tensor"]: r for r in report.iter_rows(named=True)}
    assert got["w"]["explained_var"] == pytest.approx(1.0, abs=1e-7)  # MMᵀ in float32, as the authors
    assert got["w"]["r2"] == pytest.approx(1.0, abs=1e-7)
    # ĉ is the coefficient along the unit direction: (a·T + b)·‖v‖
    assert got["w"]["coef_target"] == pytest.approx(abs(0.3 * 40 - 0.1) * float(v["w"].norm()), rel=1e-5)
    assert got["frozen"]["delta_fro"] == 0.0 and got["frozen"]["r2"] is None


def test_matches_the_authors_procedure_on_a_noisy_trajectory(tmp_path):
    """A rank-1 line plus noise: the same numbers as a direct SVD of the stacked deltas (the authors'
    compute_svd + fit_linear), so the extrapolation keeps only the top trajectory direction."""
    rng = np.random.default_rng(1)
    base = {"w": torch.from_numpy(rng.standard_normal((6, 9)).astype(np.float32))}
    steps = [2, 4, 6, 8]
    m = np.stack([0.5 * s * np.linspace(-1, 1, 54) + 0.05 * rng.standard_normal(54) for s in steps]).astype(np.float32)
    deltas = {s: {"w": torch.from_numpy(m[i].reshape(6, 9))} for i, s in enumerate(steps)}
    base_path, files = _write_run(tmp_path, base, deltas)
    report = relex_extrapolate(base_path, files, 30, tmp_path / "out.safetensors")
    # reference: SVD of M [T, d], c = M v₁, least-squares line in the step, θ₀ + ĉ v₁
    _, s, vt = np.linalg.svd(m.astype(np.float64), full_matrices=False)
    v1 = vt[0]
    c = m.astype(np.float64) @ v1
    slope, icpt = np.polyfit(np.array(steps, dtype=float), c, 1)
    want = base["w"].numpy().astype(np.float64) + ((slope * 30 + icpt) * v1).reshape(6, 9)
    got = load_file(tmp_path / "out.safetensors")["w"].numpy()
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5)
    r = report.row(0, named=True)
    assert r["explained_var"] == pytest.approx(s[0] ** 2 / (s ** 2).sum(), rel=1e-6)
    assert 0.99 < r["explained_var"] < 1.0


def test_deltas_stored_in_fp16_as_the_authors_store_them(tmp_path):
    base = {"w": torch.ones(3, 4)}
    v = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 16  # exactly representable in fp16
    deltas = {s: {"w": s * v} for s in (1, 2, 3)}
    base_path, files = _write_run(tmp_path, base, deltas, dtype=torch.float16)
    relex_extrapolate(base_path, files, 9, tmp_path / "out.safetensors")
    assert torch.allclose(load_file(tmp_path / "out.safetensors")["w"], base["w"] + 9 * v, atol=1e-5)


def test_one_step_or_mismatched_names_are_refused(tmp_path):
    base_path, files = _write_run(tmp_path, {"w": torch.ones(2, 2)}, {1: {"w": torch.ones(2, 2)}, 2: {"x": torch.ones(2, 2)}})
    with pytest.raises(ValueError, match="two"):
        relex_extrapolate(base_path, files[:1], 5, tmp_path / "o.safetensors")
    from dynascope.store import StoreError

    with pytest.raises(StoreError, match="names differ"):
        relex_extrapolate(base_path, files, 5, tmp_path / "o.safetensors")
