"""‖W‖, the norm of the weights after the step.

Every tensor at every ``w_norm_every``-th record (the "cadence" tier: one batched norm over every weight,
bound by memory bandwidth on a host) and the window's tensors at every record, where ``update_ratio``
needs it; there the update kernel gives it in the same pass as ‖ΔW‖.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dynascope.stats.base import F64, Column, Statistic

if TYPE_CHECKING:
    from torch import Tensor


def w_norm(ops: Any, new: Any) -> tuple[Any]:
    return (new * new,)


def w_norms(tensors: list[Tensor]) -> Tensor:
    from dynascope.stats.kernels import batched_norms

    return batched_norms(tensors, W_NORM)


W_NORM = Statistic(
    "w_norm",
    columns=(Column("w_norm", F64, reduce="norm", doc="‖W_t‖",
                    pool=(("w_sq", "sq", None), ("update_w_sq", "sq", "update_norm"), ("drift_w_sq", "sq", "drift_norm"))),),
    outputs=("w_norm",), inputs=("new",), element=w_norm, batched=w_norms, tier="cadence", transient=(2, 0))

STATISTICS = (W_NORM,)
