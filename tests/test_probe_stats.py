"""The probes' pure statistics against naive per-tensor references (fp32, bf16, fp64, empty, NaN/Inf)."""

from __future__ import annotations

import math

import pytest
import torch

from dynascope.probes.snapshots import SnapshotArena, StepSnapshot
from dynascope.stats.builtin.grad import grad_counts, grad_norms
from dynascope.stats.engine import (
    DRIFT_STAT_COLUMNS,
    UPDATE_STAT_COLUMNS,
    UPDATE_STATS,
    compute,
    weight_drift_stats,
    weight_update_stats,
)
from dynascope.stats.kernels import norms

from helpers.naive_stats import naive_grad, naive_update


def tensor_update_stats(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return compute(UPDATE_STATS, {"new": new, "old": old})


def naive_bf16_unchanged(new: torch.Tensor, old: torch.Tensor) -> int:
    """PULSE S₁'s count, element by element: the bf16 casts' 16-bit patterns are equal."""
    nb = new.reshape(-1).to(torch.bfloat16).view(torch.int16).tolist()
    ob = old.reshape(-1).to(torch.bfloat16).view(torch.int16).tolist()
    return sum(a == b for a, b in zip(nb, ob, strict=True))


def _pairs(dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    old = [torch.randn(17, 9, generator=g), torch.randn(40, generator=g) * 1e-3, torch.zeros(5),
           torch.randn(0), torch.randn(3, 4, 5, generator=g)]
    new = []
    for i, o in enumerate(old):
        step = torch.randn(o.shape, generator=g) * (1e-4 if i % 2 else 1e-1)
        mask = torch.rand(o.shape, generator=g) < 0.5  # half the elements do not move at all
        new.append(torch.where(mask, o, o + step))
    old, new = [t.to(dtype) for t in old], [t.to(dtype) for t in new]
    return new, old


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
def test_weight_update_stats_matches_naive(dtype: torch.dtype) -> None:
    new, old = _pairs(dtype)
    got = weight_update_stats(new, old)
    assert got.dtype == torch.float64 and got.shape == (len(new), len(UPDATE_STAT_COLUMNS))
    for i, (a, b) in enumerate(zip(new, old, strict=False)):
        want = naive_update(a, b)
        # norms accumulate in fp32 for 16-bit and fp32 inputs; counts are exact
        assert got[i, 0].item() == pytest.approx(want[0], rel=1e-5, abs=1e-12)
        assert got[i, 1].item() == pytest.approx(want[1], rel=1e-5, abs=1e-12)
        assert got[i, 2:7].tolist() == want[2:], (dtype, i)
        assert got[i, UPDATE_STAT_COLUMNS.index("bf16_unchanged_count")].item() == naive_bf16_unchanged(a, b)
    assert got[3].tolist() == [0.0] * len(UPDATE_STAT_COLUMNS)  # the empty tensor


def test_weight_update_stats_nan_inf_signs_and_tiny_updates() -> None:
    old = torch.tensor([1.0, -2.0, 3.0, 0.0, 5.0, 1e-30, 7.0, float("nan")])
    new = torch.tensor([1.0, 2.0, float("nan"), -1.0, float("inf"), -1e-30, 7.0 + 1e-6, float("nan")])
    got = weight_update_stats([new], [old])[0].tolist()
    want = naive_update(new, old)
    assert got[2:7] == want[2:]
    assert got[4] == 2  # -2→2 and 1e-30→-1e-30 flip; 0→-1 is not a flip
    assert got[5] == 2 and got[6] == 1
    # 7 → 7+1e-6 changes its bits but is below η·|w|: bit-exact yes, bf16-relative no
    one = weight_update_stats([torch.tensor([7.0 + 1e-6])], [torch.tensor([7.0])])[0]
    assert one[2].item() == 1 and one[3].item() == 0


def test_bit_exact_is_nan_when_dtypes_differ() -> None:
    a = torch.randn(10)
    got = weight_update_stats([a.bfloat16()], [a])[0]
    assert math.isnan(got[2].item())
    assert not math.isnan(got[3].item())  # the relative criterion still makes sense across dtypes


def test_weight_update_stats_rejects_mismatches() -> None:
    with pytest.raises(ValueError):
        weight_update_stats([torch.zeros(2)], [])
    with pytest.raises(ValueError):
        weight_update_stats([torch.zeros(2)], [torch.zeros(3)])
    assert weight_update_stats([], []).shape == (0, len(UPDATE_STAT_COLUMNS))


def test_step_snapshot_is_released() -> None:
    p = [torch.randn(6, 6), torch.randn(6)]
    snap = StepSnapshot()
    snap.take(p)
    assert snap.pending
    before = [t.clone() for t in p]
    with torch.no_grad():
        p[0].add_(0.5)
    old = snap.pop(len(p))
    assert not snap.pending
    assert torch.equal(weight_update_stats(p, old), weight_update_stats(p, before))
    with pytest.raises(RuntimeError):
        snap.pop(len(p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_stats_match_naive(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    a = torch.randn(50, generator=g)
    a[::7] = 0.0
    a[3] = 1e-12  # near zero against rms ~1
    grads = [a, torch.zeros(8), torch.randn(0), torch.randn(4, 4, generator=g) * 1e-3]
    grads = [t.to(dtype) for t in grads]
    norms_ = grad_norms(grads)
    counts = grad_counts(grads, norms_[:, 0])
    for i, t in enumerate(grads):
        want = naive_grad(t)
        assert norms_[i, 0].item() == pytest.approx(want[0], rel=1e-5, abs=1e-30)
        assert counts[i, 0].item() == pytest.approx(want[1], rel=1e-6, abs=1e-30)
        assert counts[i, 1:].tolist() == want[2:], (dtype, i)
    assert counts[0, 2].item() >= counts[0, 1].item() + (1 if dtype == torch.float32 else 0)


def test_grad_stats_nonfinite_and_tol() -> None:
    g = torch.tensor([0.0, 1.0, float("nan"), float("-inf"), 1e-3])
    n = grad_norms([g])
    assert math.isnan(n[0, 0].item())
    c = grad_counts([g])[0].tolist()
    assert math.isnan(c[0]) and c[1] == 1 and c[3] == 1 and c[4] == 1
    h = torch.tensor([1.0, 1e-3, 0.5])
    assert grad_counts([h], tol=1e-2)[0, 2].item() == 1  # 1e-3 <= 0.01·rms(≈0.65)
    assert grad_counts([h], tol=None)[0, 2].item() == 0


def test_drift_stats_are_the_update_family_under_drift_names_plus_bf16_sparsity() -> None:
    new, old = _pairs(torch.float32)
    full = weight_update_stats(old, new)  # θ₀ as "new": w_norm is then ‖θ₀‖ (drift_ratio's denominator)
    drift = weight_drift_stats(new, old)
    assert DRIFT_STAT_COLUMNS[:4] == ("ref_norm", "drift_norm", "drift_changed_count", "drift_changed_rel_count")
    assert torch.equal(drift[:, :4], full[:, :4])
    for i, (a, b) in enumerate(zip(new, old, strict=True)):
        d = a.bfloat16() - b.bfloat16()
        assert drift[i, 4].item() == sum(abs(x) <= 1.0013580322265625e-05 for x in d.double().reshape(-1).tolist())
        assert drift[i, 5].item() == sum(x == 0 for x in d.reshape(-1).tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_statistics_equal_whole_tensor_ones(dtype: torch.dtype, chunk: int) -> None:
    """Chunk boundaries never change a count, and norms only by rounding (root of summed squares)."""
    new, old = _pairs(dtype)
    new[0] = new[0].clone()
    new[0].view(-1)[[3, 50, 51]] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)
    whole = weight_update_stats(new, old)
    got = weight_update_stats(new, old, chunk_elems=chunk)
    torch.testing.assert_close(got[:, 2:], whole[:, 2:], rtol=0, atol=0, equal_nan=True)  # counts, maxima: exact
    torch.testing.assert_close(got[:, :2], whole[:, :2], rtol=1e-6, atol=1e-12, equal_nan=True)
    lean = weight_drift_stats(new, old, chunk_elems=chunk)
    torch.testing.assert_close(lean, weight_drift_stats(new, old), rtol=1e-6, atol=1e-12, equal_nan=True)
    g = [t.to(dtype) for t in (torch.randn(50) * (torch.rand(50) < 0.5), torch.tensor([0.0, float("nan")]),
                               torch.randn(0), torch.randn(3, 5))]
    gn = grad_norms(g)[:, 0]
    torch.testing.assert_close(grad_counts(g, gn, chunk_elems=chunk), grad_counts(g, gn), rtol=0, atol=0,
                               equal_nan=True)


def test_snapshot_arena_reuses_one_host_buffer_and_snapshots_exactly() -> None:
    """Windows of any dtypes and shapes are carved from one buffer that persists (the same pages every
    window) and grows only for a larger window; the statistics equal those of a fresh clone."""
    torch.manual_seed(0)
    big = [torch.randn(64, 33), torch.randn(7).to(torch.bfloat16), torch.randn(3, 5).double()]
    small = [torch.randn(5, 5), torch.randn(9).half()]
    upd = StepSnapshot()
    ptrs = []
    for window in (big, small, big):
        old = [p.clone() for p in window]
        upd.take(window)
        snap = upd._snap
        assert snap is not None and all(s.is_contiguous() and s.dtype == p.dtype and s.shape == p.shape
                                        for s, p in zip(snap, window, strict=True))
        assert all(s.data_ptr() % SnapshotArena.ALIGN == 0 for s in snap)
        ptrs.append(snap[0].data_ptr())
        for p in window:
            p.add_(torch.randn_like(p) * 1e-2)  # the step
        got = torch.stack([tensor_update_stats(p, o) for p, o in zip(window, upd.pop(len(window)), strict=True)])
        want = torch.stack([tensor_update_stats(p, o) for p, o in zip(window, old, strict=True)])
        assert torch.equal(got, want)
    assert ptrs[0] == ptrs[1] == ptrs[2]  # the smaller window and the next large one reuse the buffer
    assert upd.arena.nbytes == sum(-(-p.numel() * p.element_size() // 64) * 64 for p in big)
    upd.take([torch.randn(4000)])  # a larger window grows it
    upd.pop(1)
    assert upd.arena.nbytes >= 16_000
    upd.close()
    assert upd.arena.nbytes == 0 and not upd.pending


def test_norms_on_the_host_match_a_float64_reference() -> None:
    """The host path the probe takes (the asking statistic's fused pass, each square summed in float64) at a
    size where fp32 accumulation error shows, on a contiguous and a transposed tensor; the fallback that
    runs while the kernel compiles accumulates in fp32 and stays within fp32's bound; Inf and NaN propagate."""
    from dynascope.stats import fused
    from dynascope.stats.builtin.weights import W_NORM

    g = torch.Generator().manual_seed(3)
    big = torch.randn(1 << 20, generator=g) * 1e-3
    ts = [big, torch.randn(64, 32, generator=g).t(), torch.zeros(0), torch.tensor([3.0, float("inf")]),
          torch.tensor([float("nan"), 1.0])]
    want = [t.double().norm().item() for t in ts[:3]]
    plain = norms(ts)  # no statistic: the fp32 fallback
    assert plain.dtype == torch.float64
    for t, n, w in zip(ts[:3], plain[:3].tolist(), want, strict=True):
        assert n == pytest.approx(w, rel=1e-4, abs=0.0), (tuple(t.shape), n, w)
    assert math.isinf(plain[3].item()) and math.isnan(plain[4].item())
    if not fused.available():
        return
    norms(ts, W_NORM)
    fused.wait_compiled()
    got = norms(ts, W_NORM)
    for t, n, w in zip(ts[:3], got[:3].tolist(), want, strict=True):
        assert n == pytest.approx(w, rel=1e-8, abs=0.0), (tuple(t.shape), n, w)
    assert math.isinf(got[3].item()) and math.isnan(got[4].item())
