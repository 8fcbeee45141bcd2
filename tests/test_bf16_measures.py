"""PULSE S₁/S_k and Mukherjee et al.'s update sparsity: planted weights with exact counts by construction,
in the pure functions, the live probe and ``dynascope diff`` (which must agree on every new column)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import dynascope
from dynascope.importers.checkpoint_diff import diff_checkpoints
from dynascope.stats.builtin.bf16_visibility import bf16_unchanged_count
from dynascope.stats.builtin.drift_sparsity import drift_sparsity_counts
from dynascope.stats.engine import UPDATE_STAT_COLUMNS, weight_drift_stats, weight_update_stats
from dynascope.store import open_store
from dynascope.store.rollup import tensor_stats_by_kind

from helpers.bf16_plants import S1_PAIRS, S1_UNCHANGED
from helpers.bf16_plants import pair as _pair

# Mukherjee plant: (W₀, W_t) whose bf16 difference sits on either side of 1e-5.
ULP_AT_2M10 = 2.0 ** -17  # bf16 ulp on [2^-10, 2^-9): 7.63e-6
NEAREST_1E5 = 1.0013580322265625e-05  # bf16(1e-5): torch.isclose's bound when Δ is bf16
DRIFT_PAIRS = [
    (2 ** -10, 2 ** -10),  # Δ = 0: zero and unchanged
    (1.0, 1.0 + 1e-6),  # an fp32 change bf16 cannot see: Δ = 0, although its bits changed
    (2 ** -10, 2 ** -10 + ULP_AT_2M10),  # Δ = 7.63e-6 ≤ 1e-5: unchanged, not zero
    (2 ** -10, 2 ** -10 + 2 * ULP_AT_2M10),  # Δ = 1.53e-5: changed
    (0.0, 9.953975677490234e-06),  # Δ just under 1e-5 (the bf16 below it): unchanged
    (0.0, NEAREST_1E5),  # Δ = bf16(1e-5) = 1.00136e-5: unchanged, as isclose on bf16 decides
    (0.0, 1.0073184967041016e-05),  # Δ just over (the next bf16): changed
    (0.0, -1.0073184967041016e-05),  # the same below zero: changed
]
DRIFT_UNCHANGED, DRIFT_ZERO = 5, 2


def test_s1_counts_bitwise_bf16_identity_on_either_side_of_a_rounding_boundary() -> None:
    old, new = _pair(S1_PAIRS)
    assert old.dtype == torch.float32 and bf16_unchanged_count(new, old)[0].item() == S1_UNCHANGED
    got = dict(zip(UPDATE_STAT_COLUMNS, weight_update_stats([new], [old])[0].tolist(), strict=True))
    assert got["bf16_unchanged_count"] == S1_UNCHANGED
    assert got["changed_count"] == 6  # bit-exact in fp32: every pair but the unchanged one moved
    # bf16 masters: S₁ is then the complement of the bit-exact count; fp64 masters cast the same way
    assert bf16_unchanged_count(new.bfloat16(), old.bfloat16())[0].item() == S1_UNCHANGED
    assert bf16_unchanged_count(new.double(), old.double())[0].item() == S1_UNCHANGED
    assert bf16_unchanged_count(torch.tensor([0.0]), torch.tensor([-0.0]))[0].item() == 0  # bits, not values


def test_mukherjee_sparsity_on_either_side_of_1e5() -> None:
    w0, wt = _pair(DRIFT_PAIRS)
    unchanged, zero = (t.item() for t in drift_sparsity_counts(wt, w0))
    assert (unchanged, zero) == (DRIFT_UNCHANGED, DRIFT_ZERO)
    d = wt.bfloat16() - w0.bfloat16()  # the paper's script, verbatim
    assert torch.isclose(d, torch.zeros_like(d), atol=1e-5).sum().item() == DRIFT_UNCHANGED
    assert (d == 0).sum().item() == DRIFT_ZERO
    drift = weight_drift_stats([wt], [w0])[0].tolist()
    assert drift[4:] == [DRIFT_UNCHANGED, DRIFT_ZERO] and drift[2] == 7  # bit-exact drift sees the 1e-6 too


def test_chunk_boundaries_never_change_the_new_counts() -> None:
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(1000, generator=g) * 1e-2
    wt = w0 + torch.randn(1000, generator=g) * 1e-5
    for chunk in (1, 7, 333, None):
        u = weight_update_stats([wt], [w0], chunk_elems=chunk)[0]
        d = weight_drift_stats([wt], [w0], chunk_elems=chunk)[0]
        assert u[UPDATE_STAT_COLUMNS.index("bf16_unchanged_count")].item() == bf16_unchanged_count(wt, w0)[0].item()
        assert d[4:].tolist() == [t.item() for t in drift_sparsity_counts(wt, w0)]


class Planted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s1 = nn.Parameter(torch.zeros(len(S1_PAIRS)))
        self.drift = nn.Parameter(torch.zeros(len(DRIFT_PAIRS)))


def _planted_steps() -> list[dict[str, torch.Tensor]]:
    """Weights after steps 0..4: S1_PAIRS' old at step 0, then new, old, new, new;
    ``drift`` moves from W₀ to W_t at step 1 and stays."""
    s_old, s_new = _pair(S1_PAIRS)
    d0, dt = _pair(DRIFT_PAIRS)
    return [{"s1": s_old, "drift": d0}, {"s1": s_new, "drift": dt}, {"s1": s_old, "drift": dt},
            {"s1": s_new, "drift": dt}, {"s1": s_new, "drift": dt}]


def _live_and_diff(tmp_path: Path, bf16_k: int, memory_budget: float | None) -> tuple[dict, dict]:
    """Plant the weights step by step under the live probe (manual boundaries), save each step as a
    checkpoint, diff the checkpoints; both runs' tensor_stats rows by (step, tensor)."""
    model = Planted()
    states = _planted_steps()
    d0, _ = _pair(DRIFT_PAIRS)
    s0, _ = _pair(S1_PAIRS)
    with torch.no_grad():
        model.s1.copy_(s0)
        model.drift.copy_(d0)
    save_file({k: v.clone() for k, v in model.state_dict().items()}, tmp_path / "base.safetensors")
    paths = []
    with dynascope.watch(model, None, run=tmp_path / "live", memory_budget=memory_budget, system_interval_s=None,
                         bf16_k=bf16_k, time_budget=None) as scope:
        for step, st in enumerate(states):
            with torch.no_grad():
                model.s1.copy_(st["s1"])
                model.drift.copy_(st["drift"])
            paths.append(tmp_path / f"step-{step}.safetensors")
            save_file({k: v.clone() for k, v in model.state_dict().items()}, paths[-1])
            scope.step()
    diff_checkpoints(tmp_path / "base.safetensors", paths, tmp_path / "diff", k=0, bf16_k=bf16_k)

    def rows(run: Path) -> dict:
        with open_store(run) as con:
            df = con.sql("SELECT * FROM tensor_stats ORDER BY step, tensor").pl()
        return {(r["step"], r["tensor"]): r for r in df.iter_rows(named=True)}
    return rows(tmp_path / "live"), rows(tmp_path / "diff")


