"""Gradient statistics at the optimizer step: ‖g‖, max |g|, exact and near-zero, NaN and Inf counts.

Two tiers so recording every step stays cheap: ‖g‖ (one batched read of every gradient) runs on every
tensor at every record; the counts (several passes: a max-reduction alone costs several norm passes on
a CPU) on the window's tensors. A finite ‖g‖ proves there is no NaN or Inf element, so those counts are
0 for every tensor whose norm is finite, without touching the data again. Near zero is |g| ≤ tol·rms(g)
of the same tensor (of the local shard, under sharding), with tol = ``Settings.grad_tol`` (1e-8); where
‖g‖ is not finite that threshold means nothing (every element under ∞, none under NaN), so the near-zero
count is NULL there while the NaN and Inf counts stay exact.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

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


def grad_norm(ops: Any, grad: Any) -> tuple[Any]:
    return (grad * grad,)


def grad_norms(tensors: list[Tensor]) -> Tensor:
    from dynascope.stats.kernels import batched_norms

    return batched_norms(tensors, GRAD_NORM)


def grad_counts_element(ops: Any, grad: Any, near_zero: Any) -> tuple[Any, ...]:
    """|g|, then whether it is exactly zero, near zero, NaN, ±Inf."""
    a = abs(grad)
    return a, grad == 0, a <= near_zero, grad != grad, a == math.inf


def near_zero(x: Chunk) -> dict[str, Any]:
    """tol·rms(g), rms = ‖g‖/√n of the whole tensor from the batched pass's ‖g‖, in the gradient's width."""
    import torch

    wide_dtype = x.grad.dtype if x.grad.dtype in (torch.float32, torch.float64) else torch.float32
    return {"near_zero": x.given["grad_norm"].to(wide_dtype) * (x.settings.grad_tol / math.sqrt(max(x.numel, 1)))}


GRAD_NORM = Statistic(
    "grad_norm", columns=(Column("grad_norm", F64, reduce="norm", pool=(("grad_sq", "sq", None),)),),
    outputs=("grad_norm",), inputs=("grad",), element=grad_norm, batched=grad_norms, tier="every", transient=(2, 0))

GRAD_COUNTS = Statistic(
    "grad_counts",
    columns=(count("grad_zero_count", "g == 0", "grad_numel"), frac("grad_zero_count", summary=True),
             count("grad_near_zero_count", "|g| ≤ tol·rms(g) of this shard",
                   null_where_not_finite="grad_norm"), frac("grad_near_zero_count"),
             Column("grad_max_abs", F64, reduce="max", pool=(("grad_max_abs", "max", None),)),
             count("grad_nan_count", "NaN elements of g", zero_where_finite="grad_norm"),
             count("grad_inf_count", "±Inf elements of g", zero_where_finite="grad_norm")),
    outputs=("grad_max_abs", "grad_zero_count", "grad_near_zero_count", "grad_nan_count", "grad_inf_count"),
    inputs=("grad",), given=("grad_norm",), element=grad_counts_element, scalars=near_zero,
    transient=(2, 6),  # the widened gradient and |g|; the masks
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
