"""The step update ΔW = W_t − W_{t−1}: ‖ΔW‖, its ratio to ‖W‖, and the changed counts.

Changed, two of the three ways (the third, the bf16 casts, is PULSE's S₁ in ``bf16_visibility``):
* bit-exact: the element's bits differ in the parameter's own dtype (an update smaller than half an ulp is
  rounded away and does not count: the quantity low-precision training actually sees);
* relative (``changed_rel``, "The Path Not Taken", 2025): |ΔW| > η·max(|W_t|, |W_{t−1}|), η = 1e-3, a
  change of at least 0.1% of the weight, whatever the master dtype.
``drift`` applies the same kernel to W_t against θ₀.
"""

from __future__ import annotations

from typing import Any

from dynascope.stats.base import F64, Chunk, Column, Figure, Statistic, count, frac


def changes(a: Any, b: Any, a_bits: Any, b_bits: Any, eta: Any) -> tuple[Any, ...]:
    """‖a‖², ‖a − b‖², bits differ, |a − b| > η·max(|a|, |b|), for one element (or elementwise).

    The relative test is split in two (|d| > η|a| and |d| > η|b|): rounding is monotonic, so
    fl(η·max(|a|, |b|)) = max(fl(η|a|), fl(η|b|)), and the split needs no maximum (NaN compares false).
    """
    d = a - b
    ad = abs(d)
    return a * a, d * d, a_bits != b_bits, (ad > abs(a) * eta) & (ad > abs(b) * eta)


def update(ops: Any, new: Any, old: Any, new_bits: Any, old_bits: Any, eta: Any) -> tuple[Any, ...]:
    return changes(new, old, new_bits, old_bits, eta)


def eta(x: Chunk) -> dict[str, Any]:
    """η of the relative change, as the weights' arithmetic sees it (fp32 for fp32 weights)."""
    return {"eta": x.settings.eta}


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
    outputs=("w_norm", "update_norm", "changed_count", "changed_rel_count"), inputs=("new", "old"), element=update,
    scalars=eta, bitwise=("changed_count",),
    # On chunk tensors: the widened inputs, ΔW, |ΔW|, the squares, the two scales; four boolean masks.
    transient=(8, 4),
    figures=(Figure("update_ratio", "update ratio ‖ΔW‖/‖W‖", "update_sq", "update_w_sq", root=True, heat=True),
             Figure("changed_frac", "step-changed fraction", "changed_count", "changed_numel", heat=True),
             Figure("changed_rel_frac", "changed by > 0.1% of |W| (relative)", "changed_rel_count", "changed_rel_numel")))

STATISTICS = (UPDATE,)