NEW_COLUMNS = ("bf16_unchanged_count", "bf16_unchanged_frac", "bf16_unchanged_k_count", "bf16_unchanged_k_frac",
               "bf16_k_steps", "drift_unchanged_count", "drift_unchanged_frac", "drift_zero_count", "drift_zero_frac")


@pytest.mark.parametrize("memory_budget", [None, 1.2])  # S_k snapshot resident, then on disk (1.2 < 1 + 0.5)
def test_live_probe_and_diff_agree_on_planted_weights(tmp_path: Path, memory_budget: float | None) -> None:
    live, off = _live_and_diff(tmp_path, bf16_k=2, memory_budget=memory_budget)
    assert set(live) == set(off) == {(s, t) for s in range(5) for t in ("s1", "drift")}
    for key, row in off.items():
        for col in NEW_COLUMNS:
            assert row[col] == live[key][col], (key, col, row[col], live[key][col])
    n1 = len(S1_PAIRS)
    # S₁ of s1: step 0 compares the plant's old with itself (all unchanged), then old↔new, new↔new last
    assert [off[(s, "s1")]["bf16_unchanged_count"] for s in range(5)] == [n1, S1_UNCHANGED, S1_UNCHANGED,
                                                                           S1_UNCHANGED, n1]
    assert off[(1, "s1")]["bf16_unchanged_frac"] == S1_UNCHANGED / n1
    # S_2: a snapshot at step 0, compared at step 2 (old vs old); the next at 2, compared at 4 (new vs old)
    assert [off[(s, "s1")]["bf16_unchanged_k_count"] for s in range(5)] == [None, None, n1, None, S1_UNCHANGED]
    assert [off[(s, "s1")]["bf16_k_steps"] for s in range(5)] == [None, None, 2, None, 2]
    # Mukherjee against W₀ = the base: nothing moved at step 0, the plant from step 1 on
    nd = len(DRIFT_PAIRS)
    assert [off[(s, "drift")]["drift_unchanged_count"] for s in range(5)] == [nd] + [DRIFT_UNCHANGED] * 4
    assert [off[(s, "drift")]["drift_zero_count"] for s in range(5)] == [nd] + [DRIFT_ZERO] * 4
    assert off[(3, "drift")]["drift_zero_frac"] == DRIFT_ZERO / nd
    if memory_budget is not None:
        assert (tmp_path / "live" / "reference" / "bf16-k-r0.safetensors").exists()  # the on-disk snapshot


