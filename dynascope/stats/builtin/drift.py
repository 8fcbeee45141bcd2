"""Drift from the reference weights θ₀: ‖W_t − W₀‖, its ratio to ‖W₀‖, and the changed counts against θ₀.

The update's terms (``update.changes``) with θ₀ as the first tensor: its first output
is then ‖θ₀‖ (``ref_norm``, kept only for ``drift_ratio``), and every other output is symmetric. A tensor
whose θ₀ is not held has no drift (``ref_covered`` false, the drift columns NULL).
"""

from __future__ import annotations

from typing import Any

from dynascope.stats.base import BOOL, F64, Column, Figure, Statistic, count, frac
from dynascope.stats.builtin.update import changes, eta


def drift(ops: Any, ref: Any, new: Any, ref_bits: Any, new_bits: Any, eta: Any) -> tuple[Any, ...]:
    return changes(ref, new, ref_bits, new_bits, eta)


DRIFT = Statistic(
    "drift",
    columns=(
        Column("ref_covered", BOOL, reduce="all", flag_of="drift_norm", doc="θ₀ of this tensor was read at this record"),
        Column("drift_norm", F64, reduce="norm", pool=(("drift_sq", "sq", None), ("drift_numel", "numel", None)),
               doc="‖W_t − W₀‖"),
        Column("drift_ratio", F64, ratio=("drift_norm", "ref_norm"), doc="‖W_t − W₀‖ / ‖W₀‖"),
        count("drift_changed_count", "bits of W_t and W₀ differ"), frac("drift_changed_count", summary=True),
        count("drift_changed_rel_count", "|W_t − W₀| > η·max(|W_t|, |W₀|)"), frac("drift_changed_rel_count"),
        Column("ref_norm", F64, reduce="norm", stored=False, doc="‖W₀‖, drift_ratio's denominator"),
    ),
    outputs=("ref_norm", "drift_norm", "drift_changed_count", "drift_changed_rel_count"), inputs=("ref", "new"),
    element=drift, scalars=eta, bitwise=("drift_changed_count",),
    transient=(9, 4),  # as the update's, and θ₀'s chunk read from disk
    figures=(Figure("drift_w_ratio", "drift vs θ₀ ‖W−θ₀‖/‖W‖", "drift_sq", "drift_w_sq", root=True, heat=True),))

STATISTICS = (DRIFT,)
