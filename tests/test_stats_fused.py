"""The fused pass (numba) and the element functions on chunk tensors against a direct computation.

Planted boundary values, every one paired with every other: bf16 rounding ties (even and odd last kept
bit), the largest finite fp32 (rounds to +Inf in bf16), fp32 and bf16 subnormals, ±0, ±Inf, NaNs with
different payloads and signs. The direct computation is the definitions written out with PyTorch's own
casts and comparisons; the fused kernel must give the same counts exactly and the same norms to 1e-12.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dynascope.stats import fused
from dynascope.stats.base import Chunk, Settings
from dynascope.stats.builtin.drift_sparsity import DRIFT_ATOL_BF16
from dynascope.stats.engine import Pass, compute
from dynascope.stats.registry import REGISTRY

pytestmark = pytest.mark.skipif(not fused.available(), reason="numba is not installed")

BY_NAME = {s.name: s for s in REGISTRY.statistics}
WEIGHT_STATS = [BY_NAME[n] for n in ("update", "signs", "bf16_unchanged", "update_max_abs", "drift", "drift_sparsity",
                                     "bf16_unchanged_k")]


def _bits(*ints: int) -> list[float]:
    return torch.tensor(ints, dtype=torch.int64).to(torch.int32).view(torch.float32).tolist()


BOUNDARY = [0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, 3.4028234663852886e38, -3.4028234663852886e38, 1e-40, -1e-40,
            1e-45, 1e-38, 9.2e-41, 1.00135803e-05, 1.0073e-05, 1e-05, -1e-05, 2.0] + _bits(
    0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0xBF808000, 0xBF818000,  # ties to even (down / up), just off
    0x7F7F8000, 0x7F7FFFFF, 0x00008000, 0x00018000, 0x00007FFF, 0x80008000,  # to Inf, subnormal ties
    0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFC00000, 0xFF800001, 0x7FBFFFFF)  # NaNs: quiet, signalling, negative


def _pairs(n_random: int = 5000) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, b, c): every boundary value against every other (a, b), then random weights with tiny updates;
    c is a third tensor for θ₀."""
    pairs = list(itertools.product(BOUNDARY, BOUNDARY))
    a = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    b = torch.tensor([p[1] for p in pairs], dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n_random, generator=g) * 0.02
    a = torch.cat([a, w])
    b = torch.cat([b, w + torch.randn(n_random, generator=g) * 1e-6])
    c = torch.cat([b[:len(pairs)].flip(0), w + torch.randn(n_random, generator=g) * 3e-5])
    return a, b, c


def _direct(new: torch.Tensor, old: torch.Tensor, ref: torch.Tensor, k: torch.Tensor, eta: float = 1e-3) -> dict:
    """The definitions written out (docs/sparsity.md), whole tensors, PyTorch's own casts."""
    def key(t: torch.Tensor) -> torch.Tensor:
        return (t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)).view(torch.int16)

    def changes(a: torch.Tensor, b: torch.Tensor) -> list[float]:
        iv = torch.int32 if a.dtype == torch.float32 else torch.int16
        a32, b32 = a.float(), b.float()
        d = a32 - b32
        return [torch.linalg.vector_norm(a32.double()).item(), torch.linalg.vector_norm(d.double()).item(),
                (a.view(iv) != b.view(iv)).sum().item(),
                (d.abs() > torch.maximum(a32.abs(), b32.abs()) * eta).sum().item()]

    delta = ref.to(torch.bfloat16) - new.to(torch.bfloat16)
    n32, o32 = new.float(), old.float()
    out = dict(zip(("w_norm", "update_norm", "changed_count", "changed_rel_count"), changes(new, old), strict=True))
    out |= dict(zip(("ref_norm", "drift_norm", "drift_changed_count", "drift_changed_rel_count"), changes(ref, new),
                    strict=True))
    out |= {"sign_flip_count": (torch.sign(n32) * torch.sign(o32) < 0).sum().item(),
            "w_nan_count": n32.isnan().sum().item(), "w_inf_count": n32.isinf().sum().item(),
            "bf16_unchanged_count": (key(new) == key(old)).sum().item(),
            "update_max_abs": (n32 - o32).abs().max().item(),
            "drift_unchanged_count": torch.isclose(delta, torch.zeros_like(delta), atol=1e-5).sum().item(),
            "drift_zero_count": (delta == 0).sum().item(),
            "bf16_unchanged_k_count": (key(new) == k.view(torch.int16)).sum().item()}
    return out


def _same(x: float, y: float) -> bool:
    return (math.isnan(x) and math.isnan(y)) or x == y or abs(x - y) <= 1e-12 * max(abs(x), abs(y))


def _fused(p: Pass, tensors: dict[str, torch.Tensor], chunk_elems: int | None = None) -> list[float]:
    x = Chunk(tensors["new"].numel(), Settings())
    for k, v in tensors.items():
        x.set(k, v)
    assert fused.kernel_for(p.statistics, x, wait=True) is not None
    return compute(p, tensors, chunk_elems=chunk_elems).tolist()