def test_live_probe_and_diff_agree_on_adam_at_a_small_learning_rate(tmp_path: Path) -> None:
    """A real optimizer where updates straddle bf16's resolution: every new column agrees row by row."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-5)
    save_file({k: v.clone() for k, v in model.state_dict().items()}, tmp_path / "base.safetensors")
    paths = []
    with dynascope.watch(model, opt, run=tmp_path / "live", memory_budget=None, system_interval_s=None,
                         bf16_k=3) as scope:
        for _ in range(7):
            x = torch.randn(8, 16)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            paths.append(tmp_path / f"ckpt-{scope.step_index - 1}.safetensors")
            save_file({k: v.clone() for k, v in model.state_dict().items()}, paths[-1])
    diff_checkpoints(tmp_path / "base.safetensors", paths, tmp_path / "diff", k=0, bf16_k=3)
    with open_store(tmp_path / "live") as a, open_store(tmp_path / "diff") as b:
        q = f"SELECT step, tensor, numel, {', '.join(NEW_COLUMNS)} FROM tensor_stats ORDER BY step, tensor"
        live, off = a.sql(q).pl(), b.sql(q).pl()
    assert live.equals(off)
    fracs = live["bf16_unchanged_frac"].to_list()
    assert 0 < min(fracs) and min(fracs[4:]) < 1  # neither all visible nor all invisible: a real test
    # S_3: snapshots at steps 0 and 3, compared at 3 and 6; the other five steps have none
    assert sorted(set(live.filter(live["bf16_k_steps"].is_not_null())["step"])) == [3, 6]
    assert live["bf16_unchanged_k_count"].null_count() == 5 * 4


def test_rollups_pool_the_new_counts_through_the_registry(tmp_path: Path) -> None:
    live, _ = _live_and_diff(tmp_path, bf16_k=2, memory_budget=None)
    with open_store(tmp_path / "live") as con:
        raw = con.sql("SELECT * FROM tensor_stats").pl().to_arrow()
        by_kind = {(r["step"], r["kind"]): r for r in con.sql("SELECT * FROM tensor_stats_by_kind").pl().iter_rows(named=True)}
    pooled = {(r["step"], r["kind"]): r for r in tensor_stats_by_kind(raw).to_pylist()}
    assert pooled.keys() == by_kind.keys()
    for key, r in pooled.items():
        rows = [v for (s, _), v in live.items() if (s, v["kind"]) == key]
        for col in ("bf16_unchanged_count", "bf16_unchanged_k_count", "drift_unchanged_count", "drift_zero_count"):
            vals = [v[col] for v in rows if v[col] is not None]
            assert r[col] == (sum(vals) if vals else None) == by_kind[key][col], (key, col)
        assert r["bf16_unchanged_numel"] == sum(v["numel"] for v in rows)
        k_numel = [v["numel"] for v in rows if v["bf16_unchanged_k_count"] is not None]
        assert r["bf16_unchanged_k_numel"] == (sum(k_numel) if k_numel else None)

