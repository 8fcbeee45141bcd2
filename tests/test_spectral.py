"""Spectral probe maths against full torch.linalg.svd references, and the probe's budget/rotation."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from dynascope.probes.spectral import SpectralProbe
from dynascope.stats.spectra import (
    canonical_sign,
    effective_rank,
    off_principal_energy,
    principal_angle_deg,
    spectral_drift,
    spectrum_row,
    top_k_svd,
)


def _unit(n: int, g: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    x = torch.randn(n, generator=g, dtype=dtype)
    return x / x.norm()


def _decaying(m: int, n: int, g: torch.Generator, decay: float = 0.7) -> torch.Tensor:
    """A matrix with known singular values decay**i (a clear gap between every pair)."""
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    r = min(m, n)
    s = decay ** torch.arange(r, dtype=torch.float64)
    return (U[:, :r] * s) @ V[:, :r].T


def _planted(m: int, n: int, a: float, noise: float, g: torch.Generator):
    """ΔW = a·u vᵀ + N with N orthogonal to u on the left and v on the right, so
    σ₁ = a, u₁ = ±u and σ₁²/‖ΔW‖²_F = a² / (a² + ‖N‖²_F) exactly (as long as ‖N‖₂ < a)."""
    u, v = _unit(m, g), _unit(n, g)
    N = noise * torch.randn(m, n, generator=g, dtype=torch.float64)
    N = N - torch.outer(u, u @ N)
    N = N - torch.outer(N @ v, v)
    analytic = a * a / (a * a + float(N.pow(2).sum()))
    assert float(torch.linalg.matrix_norm(N, ord=2)) < a
    return a * torch.outer(u, v) + N, u, v, analytic


def test_top_k_svd_matches_full_svd():
    g = torch.Generator().manual_seed(0)
    A = _decaying(300, 200, g)
    b = top_k_svd(A, 8, seed=3)
    U, S, Vh = torch.linalg.svd(A, full_matrices=False)
    torch.testing.assert_close(b.S, S[:8], rtol=1e-8, atol=1e-10)
    assert principal_angle_deg(b.U, U[:, :8]) < 1e-4
    assert principal_angle_deg(b.V, Vh[:8].T) < 1e-4
    # Reproducible for a seed; small matrices take the exact path.
    torch.testing.assert_close(top_k_svd(A, 8, seed=3).U, b.U, rtol=0, atol=0)
    small = _decaying(12, 10, g)
    torch.testing.assert_close(top_k_svd(small, 4).S, torch.linalg.svdvals(small)[:4])


def test_planted_rank1_recovered_by_probe_in_float32():
    g = torch.Generator().manual_seed(1)
    dw, u, v, analytic = _planted(256, 128, a=2.0, noise=0.005, g=g)
    w0 = _decaying(256, 128, g)
    probe = SpectralProbe(k=8, time_budget=None)
    (row,) = probe.record(5, "rl", [("layers.0.q_proj.weight", (w0 + dw).float())],
                          {"layers.0.q_proj.weight": w0.float()})
    assert 0.5 < analytic < 0.95  # the noise is a real share of the energy, not negligible
    assert abs(row["rank1_energy"] - analytic) < 1e-3
    u1 = torch.as_tensor(row["u1"], dtype=torch.float64)
    v1 = torch.as_tensor(row["v1"], dtype=torch.float64)
    assert math.degrees(math.acos(min(1.0, abs(float(u1 @ u))))) < 1.0
    assert math.degrees(math.acos(min(1.0, abs(float(v1 @ v))))) < 1.0
    assert abs(row["sigma"][0] - 2.0) < 1e-3
    assert row["step"] == 5 and row["stage"] == "rl" and row["layer"] == 0 and row["kind"] == "q"
    assert row["rows"] == 256 and row["cols"] == 128 and row["k"] == 8
    assert row["angle_left_deg"] is None  # first record: nothing to rotate from
    assert row["compute_ms"] > 0


def test_row_scalars_match_full_svd_reference():
    g = torch.Generator().manual_seed(2)
    w0 = _decaying(40, 30, g, decay=0.8)
    dw = 0.1 * torch.randn(40, 30, generator=g, dtype=torch.float64)
    k = 30  # everything: the randomized path is exact here, so compare to tight tolerance
    w0b = top_k_svd(w0, k)
    row, _ = spectrum_row(dw, w0 + dw, w0b, None, k)
    s = torch.linalg.svdvals(dw)
    fro2 = float(dw.pow(2).sum())
    assert row["drift_norm"] == pytest.approx(math.sqrt(fro2), rel=1e-12)
    assert row["rank1_energy"] == pytest.approx(float(s[0] ** 2) / fro2, rel=1e-10)
    assert row["topk_energy"] == pytest.approx(1.0, rel=1e-10)
    assert row["stable_rank"] == pytest.approx(fro2 / float(s[0] ** 2), rel=1e-10)
    p = s / s.sum()
    assert row["effective_rank"] == pytest.approx(float(torch.exp(-(p * p.log()).sum())), rel=1e-10)
    drift = float((torch.linalg.svdvals(w0 + dw) - torch.linalg.svdvals(w0)).norm() / torch.linalg.svdvals(w0).norm())
    assert row["spectral_drift"] == pytest.approx(drift, rel=1e-9)
    U, _, Vh = torch.linalg.svd(w0, full_matrices=False)
    inside = float((U.T @ dw @ Vh.T).pow(2).sum())
    assert row["off_principal_energy"] == pytest.approx(1 - inside / fro2, rel=1e-9)


def test_off_principal_energy_against_explicit_projection():
    g = torch.Generator().manual_seed(3)
    w0 = _decaying(50, 40, g)
    U, _, Vh = torch.linalg.svd(w0)
    U4, V4 = U[:, :4], Vh[:4].T
    inside = U4 @ torch.randn(4, 4, generator=g, dtype=torch.float64) @ V4.T
    outside = U[:, 10:20] @ torch.randn(10, 10, generator=g, dtype=torch.float64) @ Vh[10:20]
    assert abs(float(off_principal_energy(inside, U4, V4))) < 1e-12
    assert float(off_principal_energy(outside, U4, V4)) == pytest.approx(1.0, abs=1e-12)
    dw = torch.randn(50, 40, generator=g, dtype=torch.float64)
    proj = U4 @ U4.T @ dw @ V4 @ V4.T
    expect = 1 - float(proj.pow(2).sum() / dw.pow(2).sum())
    assert float(off_principal_energy(dw, U4, V4)) == pytest.approx(expect, rel=1e-12)


@pytest.mark.parametrize("deg", [0.01, 1.0, 37.0, 80.0, 90.0])
def test_principal_angle_planted_rotation(deg):
    g = torch.Generator().manual_seed(4)
    Q, _ = torch.linalg.qr(torch.randn(100, 6, generator=g, dtype=torch.float64))
    A = Q[:, :3]
    t = math.radians(deg)
    B = A.clone()
    B[:, 1] = math.cos(t) * A[:, 1] + math.sin(t) * Q[:, 4]  # one direction turned by `deg`
    B[:, 2] = math.cos(t / 2) * A[:, 2] + math.sin(t / 2) * Q[:, 5]
    assert principal_angle_deg(A, B) == pytest.approx(deg, rel=1e-6, abs=1e-9)
    assert principal_angle_deg(A, A @ torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))[0]) < 1e-5


def test_small_helpers():
    s0 = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)
    assert float(spectral_drift(s0 * 1.1, s0)) == pytest.approx(0.1)
    assert float(effective_rank(torch.ones(5, dtype=torch.float64))) == pytest.approx(5.0)
    assert float(effective_rank(torch.tensor([1.0, 0.0]))) == pytest.approx(1.0)
    u = torch.tensor([0.1, -0.9, 0.3])
    v = torch.tensor([1.0, 2.0])
    cu, cv = canonical_sign(u, v)
    assert float(cu[1]) > 0 and torch.equal(torch.outer(cu, cv), torch.outer(u, v))


def test_subspace_rotation_between_records():
    g = torch.Generator().manual_seed(5)
    m, n = 80, 60
    u, v, w = _unit(m, g), _unit(n, g), _unit(m, g)
    w = w - (w @ u) * u
    w = w / w.norm()
    w0 = torch.zeros(m, n, dtype=torch.float64) + 0.01 * torch.randn(m, n, generator=g, dtype=torch.float64)
    probe = SpectralProbe(k=1, time_budget=None, dtype=torch.float64)
    ref = {"h.0.mlp.c_fc.weight": w0}
    probe.record(1, None, [("h.0.mlp.c_fc.weight", w0 + torch.outer(u, v))], ref)
    t = math.radians(3.0)
    u2 = math.cos(t) * u + math.sin(t) * w
    (row,) = probe.record(2, None, [("h.0.mlp.c_fc.weight", w0 + 2 * torch.outer(u2, v))], ref)
    assert row["angle_left_deg"] == pytest.approx(3.0, abs=1e-6)
    assert row["angle_right_deg"] == pytest.approx(0.0, abs=1e-5)


def test_budget_rotates_through_tensors_and_rows_say_which():
    g = torch.Generator().manual_seed(6)
    names = [f"layers.{i}.mlp.up_proj.weight" for i in range(5)]
    ref = {n: torch.randn(20, 16, generator=g) for n in names}
    weights = [(n, ref[n] + 0.1 * torch.randn(20, 16, generator=g)) for n in names]
    weights.append(("layers.0.input_layernorm.weight", torch.ones(16)))  # 1-D: never covered
    probe = SpectralProbe(k=4, time_budget=0.0)  # a zero budget still computes one tensor per record
    covered = [[r["tensor"] for r in probe.record(s, None, weights, ref)] for s in range(7)]
    assert covered == [[names[s % 5]] for s in range(7)]
    everything = SpectralProbe(k=4, time_budget=None).record(0, None, weights, ref)
    assert [r["tensor"] for r in everything] == names


def test_probe_never_raises_and_leaves_rng_alone():
    class Broken:
        shape = (20, 16)

        def detach(self):
            raise RuntimeError("θ₀ went missing")

    g = torch.Generator().manual_seed(7)
    good = torch.randn(20, 16, generator=g)
    weights = [("a.weight", good + 1.0), ("b.weight", good)]
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = SpectralProbe(k=4, time_budget=None).record(1, None, weights, {"a.weight": good, "b.weight": Broken()})
    assert torch.equal(torch.rand(3), expected)  # the randomized SVD did not consume the user's RNG
    assert [r["tensor"] for r in rows] == ["a.weight"]
    assert any("b.weight" in str(w.message) for w in caught)
    # ΔW = 0 (a frozen tensor): a row with the norm and no ratios, not a division by zero.
    (zero,) = SpectralProbe(k=4).record(0, None, [("c.weight", good)], {"c.weight": good.clone()})
    assert zero["drift_norm"] == 0.0 and zero["rank1_energy"] is None and zero["sigma"] == []


def test_identical_inputs_give_identical_rows_and_default_schedule():
    g = torch.Generator().manual_seed(8)
    w0 = torch.randn(64, 48, generator=g)
    w = w0 + 0.05 * torch.randn(64, 48, generator=g)
    r1 = SpectralProbe(k=8).record(3, None, [("x.weight", w)], {"x.weight": w0})[0]
    r2 = SpectralProbe(k=8).record(3, None, [("x.weight", w.clone())], {"x.weight": w0.clone()})[0]
    for key in ("sigma", "rank1_energy", "off_principal_energy", "spectral_drift", "effective_rank"):
        assert r1[key] == r2[key]
    assert (r1["u1"] == r2["u1"]).all()
    probe = SpectralProbe()
    assert probe.due(0) and probe.due(20) and not probe.due(5)


def test_new_reference_drops_stale_caches():
    g = torch.Generator().manual_seed(9)
    ref_a = torch.randn(40, 30, generator=g)
    ref_b = ref_a + 0.5 * torch.randn(40, 30, generator=g)  # θ₀ reset at a stage switch
    w = ref_b + 0.05 * torch.randn(40, 30, generator=g)
    probe = SpectralProbe(k=4, time_budget=None)
    probe.record(1, "sft", [("x.weight", w)], {"x.weight": ref_a})
    (after,) = probe.record(2, "rl", [("x.weight", w)], {"x.weight": ref_b})
    (fresh,) = SpectralProbe(k=4, time_budget=None).record(2, "rl", [("x.weight", w)], {"x.weight": ref_b})
    assert after["angle_left_deg"] is None  # no rotation against a ΔW measured from another θ₀
    assert after["off_principal_energy"] == fresh["off_principal_energy"]
    assert after["spectral_drift"] == fresh["spectral_drift"]
    (same,) = probe.record(3, "rl", [("x.weight", w * 1.01)], {"x.weight": ref_b.clone()})
    assert same["angle_left_deg"] is not None  # same θ₀ values (a new tensor object) keep the caches


def test_live_spectra_run_beside_training_with_the_values_of_a_direct_record(tmp_path):
    """Under watch() on a host the spectra run on the post-step pass thread: the rows are those a direct
    record of the same weights gives, the training thread's random draws in between are the ones it would
    get without the probe, and the next optimizer step waits for them."""
    import threading

    import dynascope
    from dynascope.store import open_store

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.Linear(64, 32))
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scope = dynascope.watch(model, opt, run=tmp_path / "run", spectral={"every": 1, "time_budget": None, "k": 4},
                            memory_budget=None, time_budget=None)
    threads: set[str] = set()
    probe = scope.spectral
    record = probe.record
    probe.record = lambda *a: (threads.add(threading.current_thread().name), record(*a))[1]
    snapshots, draws = [], []
    for _ in range(3):
        model(torch.randn(8, 48)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
        draws.append(torch.rand(4))  # drawn while the spectra may be running
    scope.close()
    torch.manual_seed(0)
    torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.Linear(64, 32))
    for _ in range(3):
        torch.randn(8, 48)
        assert torch.equal(torch.rand(4), draws.pop(0))
    assert threads == {t for t in threads if t.startswith("dynascope-pass")} and threads
    with open_store(tmp_path / "run") as store:
        got = store.rows("SELECT step, tensor, rank1_energy, spectral_drift FROM spectra ORDER BY step, tensor")
    direct = SpectralProbe(k=4, time_budget=None)
    want = []
    for step, snap in enumerate(snapshots):
        names = [n for n in snap if snap[n].ndim == 2]
        rows = direct.record(step, None, [(n, snap[n]) for n in names], {n: w0[n] for n in names})
        want += sorted((step, r["tensor"], r["rank1_energy"], r["spectral_drift"]) for r in rows)
    assert [tuple(r) for r in got] == want
