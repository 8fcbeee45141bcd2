"""A hand-made ``Record`` of the tensor_stats probe, with the per-tensor values a naive unpacking gives."""

from __future__ import annotations

import math

import torch

from dynascope.probes.params import Tracked
from dynascope.probes.rows import Record


def tracked() -> list[Tracked]:
    shapes = [(4, 3), (5,), (0,), (2, 2), (7,)]
    kinds = ["attn", "norm", "other", "attn", "mlp"]
    return [Tracked(f"layers.{i}.w", torch.zeros(s), layer=i if i != 2 else None, kind=k, shape=str(list(s)),
                    dtype="float32") for i, (s, k) in enumerate(zip(shapes, kinds, strict=True))]


def record(tracked: list[Tracked]) -> tuple[Record, dict[int, dict[str, float]]]:
    """A record with parts covering different tensors, NaN/Inf values, a zero denominator and a constant;
    returns it with the per-tensor values a naive unpacking gives."""
    rec = Record(12, "rl", tracked)
    parts = {
        "w_norm": (("w_norm",), [0, 1, 2, 3, 4], [[2.0], [math.nan], [0.0], [math.inf], [3.0]]),
        "update": (("update_norm", "changed_count", "sign_flip_count"), [0, 2, 3],
                   [[0.5, 6.0, 1.0], [0.0, math.nan, 0.0], [1.0, 2.0, math.inf]]),
        "drift": (("ref_norm", "drift_norm", "drift_unchanged_count"), [4], [[0.0, 0.25, 3.0]]),
        "grad_norms": (("grad_norm",), [0, 1, 4], [[1.0], [math.inf], [2.0]]),
        # under an infinite ‖g‖ the near-zero threshold is ∞: every element counted, a count that means nothing
        "grad_counts": (("grad_near_zero_count", "grad_inf_count"), [0, 1], [[1.0, 0.0], [5.0, 2.0]]),
        "bf16_k": (("bf16_unchanged_k_count",), [1, 3], [[4.0], [1.0]]),
    }
    naive: dict[int, dict[str, float]] = {i: {} for i in range(len(tracked))}
    for key, (cols, rows, vals) in parts.items():
        rec.add(key, cols, rows, torch.tensor(vals, dtype=torch.float64))
        for r, i in enumerate(rows):
            naive[i].update(zip(cols, vals[r], strict=True))
    rec.constants["bf16_k"] = {"bf16_k_steps": 3}
    for i in (1, 3):
        naive[i]["bf16_k_steps"] = 3
    rec.host = torch.cat([v.reshape(-1) for v in rec.values.values()])
    return rec, naive
