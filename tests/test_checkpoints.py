"""AlphaRL's rank-1 replacement (dynascope.checkpoints.alpharl_rank1) on planted checkpoints with exact values."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from dynascope.checkpoints import alpharl_rank1, alpharl_target, rank1_replacement
from dynascope.store import StoreError

Q = "model.layers.0.self_attn.q_proj.weight"
UP = "model.layers.1.mlp.up_proj.weight"
Q_BIAS = "model.layers.0.self_attn.q_proj.bias"
NORM = "model.layers.0.input_layernorm.weight"
EMBED, HEAD, FINAL_NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"


def _orthonormal(n: int, k: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q


def _planted(rows: int, cols: int, sigmas: list[float], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ΔW = Σ σᵢ aᵢbᵢᵀ with orthonormal a, b: its SVD is known exactly; returns (ΔW, a₁, b₁)."""
    a, b = _orthonormal(rows, len(sigmas), seed), _orthonormal(cols, len(sigmas), seed + 1)
    return a @ torch.diag(torch.tensor(sigmas, dtype=torch.float64)) @ b.T, a[:, 0], b[:, 0]


def _checkpoints(tmp_path, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    base = {n: torch.randn(*s, generator=g, dtype=torch.float64) for n, s in
            ((Q, (12, 8)), (UP, (16, 8)), (Q_BIAS, (12,)), (NORM, (8,)), (EMBED, (20, 8)), (HEAD, (20, 8)),
             (FINAL_NORM, (8,)))}
    d_q, a_q, b_q = _planted(12, 8, [3.0, 1.0], seed=1)   # σ₁² / ‖ΔW‖² = 9 / 10
    d_up, a_up, b_up = _planted(16, 8, [2.0, 2.0 / 3.0, 0.5], seed=3)
    rl = {n: w.clone() for n, w in base.items()}
    rl[Q] += d_q
    rl[UP] += d_up
    for n in (Q_BIAS, NORM, EMBED, HEAD, FINAL_NORM):
        rl[n] += 0.25  # the rest moves too: kept at base or taken whole, never rank-1'd
    save_file({n: w.to(dtype) for n, w in base.items()}, tmp_path / "base.safetensors")
    save_file({n: w.to(dtype) for n, w in rl.items()}, tmp_path / "rl.safetensors")
    want = {Q: base[Q] + math.sqrt(10.0) * torch.outer(a_q, b_q),
            UP: base[UP] + math.sqrt(4 + 4 / 9 + 0.25) * torch.outer(a_up, b_up)}
    return base, rl, want


def test_which_tensors_are_replaced():
    assert alpharl_target(Q, (12, 8)) and alpharl_target(UP, (16, 8))
    assert alpharl_target("model.layers.3.mlp.down_proj.weight", (8, 16))
    assert alpharl_target("transformer.h.2.attn.c_attn.weight", (8, 24))
    for name, shape in ((Q_BIAS, (12,)), (NORM, (8,)), (EMBED, (20, 8)), (HEAD, (20, 8)), (FINAL_NORM, (8,)),
                        ("model.layers.0.self_attn.q_norm.weight", (8,)),
                        ("model.layers.0.input_layernorm.weight", (8, 8))):
        assert not alpharl_target(name, shape), name


@pytest.mark.parametrize("rest", ["base", "rl"])
def test_rank1_replacement_exact_in_float64(tmp_path, rest):
    base, rl, want = _checkpoints(tmp_path)
    report = alpharl_rank1(tmp_path / "base.safetensors", tmp_path / "rl.safetensors", tmp_path / "out.safetensors",
                           rest=rest, other_rest_path=tmp_path / "other.safetensors")
    out = load_file(tmp_path / "out.safetensors")
    other = load_file(tmp_path / "other.safetensors")  # the other variant, same rank-1 tensors
    for n in base:
        assert torch.equal(other[n], out[n] if n in (Q, UP) else (rl[n] if rest == "base" else base[n])), n
    assert set(out) == set(base)
    for n in (Q, UP):  # ‖ΔW‖_F·u₁v₁ᵀ; u₁v₁ᵀ's sign is unique, so this is exact up to float64 rounding
        torch.testing.assert_close(out[n], want[n], rtol=0, atol=1e-12)
    for n in (Q_BIAS, NORM, EMBED, HEAD, FINAL_NORM):
        assert torch.equal(out[n], base[n] if rest == "base" else rl[n]), n
    rows = {r["tensor"]: r for r in report.iter_rows(named=True)}
    assert rows[Q]["action"] == "rank1" and rows[Q]["rank1_energy"] == pytest.approx(0.9, abs=1e-12)
    assert rows[Q]["drift_norm"] == pytest.approx(math.sqrt(10.0), abs=1e-12)
    assert rows[Q]["sigma1"] == pytest.approx(3.0, abs=1e-12)
    assert rows[UP]["rank1_energy"] == pytest.approx(4 / (4 + 4 / 9 + 0.25), abs=1e-12)
    assert {rows[n]["action"] for n in (Q_BIAS, NORM, EMBED, HEAD, FINAL_NORM)} == {rest}


def test_written_in_the_models_dtype(tmp_path):
    base, rl, want = _checkpoints(tmp_path, dtype=torch.bfloat16)
    alpharl_rank1(tmp_path / "base.safetensors", tmp_path / "rl.safetensors", tmp_path / "out.safetensors")
    out = load_file(tmp_path / "out.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in out.values())
    b16 = load_file(tmp_path / "base.safetensors")
    r16 = load_file(tmp_path / "rl.safetensors")
    direct, _ = rank1_replacement(b16[Q], r16[Q])  # the sum in float32, one cast back to bf16
    assert torch.equal(out[Q], direct)
    delta = r16[Q].float() - b16[Q].float()
    u, _, vh = torch.linalg.svd(delta)
    expect = (b16[Q].float() + torch.linalg.matrix_norm(delta) * torch.outer(u[:, 0], vh[0])).to(torch.bfloat16)
    assert torch.equal(out[Q], expect)


def test_zero_update_and_bad_inputs(tmp_path):
    w = torch.randn(6, 4, dtype=torch.float32)
    same, stats = rank1_replacement(w, w.clone())
    assert torch.equal(same, w) and stats["drift_norm"] == 0.0 and stats["rank1_energy"] is None
    base, rl, _ = _checkpoints(tmp_path)
    save_file({n: t for n, t in rl.items() if n != NORM}, tmp_path / "short.safetensors")
    with pytest.raises(StoreError, match="names differ"):
        alpharl_rank1(tmp_path / "base.safetensors", tmp_path / "short.safetensors", tmp_path / "x.safetensors")
    save_file({EMBED: base[EMBED]}, tmp_path / "e0.safetensors")
    save_file({EMBED: rl[EMBED]}, tmp_path / "e1.safetensors")
    with pytest.raises(StoreError, match="no attention or MLP weight"):
        alpharl_rank1(tmp_path / "e0.safetensors", tmp_path / "e1.safetensors", tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="rest must be"):
        alpharl_rank1(tmp_path / "base.safetensors", tmp_path / "rl.safetensors", tmp_path / "x.safetensors", rest="x")