def test_bf16_key_is_pytorchs_cast() -> None:
    """Drift sparsity's bound is the bf16 value nearest 1e-5, and the fused key is the cast's bits."""
    assert DRIFT_ATOL_BF16 == torch.tensor(1e-5).to(torch.bfloat16).item()
    a, b, _ = _pairs()
    p = Pass([BY_NAME["bf16_unchanged"]])
    for bb in (b, a.roll(1), torch.full_like(a, float("nan"))):
        assert _fused(p, {"new": a, "old": bb}) == [(a.to(torch.bfloat16).view(torch.int16) ==
                                                     bb.to(torch.bfloat16).view(torch.int16)).sum().item()]


@pytest.mark.parametrize("wide", [False, True])
def test_fused_equals_direct_on_boundaries(wide: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, c = _pairs()
    if wide:  # a large tensor, split over threads, a few chunks
        a, b, c = (t.repeat(40) for t in (a, b, c))
    k = b.to(torch.bfloat16)
    p = Pass(WEIGHT_STATS)
    tensors = {"new": a, "old": b, "ref": c, "k_snapshot": k}
    got = dict(zip(p.outputs, _fused(p, tensors, chunk_elems=len(a) // 3 if wide else None), strict=True))
    want = _direct(a, b, c, k)
    bad = {n: (got[n], want[n]) for n in want if not _same(got[n], want[n])}
    assert not bad
    monkeypatch.setenv("DYNASCOPE_FUSED", "0")  # the same element functions on chunk tensors
    on_tensors = dict(zip(p.outputs, compute(p, tensors).tolist(), strict=True))
    assert {n: v for n, v in on_tensors.items() if not _same(v, got[n]) and not
            (n.endswith("norm") and abs(v - got[n]) <= 1e-6 * abs(v))} == {}


def test_fused_bf16_weights() -> None:
    """bf16 weights: the values are the bits widened, the key is the bits themselves."""
    a, b, c = (t.to(torch.bfloat16) for t in _pairs())
    p = Pass(WEIGHT_STATS)
    tensors = {"new": a, "old": b, "ref": c, "k_snapshot": b}
    got = dict(zip(p.outputs, _fused(p, tensors), strict=True))
    want = _direct(a, b, c, b)
    assert {n: (got[n], want[n]) for n in want if not _same(got[n], want[n])} == {}


def test_fused_gradient_counts() -> None:
    a, _, _ = _pairs()
    a = a.repeat(30)
    norm = torch.linalg.vector_norm(a[a.isfinite()].double()).reshape(()).to(torch.float64)
    p = Pass([BY_NAME["grad_counts"]])
    x = Chunk(a.numel(), Settings())
    x.set("grad", a)
    assert fused.kernel_for(p.statistics, x, wait=True) is not None
    from dynascope.stats.builtin.grad import grad_counts

    got = grad_counts([a], norm.reshape(1), tol=1e-3)[0].tolist()
    thr = norm.float() * (1e-3 / math.sqrt(a.numel()))
    want = [a.abs().max().item(), (a == 0).sum().item(), (a.abs() <= thr).sum().item(), a.isnan().sum().item(),
            a.isinf().sum().item()]
    assert all(_same(x, y) for x, y in zip(got, want, strict=True)), (got, want)
    assert p.element_wise


def test_copies_written_over_the_inputs_they_read() -> None:
    """A pass writes W_t over the snapshot it compares against (fp32) and its bf16 cast over S_k's snapshot,
    element by element after reading them: the statistics are those of the inputs as they were."""
    a, b, c = _pairs()
    k = b.to(torch.bfloat16)
    p = Pass(WEIGHT_STATS)
    want = compute(p, {"new": a, "old": b, "ref": c, "k_snapshot": k}).tolist()
    for on_tensors in (False, True):
        old, ks = b.clone(), k.clone()
        x = Chunk(a.numel(), Settings())
        for name, t in (("new", a), ("old", old), ("ref", c), ("k_snapshot", ks)):
            x.set(name, t)
        x.copies = [("new", old), ("new", ks)]
        assert fused.kernel_for(p.statistics, x, wait=True) is not None
        copies = [("new", lambda lo, hi, t=old: t[lo:hi]), ("new", lambda lo, hi, t=ks: t[lo:hi])]
        readers = {"new": lambda lo, hi: a[lo:hi], "old": lambda lo, hi, t=old: t[lo:hi], "ref": lambda lo, hi: c[lo:hi],
                   "k_snapshot": lambda lo, hi, t=ks: t[lo:hi]}
        if on_tensors:
            p.element_wise = False  # the chunk kernels, then the engine's copy_
        got = p.run(readers, a.numel(), a.device, chunk_elems=777, copies=copies).tolist()
        assert all(_same(u, v) for u, v in zip(got, want, strict=True))
        assert torch.equal(old.view(torch.int32), a.view(torch.int32))
        assert torch.equal(ks.view(torch.int16), a.to(torch.bfloat16).view(torch.int16))


def test_a_kernel_that_fails_to_compile_warns_and_runs_on_chunk_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """numba failing to compile a pass (a numba/numpy mismatch, no writable cache) is said once, and the pass
    runs on chunk tensors with the direct computation's values: slower, never wrong."""
    a, b, c = _pairs()
    k = b.to(torch.bfloat16)
    tensors = {"new": a, "old": b, "ref": c, "k_snapshot": k}

    def broken(*_a: object) -> None:
        raise OSError("no writable cache directory for the fused kernels")
    monkeypatch.setattr(fused, "_build", broken)
    monkeypatch.setattr(fused, "_kernels", {})
    monkeypatch.setenv("DYNASCOPE_FUSED", "sync")
    p = Pass(WEIGHT_STATS)
    x = Chunk(a.numel(), Settings())
    for name, t in tensors.items():
        x.set(name, t)
    with pytest.warns(RuntimeWarning, match="not compiled.*no writable cache"):
        assert fused.kernel_for(p.statistics, x) is None
    assert fused.kernel_for(p.statistics, x) is None  # for good, without a second warning
    got = dict(zip(p.outputs, compute(p, tensors).tolist(), strict=True))
    want = _direct(a, b, c, k)
    assert {n: (got[n], want[n]) for n in want if not _same(got[n], want[n]) and not
            (n.endswith("norm") and abs(got[n] - want[n]) <= 1e-6 * abs(want[n]))} == {}


@pytest.mark.parametrize("threads,chunk_elems", [(1, None), (3, 50_000), (2, 7)])
def test_many_tensors_in_one_call_equal_each_alone(threads: int, chunk_elems: int | None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``Pass.run_many`` (segments of many tensors per kernel call, cut over threads at element counts that fall
    inside tensors, batches bounded by the chunk size) gives each tensor the direct computation's values, an
    empty tensor included, and writes the copies over the inputs they read."""
    a, b, c = _pairs()
    sizes = [0, 1, 17, 5000, a.numel(), 3 * a.numel()]
    tensors = [tuple(t.repeat(3)[:n].clone() for t in (a, b, c)) for n in sizes]
    p = Pass(WEIGHT_STATS)
    x = Chunk(a.numel(), Settings())
    for name, t in (("new", a), ("old", b), ("ref", c), ("k_snapshot", b.to(torch.bfloat16))):
        x.set(name, t)
    x.copies = [("new", b.clone()), ("new", b.to(torch.bfloat16))]
    assert fused.kernel_for(p.statistics, x, wait=True) is not None
    monkeypatch.setattr(fused, "threads", lambda: threads)
    monkeypatch.setattr(fused, "MIN_SPLIT", 1)
    from dynascope.stats import fused_many

    monkeypatch.setattr(fused_many, "threads", lambda: threads)
    monkeypatch.setattr(fused_many, "MIN_SPLIT", 1)
    items, olds, ks = [], [], []
    for new, old, ref in tensors:
        old, k = old.clone(), old.to(torch.bfloat16)
        olds.append((old, old.clone()))
        ks.append((k, k.clone()))
        items.append(fused_many.Item({"new": lambda lo, hi, t=new: t[lo:hi], "old": lambda lo, hi, t=old: t[lo:hi],
                                      "ref": lambda lo, hi, t=ref: t[lo:hi], "k_snapshot": lambda lo, hi, t=k: t[lo:hi]},
                                     new.numel(), copies=[("new", lambda lo, hi, t=old: t[lo:hi]),
                                                          ("new", lambda lo, hi, t=k: t[lo:hi])]))
    got = p.run_many(items, chunk_elems=chunk_elems)
    assert got.shape == (len(sizes), len(p.outputs))
    for (new, _, ref), row, (old, old0), (k, k0) in zip(tensors, got.tolist(), olds, ks, strict=True):
        want = _direct(new, old0, ref, k0) if new.numel() else dict(  # the tensor alone: 0 counts, 0 norms, max 0
            zip(p.outputs, compute(p, {"new": new, "old": old0, "ref": ref, "k_snapshot": k0}).tolist(), strict=True))
        got_row = dict(zip(p.outputs, row, strict=True))
        assert {n: (got_row[n], want[n]) for n in want if not _same(got_row[n], want[n]) and not
                (n.endswith("norm") and abs(got_row[n] - want[n]) <= 1e-12 * abs(want[n]))} == {}
        assert torch.equal(old.view(torch.int32), new.view(torch.int32))
        assert torch.equal(k.view(torch.int16), new.to(torch.bfloat16).view(torch.int16))
