"""Sign flips of the step, and the NaN and Inf elements of the weights after it (read in the same pass)."""

from __future__ import annotations

import math
from typing import Any

from dynascope.stats.base import Statistic, count, frac


def signs(ops: Any, new: Any, old: Any) -> tuple[Any, ...]:
    # sign(a)·sign(b) < 0 as comparisons: no product, so no underflow of two tiny values; ±0 and NaN never flip.
    flip = ((new > 0) & (old < 0)) | ((new < 0) & (old > 0))
    return flip, new != new, abs(new) == math.inf


SIGNS = Statistic(
    "signs",
    columns=(count("sign_flip_count", "sign(W_t)·sign(W_{t−1}) < 0"), frac("sign_flip_count"),
             # a finite ‖W‖ proves there is no NaN/Inf element: 0 wherever ‖W‖ is known, without a pass
             count("w_nan_count", "NaN elements of W_t", zero_where_finite="w_norm"),
             count("w_inf_count", "±Inf elements of W_t", zero_where_finite="w_norm")),
    outputs=("sign_flip_count", "w_nan_count", "w_inf_count"), inputs=("new", "old"), element=signs,
    transient=(3, 8))  # the widened inputs and |W_t|; eight masks

STATISTICS = (SIGNS,)
