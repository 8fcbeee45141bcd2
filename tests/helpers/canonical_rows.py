"""``tensor_stats`` rows as the probe derives them from a piece of a tensor (a shard, a replica's shard, a
whole DDP copy), for tests that store a layout through the real writer and hold the pooled result to the
full tensor's values."""

from __future__ import annotations

import numpy as np
import torch

from dynascope.stats.engine import (
    DRIFT_STAT_COLUMNS,
    UPDATE_STAT_COLUMNS,
    weight_drift_stats,
    weight_update_stats,
)
from dynascope.stats.rows import PartialResults, tensor_stats_columns


def stats_row(name: str, new: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None, **place) -> dict:
    """A tensor_stats row for ``new`` (a piece of the tensor, or all of it); no drift columns without ``ref``
    (a tensor outside the window of a memory budget's record)."""
    values = dict(zip(UPDATE_STAT_COLUMNS, weight_update_stats([new], [old])[0].tolist(), strict=True))
    if ref is not None:
        values.update(zip(DRIFT_STAT_COLUMNS, weight_drift_stats([new], [ref])[0].tolist(), strict=True))
    cols = tensor_stats_columns(PartialResults.of_dicts([values]), np.array([new.numel()]))
    return {"tensor": name, "kind": "mlp", "layer": 0, "shape": "x".join(map(str, new.shape)), "dtype": "float32",
            "numel": new.numel(), **{k: v[0].as_py() for k, v in cols.items()}, **place}


def weights(seed: int, shape: tuple[int, int] = (8, 6)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(new, old, ref): θ₀, the weights before a step, after it; about half the elements change."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(*shape, dtype=torch.float64, generator=g)
    old = ref + 0.1 * torch.randn(*shape, dtype=torch.float64, generator=g)
    new = torch.where(torch.rand(*shape, generator=g) < 0.5, old,
                      old - 0.05 * torch.randn(*shape, dtype=torch.float64, generator=g))
    return new, old, ref
