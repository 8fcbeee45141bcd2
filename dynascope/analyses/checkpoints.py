"""Checkpoints built from a run's rank-1 dynamics, written as safetensors so users can evaluate them.

- ``extrapolate``: W_0 + ΔŴ₁(target_step), the linear fit of the rank-1 update (see ``dynamics_rank1``)
  carried to a step that was never trained.
- ``rank1_reconstruction``: W_0 + ‖ΔW‖_F·u₁v₁ᵀ at a recorded step: the whole update's norm put on its
  top direction, to test whether the rank-1 part carries what training learned.

Only tensors with ``spectra`` records (2-D weights) change. Every other tensor of the base checkpoint —
biases, norms, other 1-D or N-D tensors, integer buffers, 2-D weights the probe never covered — is
copied from W_0 unchanged, so the output is a complete state dict with the base's names, shapes and
dtypes. The sum is formed in float32 and cast back to the tensor's dtype. Both write tensor by tensor,
so memory stays at about one tensor. They return a per-tensor table of what was done; they never plot.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import polars as pl
import torch

from dynascope.analyses._common import StoreLike, as_store
from dynascope.analyses.dynamics_rank1 import Rank1Track, rank1_tracks
from dynascope.importers.checkpoint_io import open_checkpoint, write_safetensors
from dynascope.store import StoreError, quote_literal

__all__ = ["extrapolate", "rank1_reconstruction"]

_SCHEMA = {"tensor": pl.String, "action": pl.String, "records": pl.Int64, "step": pl.Float64, "delta_fro": pl.Float64}


def _one_run(con, run: str | None) -> str:
    where = "" if run is None else f" WHERE run_id = {quote_literal(run)}"
    runs = [r for (r,) in con._con.sql(f"SELECT DISTINCT run_id FROM spectra{where} ORDER BY 1").fetchall()]
    if not runs:
        raise StoreError("no spectra rows" + (f" for run {run!r}" if run else "") +
                         ": record with the spectral probe or `dynascope diff` first")
    if len(runs) > 1:
        raise StoreError(f"the store holds several runs with spectra ({', '.join(runs[:5])}): pass run=")
    return runs[0]


def _write(base_checkpoint: str | os.PathLike, out_path: str | os.PathLike,
           deltas: dict[str, tuple[Callable[[], torch.Tensor], dict]], metadata: dict[str, str]) -> pl.DataFrame:
    """Stream the base checkpoint to ``out_path``, adding ``deltas[name]()`` where given."""
    report = []
    with open_checkpoint(base_checkpoint) as ck:
        matched = [n for n in deltas if n in ck.specs]
        if not matched:
            raise StoreError(f"{base_checkpoint}: none of the run's {len(deltas)} tensors is in this checkpoint "
                             f"(e.g. {next(iter(deltas), '?')!r})")
        for name in matched:
            shape, info = ck.specs[name][0], deltas[name][1]
            if shape != (info["rows"], info["cols"]):
                raise StoreError(f"{base_checkpoint}: {name} is {tuple(shape)} but the run recorded "
                                 f"({info['rows']}, {info['cols']})")
        specs = [(n, shape, dtype) for n, (shape, dtype) in ck.specs.items()]

        def tensors() -> Iterator[torch.Tensor]:
            for name, _, dtype in specs:
                w = ck.get(name)
                if name in deltas and w.is_floating_point():
                    delta = deltas[name][0]()
                    report.append({"tensor": name, "action": "changed", **deltas[name][1],
                                   "delta_fro": float(torch.linalg.matrix_norm(delta))})
                    w = (w.to(torch.float32) + delta.to(torch.float32)).to(dtype)
                else:
                    report.append({"tensor": name, "action": "copied", "records": 0, "step": None, "delta_fro": None})
                yield w

        write_safetensors(out_path, specs, tensors(), metadata=metadata)
    missing = [{"tensor": n, "action": "not_in_checkpoint", "records": deltas[n][1]["records"],
                "step": deltas[n][1]["step"], "delta_fro": None} for n in deltas if n not in set(matched)]
    rows = [{k: r.get(k) for k in _SCHEMA} for r in report + missing]
    return pl.DataFrame(rows, schema=_SCHEMA)


def _factors_delta(a: np.ndarray, b: np.ndarray) -> Callable[[], torch.Tensor]:
    return lambda: torch.from_numpy(a) @ torch.from_numpy(b).T  # formed only when the tensor is written


def extrapolate(store: StoreLike, base_checkpoint: str | os.PathLike, target_step: int,
                out_path: str | os.PathLike, run: str | None = None, fit_frac: float = 1.0) -> pl.DataFrame:
    """Write W_0 + ΔŴ₁(target_step) to ``out_path`` (safetensors) from the rank-1 linear fit.

    ``base_checkpoint`` holds W_0 (the weights the run's ΔW is measured from); the line is fitted on
    the first ``fit_frac`` of each tensor's records (all by default). Returns, per tensor of the base:
    tensor, action (changed | copied | not_in_checkpoint), records used, step, delta_fro (‖ΔŴ₁‖_F).
    """
    con = as_store(store)
    run_id = _one_run(con, run)
    deltas = {}
    for t in rank1_tracks(con, run_id):
        n_fit = t.fit_count(fit_frac)
        a, b = t.linear_factors(target_step, n_fit)
        deltas[t.tensor] = (_factors_delta(a, b), {"rows": t.rows, "cols": t.cols, "records": n_fit,
                                                   "step": float(target_step)})
    meta = {"dynascope": "extrapolate", "run_id": run_id, "target_step": str(target_step),
            "fit_frac": str(fit_frac), "base": str(Path(base_checkpoint))}
    return _write(base_checkpoint, out_path, deltas, meta)


def _record_at(t: Rank1Track, step: int | None) -> int | None:
    if step is None:
        return len(t.steps) - 1
    idx = np.nonzero(t.steps <= step)[0]
    return int(idx[-1]) if len(idx) else None


def rank1_reconstruction(store: StoreLike, base_checkpoint: str | os.PathLike, out_path: str | os.PathLike,
                         run: str | None = None, step: int | None = None) -> pl.DataFrame:
    """Write W_0 + ‖ΔW‖_F·u₁v₁ᵀ per recorded 2-D tensor to ``out_path`` (safetensors).

    Uses each tensor's last record at or before ``step`` (default: its last record); tensors without
    one are copied from the base. Returns the same per-tensor table as ``extrapolate``.
    """
    con = as_store(store)
    run_id = _one_run(con, run)
    deltas = {}
    for t in rank1_tracks(con, run_id):
        i = _record_at(t, step)
        if i is None:
            continue
        a = (t.u[i] * t.drift_norm[i])[:, None]
        deltas[t.tensor] = (_factors_delta(a, t.v[i][:, None]),
                            {"rows": t.rows, "cols": t.cols, "records": 1, "step": float(t.steps[i])})
    if not deltas:
        raise StoreError(f"run {run_id!r} has no spectra record at or before step {step}")
    meta = {"dynascope": "rank1_reconstruction", "run_id": run_id, "step": str(step), "base": str(Path(base_checkpoint))}
    return _write(base_checkpoint, out_path, deltas, meta)

