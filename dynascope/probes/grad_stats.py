"""Gradient statistics at the optimizer step: norm, max-abs, exact/near-zero, NaN and Inf counts.

Two tiers so ``every=1`` stays cheap: ``grad_norms`` (one read of each gradient, ``update_stats.norms``)
runs on every tracked tensor; ``grad_counts`` (max-abs, zero / near-zero / NaN / Inf counts, several passes — a
max-reduction alone costs several norm passes on CPU) runs on the budgeted window of tensors. A finite
norm proves there is no NaN or Inf element, so the scope fills those counts as exactly 0 for every
tensor whose norm is finite without touching the data again.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dynascope.probes.update_stats import DEFAULT_CHUNK_ELEMS, chunk_ranges, norms, wide

__all__ = ["GRAD_COUNT_COLUMNS", "GRAD_NORM_COLUMNS", "DEFAULT_GRAD_TOL", "grad_counts",
           "grad_norms"]

GRAD_NORM_COLUMNS = ("grad_norm",)
# Column names of the results (store.schema's registry declares how each combines across ranks).
GRAD_COUNT_COLUMNS = ("grad_max_abs", "grad_zero_count", "grad_near_zero_count", "grad_nan_count", "grad_inf_count")
DEFAULT_GRAD_TOL = 1e-8  # near zero: |g| <= tol · rms(g) of the same tensor


def grad_norms(grads: list[Tensor]) -> Tensor:
    """float64 [n, 1]: L2 norm per gradient (fp32 accumulation for 16-bit grads)."""
    if not grads:
        return torch.zeros((0, 1), dtype=torch.float64)
    with torch.no_grad():
        return norms(grads).to(grads[0].device).unsqueeze(1)


def grad_counts(grads: list[Tensor], grad_norm: Tensor | None = None, tol: float | None = None, *,
                chunk_elems: int | None = DEFAULT_CHUNK_ELEMS) -> Tensor:
    """float64 [n, 5]: max |g|, then exact-zero, near-zero (|g| ≤ tol·rms), NaN and Inf element counts.

    ``grad_norm`` (float64 [n], from ``grad_norms``) saves recomputing the norms for the rms threshold.
    Each gradient is read ``chunk_elems`` elements at a time, so |g| and the masks stay chunk-sized.
    """
    if not grads:
        return torch.zeros((0, 5), dtype=torch.float64)
    tol = DEFAULT_GRAD_TOL if tol is None else float(tol)
    with torch.no_grad():
        if grad_norm is None:
            grad_norm = norms(grads)
        grad_norm = grad_norm.to(grads[0].device)
        rows = []
        for i, g in enumerate(grads):
            flat = g.reshape(-1)
            # rms = ‖g‖/√n, computed on device; threshold stays a 0-d tensor (no host sync).
            wide_dtype = g.dtype if g.dtype in (torch.float32, torch.float64) else torch.float32
            thr = grad_norm[i].to(wide_dtype) * (tol / math.sqrt(max(g.numel(), 1)))
            # Per-chunk results go into rows allocated before the loop (see ``update_stats.chunk_rows`` for why), one
            # same-dtype stack each: a mixed-dtype stack copies its inputs one by one (~3x the time).
            n_chunks = len(ranges := list(chunk_ranges(flat.numel(), chunk_elems)))
            extremes = torch.zeros((n_chunks, 2), dtype=g.dtype, device=g.device)  # an empty chunk has none
            counts = torch.empty((n_chunks, 4), dtype=torch.int64, device=g.device)
            for j, (lo, hi) in enumerate(ranges):
                c = flat[lo:hi]
                if c.numel():  # one read pass (no |c| temporary); min/max propagate NaN
                    torch.stack(torch.aminmax(c), out=extremes[j])
                a = wide(c).abs()
                # Counts use count_nonzero: bool.sum() takes a slow int64 path on CPU (~100× slower).
                torch.stack([c.numel() - torch.count_nonzero(c), torch.count_nonzero(a <= thr),
                             torch.count_nonzero(torch.isnan(c)), torch.count_nonzero(torch.isinf(a))], out=counts[j])
                del a
            rows.append(torch.cat([extremes.abs().amax().to(torch.float64).reshape(1),
                                   counts.sum(0).to(torch.float64)]))
        return torch.stack(rows)
