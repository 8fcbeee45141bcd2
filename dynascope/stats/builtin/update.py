"""The step update ΔW = W_t − W_{t−1}: ‖ΔW‖, its ratio to ‖W‖, and the changed counts.

Changed, two of the three ways (the third, the bf16 casts, is PULSE's S₁ in ``bf16_visibility``):
* bit-exact: the element's bits differ in the parameter's own dtype (an update smaller than half an ulp is
  rounded away and does not count: the quantity low-precision training actually sees);
* relative (``changed_rel``, "The Path Not Taken", 2025): |ΔW| > η·max(|W_t|, |W_{t−1}|), η = 1e-3, a
  change of at least 0.1% of the weight, whatever the master dtype.
``drift`` applies the same kernel to W_t against θ₀.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynascope.stats.base import F64, Chunk, Column, Figure, Statistic, count, frac

if TYPE_CHECKING:
    from torch import Tensor


def update(x: Chunk) -> list[Tensor]:
    from dynascope.stats.kernels import norms_and_changes

    return norms_and_changes(x.new, x.old, x.settings.eta)


UPDATE = Statistic(
    "update",
    columns=(
        Column("update_norm", F64, reduce="norm", pool=(("update_sq", "sq", None),), doc="‖W_t − W_{t−1}‖"),
        Column("update_ratio", F64, ratio=("update_norm", "w_norm"), pool=(("update_ratio_max", "max", None),),
               summary=True),
        count("changed_count", "bits differ in the parameter's dtype", "changed_numel"),
        frac("changed_count", summary=True),
        count("changed_rel_count", "|ΔW| > η·max(|W_t|, |W_{t−1}|), η = 1e-3", "changed_rel_numel"),
        frac("changed_rel_count"),
    ),
    # ‖W_t‖ comes out of the same pass: the window's tensors need no separate norm.
    outputs=("w_norm", "update_norm", "changed_count", "changed_rel_count"), inputs=("new", "old"), kernel=update,
    # ΔW, the scale, |new| and the widened copies of 16-bit inputs; two boolean masks.
    transient=(5, 2),
    figures=(Figure("update_ratio", "update ratio ‖ΔW‖/‖W‖", "update_sq", "update_w_sq", root=True, heat=True),
             Figure("changed_frac", "step-changed fraction", "changed_count", "changed_numel", heat=True),
             Figure("changed_rel_frac", "changed by > 0.1% of |W| (relative)", "changed_rel_count", "changed_rel_numel")))

STATISTICS = (UPDATE,)
