"""Rank-1 linear dynamics: does the top singular direction of ΔW = W_t − W_0 grow linearly in the step?

For each tensor the ``spectra`` records give σ₁(t), u₁(t), v₁(t). Signs are aligned across records
(u₁(t)·u₁(t−1) ≥ 0, flipping v₁ with u₁ so σ₁u₁v₁ᵀ is unchanged), then σ₁u₁ is fitted as a linear
function of the step by least squares on the first ``fit_frac`` of the records.

A least-squares line predicts ŷ(T) = Σᵢ cᵢ(T)·yᵢ with cᵢ(T) = 1/n + (T − t̄)(tᵢ − t̄)/Σⱼ(tⱼ − t̄)², i.e. a
fixed combination of the fitted records. The predicted rank-1 update is that same combination of the
records' rank-1 matrices, ΔŴ₁(T) = Σᵢ cᵢ(T)·σᵢuᵢvᵢᵀ: this is the vector fit of σ₁u₁ when v₁ is steady,
needs no choice of which v₁ to use, and stays factorised (n rank-1 terms), so errors are computed from
Gram matrices of the stored vectors without forming any matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause

__all__ = ["rank1_linear_fit"]  # Rank1Track, rank1_tracks, linear_weights: helpers for checkpoints.py


@dataclass
class Rank1Track:
    """Sign-aligned rank-1 records of one tensor of one run, in step order."""

    run_id: str
    tensor: str
    layer: int | None
    kind: str | None
    rows: int
    cols: int
    steps: np.ndarray   # [n] float64
    sigma1: np.ndarray  # [n]
    drift_norm: np.ndarray  # [n] ‖ΔW‖_F
    u: np.ndarray       # [n, rows] float64, unit rows
    v: np.ndarray       # [n, cols]

    def fit_count(self, fit_frac: float) -> int:
        """Records in the fit window: the first ⌈fit_frac·n⌉, at least 2 (when there are 2)."""
        n = len(self.steps)
        return min(n, max(2, math.ceil(fit_frac * n)))

    def linear_factors(self, target_step: float, n_fit: int) -> tuple[np.ndarray, np.ndarray]:
        """(A [rows, n_fit], B [cols, n_fit]) with ΔŴ₁(target_step) = A Bᵀ from the first n_fit records."""
        c = linear_weights(self.steps[:n_fit], np.array([float(target_step)]))[0]
        return (self.u[:n_fit] * (c * self.sigma1[:n_fit])[:, None]).T, self.v[:n_fit].T


def linear_weights(t_fit: np.ndarray, t_eval: np.ndarray) -> np.ndarray:
    """Matrix C [len(t_eval), len(t_fit)] with least-squares-line predictions ŷ(t_eval) = C @ y_fit."""
    t_fit = np.asarray(t_fit, dtype=np.float64)
    n = len(t_fit)
    mean = t_fit.mean()
    s_tt = float(((t_fit - mean) ** 2).sum())
    slope = (np.asarray(t_eval, dtype=np.float64)[:, None] - mean) * (t_fit - mean)[None, :]
    return 1.0 / n + (slope / s_tt if s_tt > 0 else 0.0)


def rank1_tracks(store: StoreLike, run: str | None = None) -> list[Rank1Track]:
    """Every tensor's rank-1 records (ΔW ≠ 0, lowest rank when several ranks recorded it) of its last stage.

    Only the stage of a tensor's last record counts: in an SFT → RL run θ₀ moves to the SFT weights at the
    switch (and the dynamics change with the objective), so one line through both stages' ΔW would fit two
    different trajectories."""
    con = as_store(store)
    df = frame(con, f"""
        SELECT run_id, tensor, layer, kind, rows, cols, step, sigma1, drift_norm, u1, v1 FROM (
            SELECT run_id, tensor, layer, kind, rows, cols, step, sigma[1] AS sigma1, drift_norm, u1, v1, stage,
                   arg_max(stage, step) OVER (PARTITION BY run_id, tensor) AS last_stage
            FROM spectra
            WHERE u1 IS NOT NULL AND v1 IS NOT NULL AND drift_norm > 0 AND step IS NOT NULL{run_clause(run)}
            QUALIFY row_number() OVER (PARTITION BY run_id, tensor, step ORDER BY rank) = 1)
        WHERE stage IS NOT DISTINCT FROM last_stage
        ORDER BY run_id, tensor, step""")
    out = []
    for (run_id, tensor), g in df.group_by(["run_id", "tensor"], maintain_order=True):
        n, rows, cols = g.height, int(g["rows"][0]), int(g["cols"][0])
        u = g["u1"].explode().to_numpy().astype(np.float64).reshape(n, rows)
        v = g["v1"].explode().to_numpy().astype(np.float64).reshape(n, cols)
        for i in range(1, n):  # align each record with the (aligned) one before it
            if u[i] @ u[i - 1] < 0:
                u[i], v[i] = -u[i], -v[i]
        out.append(Rank1Track(run_id, tensor, g["layer"][0], g["kind"][0], rows, cols,
                              g["step"].to_numpy().astype(np.float64), g["sigma1"].to_numpy(),
                              g["drift_norm"].to_numpy(), u, v))
    return out


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    ss_tot = float(((y - y.mean(axis=0)) ** 2).sum())
    return 1.0 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")


def _fit_one(t: Rank1Track, fit_frac: float) -> dict:
    n = len(t.steps)
    n_fit = t.fit_count(fit_frac)
    y = t.u * t.sigma1[:, None]  # σ₁u₁ per record
    c_all = linear_weights(t.steps[:n_fit], t.steps)  # [n, n_fit]
    pred = c_all @ y[:n_fit]
    last = n - 1
    # ‖Σᵢ cᵢσᵢuᵢvᵢᵀ − σ_L u_L v_Lᵀ‖²_F from Gram matrices: aᵀ((UUᵀ) ⊙ (VVᵀ))a.
    idx = list(range(n_fit)) + [last]
    a = np.concatenate([c_all[last] * t.sigma1[:n_fit], [-t.sigma1[last]]])
    gram = (t.u[idx] @ t.u[idx].T) * (t.v[idx] @ t.v[idx].T)
    err_sq = max(float(a @ gram @ a), 0.0)
    return {
        "run_id": t.run_id, "tensor": t.tensor, "layer": t.layer, "kind": t.kind,
        "records": n, "fit_records": n_fit, "first_step": int(t.steps[0]), "fit_last_step": int(t.steps[n_fit - 1]),
        "last_step": int(t.steps[last]),
        "r2_fit": _r2(y[:n_fit], pred[:n_fit]) if n_fit > 2 else float("nan"),
        "r2_all": _r2(y, pred) if n > 1 else float("nan"),
        "rel_error_u_last": float(np.linalg.norm(pred[last] - y[last]) / np.linalg.norm(y[last])),
        "rel_error_last": math.sqrt(err_sq) / float(t.sigma1[last]),
        "u_cos_first_last": float(abs(t.u[0] @ t.u[last])),
        "rank1_energy_last": float(t.sigma1[last] ** 2 / t.drift_norm[last] ** 2),
    }


def rank1_linear_fit(store: StoreLike, run: str | None = None, fit_frac: float = 0.3) -> pl.DataFrame:
    """Per tensor: how well a line in the step, fitted to the first ``fit_frac`` of the records of σ₁u₁,
    explains and predicts the rank-1 update.

    Columns: run_id, tensor, layer, kind, records, fit_records, first_step, fit_last_step, last_step,
    r2_fit (R² on the fit window; NaN with only 2 records there, where a line fits exactly), r2_all
    (R² of the same line over all records), rel_error_u_last (‖σ̂₁û₁ − σ₁u₁‖/‖σ₁u₁‖ at the last record),
    rel_error_last (the same for the rank-1 matrix σ₁u₁v₁ᵀ, relative Frobenius error), u_cos_first_last
    (|u₁(first)·u₁(last)|, how steady the direction is) and rank1_energy_last. Tensors with fewer than
    2 records are left out; a tensor's records are those of its last stage (see ``rank1_tracks``).
    """
    if not 0 < fit_frac <= 1:
        raise ValueError(f"fit_frac must be in (0, 1], not {fit_frac}")
    rows = [_fit_one(t, fit_frac) for t in rank1_tracks(store, run) if len(t.steps) >= 2]
    schema = {"run_id": pl.String, "tensor": pl.String, "layer": pl.Int32, "kind": pl.String,
              "records": pl.Int64, "fit_records": pl.Int64, "first_step": pl.Int64, "fit_last_step": pl.Int64,
              "last_step": pl.Int64, "r2_fit": pl.Float64, "r2_all": pl.Float64, "rel_error_u_last": pl.Float64,
              "rel_error_last": pl.Float64, "u_cos_first_last": pl.Float64, "rank1_energy_last": pl.Float64}
    return pl.DataFrame(rows, schema=schema)
