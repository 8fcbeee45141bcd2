"""The tensor_stats rollups' pooling done the slow way (SQL over the raw rows), the rolled-up side of the
same query, random tensor_stats batches with NULLs where a probe leaves them, and an exact comparison."""

from __future__ import annotations

import math

import numpy as np

from dynascope.store.schema import ROLLUP_BLOCK_STEPS

KINDS = ["attn_q", "attn_k", "mlp_up", None]

# The same pooling, done the slow way on the raw rows.
NAIVE = """
    SELECT run_id, rank, role, step, stage, kind, max(time_us), count(*), sum(numel),
           sum(w_norm * w_norm), sum(update_norm * update_norm), max(update_ratio),
           sum(changed_count), sum(CASE WHEN changed_count IS NOT NULL THEN numel END),
           sum(changed_rel_count), sum(CASE WHEN changed_rel_count IS NOT NULL THEN numel END),
           sum(sign_flip_count), sum(w_nan_count), sum(w_inf_count),
           sum(drift_norm * drift_norm), sum(CASE WHEN drift_norm IS NOT NULL THEN w_norm * w_norm END),
           sum(drift_changed_count), sum(CASE WHEN drift_norm IS NOT NULL THEN numel END),
           sum(grad_norm * grad_norm), max(grad_max_abs), sum(grad_zero_count), sum(grad_near_zero_count),
           sum(CASE WHEN grad_zero_count IS NOT NULL THEN numel END), sum(grad_nan_count), sum(grad_inf_count)
    FROM tensor_stats GROUP BY ALL ORDER BY ALL"""

ROLLED = """
    SELECT run_id, rank, role, step, stage, kind, time_us, tensors, numel, w_sq, update_sq, update_ratio_max,
           changed_count, changed_numel, changed_rel_count, changed_rel_numel, sign_flip_count, w_nan_count, w_inf_count,
           drift_sq, drift_w_sq, drift_changed_count, drift_numel, grad_sq, grad_max_abs, grad_zero_count,
           grad_near_zero_count, grad_numel, grad_nan_count, grad_inf_count
    FROM tensor_stats_by_kind ORDER BY ALL"""


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


def batch(rng, step: int, n: int, with_drift: bool) -> dict:
    frozen = rng.random(n) < 0.3  # params without grads: every grad column null
    outside = rng.random(n) < 0.4  # outside the step's window: no update statistics
    def maybe(values, mask):
        return [None if m else v for v, m in zip(values.tolist(), mask, strict=True)]
    return {
        "step": step, "time_us": 1_000 + step, "stage": "rl" if step % 2 else "sft",
        "tensor": [f"t{i}" for i in range(n)], "layer": np.arange(n) % 3, "kind": [KINDS[i % 4] for i in range(n)],
        "numel": rng.integers(0, 5000, n), "w_norm": rng.random(n), "update_norm": maybe(rng.random(n), outside),
        "update_ratio": rng.random(n), "changed_count": rng.integers(0, 100, n),
        "changed_rel_count": maybe(rng.integers(0, 9, n), rng.random(n) < 0.5),
        "sign_flip_count": rng.integers(0, 5, n), "w_nan_count": rng.integers(0, 2, n), "w_inf_count": 0,
        "drift_norm": rng.random(n) if with_drift else None,
        "drift_changed_count": rng.integers(0, 50, n) if with_drift else None,
        "grad_norm": maybe(rng.random(n), frozen), "grad_max_abs": maybe(rng.random(n), frozen),
        "grad_zero_count": maybe(rng.integers(0, 9, n), frozen),
        "grad_near_zero_count": maybe(rng.integers(0, 9, n), frozen),
        "grad_nan_count": maybe(rng.integers(0, 2, n), frozen), "grad_inf_count": maybe(rng.integers(0, 2, n), frozen),
    }


# by_layer: the same sums per (block of ROLLUP_BLOCK_STEPS steps, layer); a block split across flushes has a
# row per flush, so the rolled side sums its rows again (max for the peaks), as a query over it does.
_SUMMED = ["tensors", "numel", "w_sq", "update_sq", "changed_count", "changed_numel", "drift_sq", "drift_w_sq",
           "grad_zero_count", "grad_numel", "grad_nan_count"]
NAIVE_BY_LAYER = f"""
    SELECT run_id, rank, role, step // {ROLLUP_BLOCK_STEPS} * {ROLLUP_BLOCK_STEPS} AS block, stage, kind, layer,
           max(time_us), count(*), sum(numel), sum(w_norm * w_norm), sum(update_norm * update_norm),
           sum(changed_count), sum(CASE WHEN changed_count IS NOT NULL THEN numel END),
           sum(drift_norm * drift_norm), sum(CASE WHEN drift_norm IS NOT NULL THEN w_norm * w_norm END),
           sum(grad_zero_count), sum(CASE WHEN grad_zero_count IS NOT NULL THEN numel END), sum(grad_nan_count),
           max(update_ratio), max(grad_max_abs)
    FROM tensor_stats GROUP BY ALL ORDER BY ALL"""
ROLLED_BY_LAYER = f"""
    SELECT run_id, rank, role, step, stage, kind, layer, max(time_us), {", ".join(f"sum({c})" for c in _SUMMED)},
           max(update_ratio_max), max(grad_max_abs)
    FROM tensor_stats_by_layer GROUP BY ALL ORDER BY ALL"""
