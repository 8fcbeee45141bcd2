"""Low-rank structure of the cumulative update ΔW = W_t − W_0, per 2-D weight.

The maths lives in pure functions (``top_k_svd``, ``principal_angle_deg``, ``off_principal_energy``,
``spectral_drift``, ``effective_rank``, ``spectrum_row``) so tests can check them against full
``torch.linalg.svd`` and so the offline checkpoint diff computes exactly what the live probe does.
``Spectra`` adds the state a sequence of records needs: W_0's cached top-k subspaces, the previous
record's ΔW subspaces (for rotation angles) and a per-record time budget that rotates through tensors.
The live probe (``probes.spectral.SpectralProbe``, which adds its schedule) and ``dynascope diff`` both
record through it.

Randomized SVD draws its test matrix from a private generator seeded from the tensor's name: the user's
RNG stream is left untouched (from any thread) and the live probe and the offline diff get bit-identical
results on the same device.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dynascope.core.naming import tensor_kind, tensor_layer
from dynascope.core.warn import warn

__all__ = [
    "Basis", "Spectra", "canonical_sign", "effective_rank", "name_seed", "off_principal_energy",
    "principal_angle_deg", "spectral_drift", "spectrum_row", "top_k_svd",
]

# Directions whose σ is below this fraction of σ₁ are numerically absent; a subspace angle that
# involved them would measure rounding noise (a rank-1 ΔW has no meaningful 2nd singular vector).
_RANK_TOL = 1e-3


@dataclass
class Basis:
    """Top-k singular triplets of a matrix: ``U`` [m, k], ``S`` [k] (descending), ``V`` [n, k]."""

    U: Tensor
    S: Tensor
    V: Tensor

    def numerical_rank(self) -> int:
        if self.S.numel() == 0 or float(self.S[0]) <= 0.0:
            return 0
        return int((self.S > self.S[0] * _RANK_TOL).sum())


def name_seed(name: str) -> int:
    """A stable per-tensor seed (same in every process and in the offline diff)."""
    return zlib.crc32(name.encode("utf-8"))


def top_k_svd(a: Tensor, k: int, *, niter: int = 4, oversample: int = 8, seed: int = 0) -> Basis:
    """Top-``k`` singular triplets of ``a`` by randomized SVD (``torch.svd_lowrank``), reproducibly.

    Small matrices (min dimension ≤ k + oversample) use the exact ``torch.linalg.svd``: the randomized
    method would sketch the whole space anyway.
    """
    k = max(1, min(int(k), min(a.shape)))
    q = min(k + oversample, min(a.shape))
    if q >= min(a.shape):
        U, S, Vh = torch.linalg.svd(a, full_matrices=False)
        return Basis(U[:, :k], S[:k], Vh[:k].mT)
    U, S, V = _svd_lowrank(a, q, niter, torch.Generator(device=a.device).manual_seed(seed))
    return Basis(U[:, :k], S[:k], V[:, :k])


def _svd_lowrank(a: Tensor, q: int, niter: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.svd_lowrank(a, q, niter)`` (Halko et al.'s algorithm 4.4, as torch/_lowrank.py writes it) with
    its test matrix drawn from ``generator``: the same values as seeding the default generator, without
    touching it, so the spectra can run beside training on another thread (whose draws the default
    generator serves) and leave the user's random stream alone."""
    m, n = a.shape[-2:]
    if m < n:
        a = a.mH
    r = torch.randn(a.shape[-1], q, dtype=a.dtype, device=a.device, generator=generator)
    Q = torch.linalg.qr(torch.matmul(a, r)).Q
    for _ in range(niter):
        Q = torch.linalg.qr(torch.matmul(a.mH, Q)).Q
        Q = torch.linalg.qr(torch.matmul(a, Q)).Q
    U, S, Vh = torch.linalg.svd(torch.matmul(Q.mH, a), full_matrices=False)
    U, V = Q.matmul(U), Vh.mH
    return (V, S, U) if m < n else (U, S, V)


