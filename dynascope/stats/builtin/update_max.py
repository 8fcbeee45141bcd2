"""max |ΔW|: the largest change of a single element in one optimizer step (``update_max_abs``).

‖ΔW‖ says how much a tensor moved in all; the largest element's move says whether any weight moved
enough to matter on its own. In the regime of RL post-training (bf16 storage, lr ~1e-6) it is the quantity
to hold against a bf16 ulp: with Adam, |ΔW| per element is at most about lr (times the bias correction at
the first steps), so max |ΔW| well above lr points at a spike, and max |ΔW| below half a bf16 ulp of the
weights means no element of the tensor could have changed in a bf16 copy (then ``bf16_unchanged_frac``
is 1). It combines across chunks and shards as a maximum, and pools in the rollups as the maximum over
the tensors of a row.
"""

from __future__ import annotations

from typing import Any

from dynascope.stats.base import F64, Column, Statistic


def update_max_abs(ops: Any, new: Any, old: Any) -> tuple[Any]:
    """|new − old| of an element, in fp32 or wider; the maximum over a tensor (0 if empty, NaN if any is)."""
    return (abs(new - old),)


UPDATE_MAX_ABS = Statistic(
    "update_max_abs",
    columns=(Column("update_max_abs", F64, reduce="max", pool=(("update_max_abs", "max", None),),
                    doc="max |W_t − W_{t−1}| over the tensor's elements"),),
    outputs=("update_max_abs",), inputs=("new", "old"), element=update_max_abs,
    transient=(4, 0))  # the widened copies of 16-bit inputs, the difference and its absolute value

STATISTICS = (UPDATE_MAX_ABS,)
