"""Gradient statistics at the optimizer step: ‖g‖, max |g|, exact and near-zero, NaN and Inf counts.

Two tiers so recording every step stays cheap: ‖g‖ (one batched read of every gradient) runs on every
tensor at every record; the counts (several passes: a max-reduction alone costs several norm passes on
a CPU) on the window's tensors. A finite ‖g‖ proves there is no NaN or Inf element, so those counts are
0 for every tensor whose norm is finite, without touching the data again. Near zero is |g| ≤ tol·rms(g)
of the same tensor (of the local shard, under sharding), with tol = ``Settings.grad_tol`` (1e-8).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from dynascope.stats.base import (
    DEFAULT_CHUNK_ELEMS,
    F64,
    Chunk,
    Column,
    Figure,
    Settings,
    Statistic,
    count,
    frac,
)

if TYPE_CHECKING:
    from torch import Tensor

DEFAULT_GRAD_TOL = 1e-8


def grad_norm(x: Chunk) -> list[Tensor]:
    import torch

    from dynascope.stats.kernels import wide

    return [torch.linalg.vector_norm(wide(x.grad))]


def grad_norms(tensors: list[Tensor]) -> Tensor:
    from dynascope.stats.kernels import batched_norms

    return batched_norms(tensors)


def grad_count_chunk(x: Chunk) -> list[Tensor]:
    """max |g|, then the exact-zero, near-zero, NaN and Inf counts of one chunk of a gradient."""
    import torch

    from dynascope.stats.kernels import wide

    c = x.grad
    # rms = ‖g‖/√n of the whole tensor, from the ‖g‖ of the batched pass; the threshold stays on the device.
    wide_dtype = c.dtype if c.dtype in (torch.float32, torch.float64) else torch.float32
    thr = x.given["grad_norm"].to(wide_dtype) * (x.settings.grad_tol / math.sqrt(max(x.numel, 1)))
    # One read pass for the extremes (no |c| temporary); min/max propagate NaN. An empty chunk has none.
    peak = torch.stack(torch.aminmax(c)).abs().amax() if c.numel() else c.new_zeros(())
    a = wide(c).abs()
    # Counts use count_nonzero: bool.sum() takes a slow int64 path on CPU (~100× slower).
    return [peak, c.numel() - torch.count_nonzero(c), torch.count_nonzero(a <= thr),
            torch.count_nonzero(torch.isnan(c)), torch.count_nonzero(torch.isinf(a))]


GRAD_NORM = Statistic(
    "grad_norm", columns=(Column("grad_norm", F64, reduce="norm", pool=(("grad_sq", "sq", None),)),),
    outputs=("grad_norm",), inputs=("grad",), kernel=grad_norm, batched=grad_norms, tier="every", transient=(1, 0))

GRAD_COUNTS = Statistic(
    "grad_counts",
    columns=(count("grad_zero_count", "g == 0", "grad_numel"), frac("grad_zero_count", summary=True),
             count("grad_near_zero_count", "|g| ≤ tol·rms(g) of this shard"), frac("grad_near_zero_count"),
             Column("grad_max_abs", F64, reduce="max", pool=(("grad_max_abs", "max", None),)),
             count("grad_nan_count", "NaN elements of g", zero_where_finite="grad_norm"),
             count("grad_inf_count", "±Inf elements of g", zero_where_finite="grad_norm")),
    outputs=("grad_max_abs", "grad_zero_count", "grad_near_zero_count", "grad_nan_count", "grad_inf_count"),
    inputs=("grad",), given=("grad_norm",), kernel=grad_count_chunk, transient=(2, 2),  # |g| (widened), two masks
    figures=(Figure("grad_zero_frac", "exact-zero gradients", "grad_zero_count", "grad_numel"),
             Figure("grad_near_zero_frac", "near-zero gradients", "grad_near_zero_count", "grad_numel")))

STATISTICS = (GRAD_NORM, GRAD_COUNTS)


def grad_counts(grads: list[Tensor], grad_norm: Tensor | None = None, tol: float | None = None, *,
                chunk_elems: int | None = DEFAULT_CHUNK_ELEMS) -> Tensor:
    """float64 [n, 5] of whole gradients, as ``GRAD_COUNTS`` outputs them: max |g|, then the exact-zero,
    near-zero (|g| ≤ tol·rms), NaN and Inf counts; ``grad_norm`` (float64 [n]) saves recomputing ‖g‖."""
    from dynascope.stats.engine import per_tensor

    if grad_norm is None and grads:
        grad_norm = grad_norms(grads)[:, 0]
    settings = Settings(grad_tol=DEFAULT_GRAD_TOL if tol is None else float(tol))
    given = {"grad_norm": grad_norm.to(grads[0].device)} if grads and grad_norm is not None else None
    return per_tensor((GRAD_COUNTS,), {"grad": grads}, settings, given=given, chunk_elems=chunk_elems)