def canonical_sign(u: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Flip (u, v) together so u's largest-magnitude entry is positive (uvᵀ is unchanged)."""
    s = torch.where(u[torch.argmax(u.abs())] < 0, -1.0, 1.0).to(u.dtype)
    return u * s, v * s


def principal_angle_deg(a: Tensor, b: Tensor) -> float:
    """Largest principal angle, in degrees, between the column spaces of orthonormal ``a`` and ``b``.

    Small angles come from the sine (‖b − a aᵀb‖₂), large ones from the cosine (σ_min(aᵀb)): each is
    accurate where the other loses digits.
    """
    k = min(a.shape[1], b.shape[1])
    if k == 0:
        return float("nan")
    a, b = a[:, :k], b[:, :k]
    m = a.mT @ b
    cos = float(torch.linalg.svdvals(m).min().clamp(0.0, 1.0))
    sin = float(torch.linalg.matrix_norm(b - a @ m, ord=2).clamp(0.0, 1.0))
    angle = math.asin(sin) if sin < 0.7 else math.acos(cos)
    return math.degrees(angle)


def off_principal_energy(dw: Tensor, u0: Tensor, v0: Tensor, dw_fro_sq: Tensor | float | None = None) -> Tensor:
    """1 − ‖U₀ᵀ ΔW V₀‖²_F / ‖ΔW‖²_F: the share of ΔW outside W_0's principal (top-k) subspaces."""
    total = dw.pow(2).sum() if dw_fro_sq is None else torch.as_tensor(dw_fro_sq, dtype=dw.dtype)
    inside = (u0.mT @ dw @ v0).pow(2).sum()
    return 1.0 - inside / total


def spectral_drift(s_t: Tensor, s_0: Tensor) -> Tensor:
    """‖s(W_t) − s(W_0)‖ / ‖s(W_0)‖ over the top-k singular values of the weights themselves."""
    k = min(s_t.numel(), s_0.numel())
    return torch.linalg.vector_norm(s_t[:k] - s_0[:k]) / torch.linalg.vector_norm(s_0[:k])


def effective_rank(s: Tensor) -> Tensor:
    """exp(entropy of σ/Σσ) (Roy & Vetterli), over the singular values given (the top-k here)."""
    p = s / s.sum()
    p = p[p > 0]
    return torch.exp(-(p * p.log()).sum())


def spectrum_row(
    dw: Tensor, w: Tensor | None, w0_basis: Basis | None, prev: Basis | None, k: int,
    *, seed: int = 0, niter: int = 4, oversample: int = 8,
) -> tuple[dict[str, Any], Basis | None]:
    """Spectral summary of one cumulative update ``dw`` (the ``spectra`` columns this function owns).

    ``w`` is W_t (for the spectral drift), ``w0_basis`` W_0's top-k triplets, ``prev`` the previous
    record's ΔW triplets (for the rotation angles). Returns the row and this record's ΔW triplets
    (None when ΔW is zero: there is no subspace to compare with next time).
    """
    fro_sq = dw.pow(2).sum()
    row: dict[str, Any] = {"rows": dw.shape[0], "cols": dw.shape[1], "k": min(k, min(dw.shape))}
    if not bool(fro_sq > 0) or not bool(torch.isfinite(fro_sq)):
        row.update(drift_norm=float(fro_sq.sqrt()), sigma=[], rank1_energy=None, topk_energy=None,
                   stable_rank=None, effective_rank=None, u1=None, v1=None, angle_left_deg=None,
                   angle_right_deg=None, off_principal_energy=None, spectral_drift=None)
        return row, None
    b = top_k_svd(dw, k, niter=niter, oversample=oversample, seed=seed)
    s1_sq = b.S[0].pow(2)
    scalars = [fro_sq.sqrt(), s1_sq / fro_sq, b.S.pow(2).sum() / fro_sq, fro_sq / s1_sq, effective_rank(b.S)]
    nan = torch.tensor(float("nan"), dtype=dw.dtype, device=dw.device)
    scalars.append(off_principal_energy(dw, w0_basis.U, w0_basis.V, fro_sq) if w0_basis is not None else nan)
    if w is not None and w0_basis is not None:
        s_t = top_k_svd(w, k, niter=niter, oversample=oversample, seed=seed + 1).S
        scalars.append(spectral_drift(s_t, w0_basis.S))
    else:
        scalars.append(nan)
    u1, v1 = canonical_sign(b.U[:, 0], b.V[:, 0])
    # One device→host copy per tensor for the scalars, one per vector.
    vals = torch.stack([x.to(dw.dtype) for x in scalars]).double().cpu().tolist()
    vals = [None if not math.isfinite(x) else x for x in vals]
    row.update(drift_norm=vals[0], sigma=b.S.double().cpu().tolist(), rank1_energy=vals[1], topk_energy=vals[2],
               stable_rank=vals[3], effective_rank=vals[4], off_principal_energy=vals[5], spectral_drift=vals[6],
               u1=u1.float().cpu().numpy(), v1=v1.float().cpu().numpy())
    row["angle_left_deg"] = row["angle_right_deg"] = None
    r = min(b.numerical_rank(), prev.numerical_rank()) if prev is not None else 0
    if r > 0 and prev is not None:
        row["angle_left_deg"] = principal_angle_deg(prev.U[:, :r], b.U[:, :r])
        row["angle_right_deg"] = principal_angle_deg(prev.V[:, :r], b.V[:, :r])
    return row, b


class Spectra:
    """The low-rank summary of W_t − W_0 for 2-D weights, record after record, within a time budget.

    Args:
        k: top-k singular values/vectors kept per tensor.
        time_budget: share of the wall time since the previous record that one record may spend (the
            same meaning as ``watch(time_budget=)``); tensors not reached are first in line next time,
            and at least one tensor is computed per record, so every tensor is eventually covered.
            None: every eligible tensor at every record.
        niter, oversample: randomized-SVD power iterations and oversampling.
        dtype: compute dtype (ΔW is formed in it, so bf16 weights do not lose the update).
    """

    def __init__(self, k: int = 8, time_budget: float | None = 0.05, *, niter: int = 4, oversample: int = 8,
                 dtype: torch.dtype = torch.float32) -> None:
        self.k = int(k)
        self.time_budget = None if time_budget is None else float(time_budget)
        self.niter, self.oversample, self.dtype = int(niter), int(oversample), dtype
        self._w0: dict[str, tuple[list[float], Basis]] = {}  # θ₀ fingerprint and top-k triplets
        self._prev: dict[str, Basis | None] = {}
        self._cursor = 0  # where the next record starts in the list of eligible tensors
        self._last = time.perf_counter()  # end of the previous record: the budget is a share of the time since
        self._warned = False

    @staticmethod
    def eligible(name: str, w: Tensor, reference: dict[str, Tensor]) -> bool:
        """2-D, at least 2×2, with θ₀ held under the same name and shape."""
        ref = reference.get(name)
        return (w.ndim == 2 and min(w.shape) >= 2 and w.is_floating_point() and ref is not None
                and tuple(ref.shape) == tuple(w.shape))

    def forget(self, name: str) -> None:
        """Drop the cached state of one tensor (the offline diff does this when it is done with it)."""
        self._w0.pop(name, None)
        self._prev.pop(name, None)

    def reset(self) -> None:
        """Drop every cache (W_0 subspaces, previous records); the next record starts afresh."""
        self._w0.clear()
        self._prev.clear()

    def record(self, step: int, stage: str | None, named_weights: list[tuple[str, Tensor]],
               reference: dict[str, Tensor]) -> list[dict]:
        """One ``spectra`` row per tensor covered in this record, within ``time_budget``; never raises."""
        rows: list[dict] = []
        t0 = time.perf_counter()
        allowed_s = None if self.time_budget is None else self.time_budget * (t0 - self._last)
        try:
            todo = [(n, w) for n, w in named_weights if self.eligible(n, w, reference)]
            if not todo:
                return rows
            start = self._cursor % len(todo)
            for i in range(len(todo)):
                if rows and allowed_s is not None and time.perf_counter() - t0 >= allowed_s:
                    break
                name, w = todo[(start + i) % len(todo)]
                self._cursor = start + i + 1
                row = self._one(step, stage, name, w, reference[name])
                if row is not None:
                    rows.append(row)
        except Exception as exc:  # the probe must not break training: report what was computed
            self._warn(f"spectral probe failed at step {step}: {type(exc).__name__}: {exc}")
        self._last = time.perf_counter()
        return rows

    def _one(self, step: int, stage: str | None, name: str, w: Tensor, ref: Tensor) -> dict | None:
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                wt = w.detach().to(self.dtype)
                w0 = ref.detach().to(device=wt.device, dtype=self.dtype)
                seed = name_seed(name)
                # θ₀ can be replaced mid-run (scope.set_reference at a stage switch): a fingerprint of
                # the whole tensor (one cheap pass, next to the SVD's several) drops stale caches.
                fp = torch.stack([torch.sum(w0, dtype=torch.float64),
                                  torch.linalg.vector_norm(w0, dtype=torch.float64)]).tolist()
                cached = self._w0.get(name)
                if cached is None or cached[0] != fp:
                    self._prev.pop(name, None)
                    cached = self._w0[name] = (fp, top_k_svd(w0, self.k, niter=self.niter,
                                                             oversample=self.oversample, seed=seed + 1))
                row, basis = spectrum_row(wt - w0, wt, cached[1], self._prev.get(name), self.k,
                                          seed=seed, niter=self.niter, oversample=self.oversample)
        except Exception as exc:
            self._warn(f"spectral summary of {name} failed: {type(exc).__name__}: {exc}")
            return None
        self._prev[name] = basis
        row.update(step=int(step), time_us=time.time_ns() // 1000, stage=stage, tensor=name,
                   layer=tensor_layer(name), kind=tensor_kind(name),
                   compute_ms=(time.perf_counter() - t0) * 1e3)
        return row

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warn(f"dynascope: {message}", RuntimeWarning, stacklevel=3)
