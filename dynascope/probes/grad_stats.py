"""Gradient statistics at the optimizer step: norm, max-abs, exact/near-zero, NaN and Inf counts.

Two tiers so ``every=1`` stays cheap: ``grad_norms`` (norm and max-abs, one batched pass each) runs on
every tracked tensor; ``grad_counts`` (zero / near-zero / NaN / Inf counts, several passes) runs on the
budgeted window of tensors. When a tensor's max-abs is finite its NaN and Inf counts are exactly 0, so
the scope fills them for every tensor without touching the data again.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dynascope.probes.update_stats import norms, wide

__all__ = ["GRAD_COUNT_COLUMNS", "GRAD_NORM_COLUMNS", "GRAD_REDUCTIONS", "DEFAULT_GRAD_TOL", "grad_counts",
           "grad_norms"]

GRAD_NORM_COLUMNS = ("grad_norm", "grad_max_abs")
GRAD_COUNT_COLUMNS = ("grad_zero_count", "grad_near_zero_count", "grad_nan", "grad_inf")
GRAD_REDUCTIONS = {"grad_norm": "norm", "grad_max_abs": "max", "grad_zero_count": "sum",
                   "grad_near_zero_count": "sum", "grad_nan": "sum", "grad_inf": "sum"}
DEFAULT_GRAD_TOL = 1e-8  # near zero: |g| <= tol · rms(g) of the same tensor


def _max_abs(t: Tensor) -> Tensor:
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=t.device)
    # amax of |t| propagates NaN, so a NaN gradient shows up here too (and in the norm).
    return t.abs().amax().to(torch.float64)


def grad_norms(grads: list[Tensor]) -> Tensor:
    """float64 [n, 2]: L2 norm (fp32 accumulation for 16-bit grads) and max |g| per gradient."""
    if not grads:
        return torch.zeros((0, 2), dtype=torch.float64)
    with torch.no_grad():
        n = norms(grads).to(grads[0].device)
        m = torch.stack([_max_abs(g) for g in grads])
        return torch.stack([n, m], dim=1)


def grad_counts(grads: list[Tensor], grad_norm: Tensor | None = None, tol: float | None = None) -> Tensor:
    """float64 [n, 4]: exact-zero, near-zero (|g| ≤ tol·rms), NaN and Inf element counts per gradient.

    ``grad_norm`` (float64 [n], from ``grad_norms``) saves recomputing the norms for the rms threshold.
    """
    if not grads:
        return torch.zeros((0, 4), dtype=torch.float64)
    tol = DEFAULT_GRAD_TOL if tol is None else float(tol)
    with torch.no_grad():
        if grad_norm is None:
            grad_norm = norms(grads)
        grad_norm = grad_norm.to(grads[0].device)
        zero, near, nan, inf = [], [], [], []
        for i, g in enumerate(grads):
            nz = torch.count_nonzero(g)
            zero.append(g.numel() - nz)
            a = wide(g).abs()
            # rms = ‖g‖/√n, computed on device; threshold stays a 0-d tensor (no host sync).
            thr = grad_norm[i].to(a.dtype) * (tol / math.sqrt(max(g.numel(), 1)))
            near.append((a <= thr).sum())
            nan.append(torch.isnan(g).sum())
            inf.append(torch.isinf(a).sum())
        cols = [torch.stack([x.to(torch.float64) for x in c]) for c in (zero, near, nan, inf)]
        return torch.stack(cols, dim=1)
