"""Sign flips of the step, and the NaN and Inf elements of the weights after it (read in the same pass)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynascope.stats.base import Chunk, Statistic, count, frac

if TYPE_CHECKING:
    from torch import Tensor


def signs(x: Chunk) -> list[Tensor]:
    import torch

    a = x.new
    # sign(a)·sign(b) is exactly ±1, 0 or NaN: no underflow, unlike a·b of two tiny values.
    flip = torch.sign(a).mul_(torch.sign(x.old))
    return [torch.count_nonzero(flip < 0), torch.count_nonzero(torch.isnan(a)), torch.count_nonzero(torch.isinf(a))]


SIGNS = Statistic(
    "signs",
    columns=(count("sign_flip_count", "sign(W_t)·sign(W_{t−1}) < 0"), frac("sign_flip_count"),
             # a finite ‖W‖ proves there is no NaN/Inf element: 0 wherever ‖W‖ is known, without a pass
             count("w_nan_count", "NaN elements of W_t", zero_where_finite="w_norm"),
             count("w_inf_count", "±Inf elements of W_t", zero_where_finite="w_norm")),
    outputs=("sign_flip_count", "w_nan_count", "w_inf_count"), inputs=("new", "old"), kernel=signs,
    transient=(2, 3))  # the two signs (at most the input's width), three masks

STATISTICS = (SIGNS,)
