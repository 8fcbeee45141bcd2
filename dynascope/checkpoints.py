"""Checkpoints written from a run's parameter dynamics (this module writes files; ``analyses`` never does).

- ``alpharl_rank1``: AlphaRL's rank-1 replacement (arXiv 2510.00553) from two checkpoints, W_base and
  W_RL: every ≥2-D attention and MLP weight inside the transformer blocks becomes
  W_base + ‖ΔW‖_F·u₁v₁ᵀ, with ΔW = W_RL − W_base and u₁, v₁ its top singular vectors (an exact SVD,
  as the authors' ``eval/svd.py`` + ``eval/upd_rank.py``). Every other tensor (embeddings, lm_head,
  norms, biases) is taken from the base, as their ``upd_rank.py`` leaves it, or with ``rest="rl"``
  from the RL checkpoint (its full update).
- ``extrapolate``: W_0 + ΔŴ₁(target_step), the linear fit of the rank-1 update (see
  ``analyses.dynamics_rank1``) carried to a step that was never trained.
- ``rank1_reconstruction``: W_0 + ‖ΔW‖_F·u₁v₁ᵀ at a recorded step, from the ``spectra`` the probe
  or ``dynascope diff`` recorded (only the 2-D weights those cover change).
- ``relex_extrapolate``: RELEX (arXiv 2605.21468), the rank-1 direction of each tensor's *trajectory*
  (the deltas θ_t − θ₀ of several steps stacked), its coefficient carried along a line to a later step.

Tensors without a replacement are copied unchanged, so the output is a complete state dict with the
base's names, shapes and dtypes. Sums are formed in float32 (float64 for float64 weights) and cast
back to the tensor's dtype. All write tensor by tensor, so memory stays at about one tensor (two for
``alpharl_rank1``), and return a per-tensor table of what was done.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import polars as pl
import torch

from dynascope.analyses.dynamics_rank1 import Rank1Track, rank1_tracks
from dynascope.core.tensor_io import open_checkpoint, write_safetensors
from dynascope.store import StoreError, StoreLike, as_store, quote_literal

__all__ = ["alpharl_rank1", "extrapolate", "rank1_reconstruction", "relex_extrapolate"]

_SCHEMA = {"tensor": pl.String, "action": pl.String, "records": pl.Int64, "step": pl.Float64, "delta_fro": pl.Float64}


def _one_run(con, run: str | None) -> str:
    where = "" if run is None else f" WHERE run_id = {quote_literal(run)}"
    runs = [r for (r,) in con.rows(f"SELECT DISTINCT run_id FROM spectra{where} ORDER BY 1")]
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

    Uses each tensor's last record at or before ``step`` (default: its last record) among the records of
    its last stage (``rank1_tracks``); tensors without one are copied from the base. Returns the same
    per-tensor table as ``extrapolate``.
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



# ---- AlphaRL's rank-1 replacement, from the two checkpoints ----------------------------------------------

_BLOCK_KINDS = frozenset({"q", "k", "v", "o", "qkv", "mlp"})
_ALPHARL_SCHEMA = {"tensor": pl.String, "action": pl.String, "rows": pl.Int64, "cols": pl.Int64,
                   "drift_norm": pl.Float64, "sigma1": pl.Float64, "rank1_energy": pl.Float64}


def alpharl_target(name: str, shape: tuple[int, ...]) -> bool:
    """Whether AlphaRL replaces this tensor: a ≥2-D ``.weight`` of an attention or MLP module inside a
    transformer block (their scripts walk ``model.layers[i].self_attn`` and ``.mlp`` for 2-D weights)."""
    from dynascope.core.naming import tensor_kind, tensor_layer

    return (len(shape) >= 2 and name.endswith("weight") and tensor_layer(name) is not None
            and tensor_kind(name) in _BLOCK_KINDS)


def rank1_replacement(w_base: torch.Tensor, w_rl: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """W_base + ‖ΔW‖_F·u₁v₁ᵀ in W_base's dtype, and (drift_norm, sigma1, rank1_energy) of ΔW.

    ΔW is formed in float32 (float64 stays float64) and flattened to 2-D over its trailing dims; the
    SVD is exact (``torch.linalg.svd``), as the authors'. A zero ΔW leaves the base unchanged.
    """
    work = torch.float64 if w_base.dtype == torch.float64 else torch.float32
    base = w_base.to(work)
    delta = (w_rl.to(work) - base).reshape(w_base.shape[0], -1)
    fro = float(torch.linalg.matrix_norm(delta))
    if fro == 0.0:
        return w_base.clone(), {"drift_norm": 0.0, "sigma1": 0.0, "rank1_energy": None}
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    # upd_rank.py: base += (‖U S Vᵀ‖ / ‖U₁ S₁ V₁ᵀ‖) · U₁ S₁ V₁ᵀ, i.e. ‖ΔW‖_F · u₁v₁ᵀ for rank 1
    rank1 = fro * torch.outer(u[:, 0], vh[0])
    out = (base + rank1.reshape(w_base.shape)).to(w_base.dtype)
    s1 = float(s[0])
    return out, {"drift_norm": fro, "sigma1": s1, "rank1_energy": s1 * s1 / (fro * fro)}


def alpharl_rank1(base_checkpoint: str | os.PathLike, rl_checkpoint: str | os.PathLike,
                  out_path: str | os.PathLike, rest: str = "base",
                  other_rest_path: str | os.PathLike | None = None) -> pl.DataFrame:
    """Write AlphaRL's rank-1 replacement of ``rl_checkpoint``'s update from ``base_checkpoint``.

    Block attention/MLP weights (``alpharl_target``) become W_base + ‖ΔW‖_F·u₁v₁ᵀ; every other tensor
    comes from the base (``rest="base"``, the authors' ``upd_rank.py``) or from the RL checkpoint
    (``rest="rl"``: embeddings, lm_head and norms keep their full update). Returns per tensor: tensor,
    action (rank1 | base | rl), rows, cols, drift_norm (‖ΔW‖_F), sigma1 and rank1_energy (σ₁²/‖ΔW‖²_F).
    ``other_rest_path`` also writes the other ``rest`` variant there, its rank-1 tensors read back from
    ``out_path`` rather than decomposed again.
    """
    if rest not in ("base", "rl"):
        raise ValueError(f"rest must be 'base' or 'rl', not {rest!r}")
    report: list[dict] = []
    with open_checkpoint(base_checkpoint) as base, open_checkpoint(rl_checkpoint) as rl:
        if set(base.specs) != set(rl.specs):
            odd = sorted(set(base.specs) ^ set(rl.specs))
            raise StoreError(f"{rl_checkpoint}: tensor names differ from {base_checkpoint} (e.g. {odd[0]!r})")
        for name, (shape, _) in base.specs.items():
            if rl.specs[name][0] != shape:
                raise StoreError(f"{rl_checkpoint}: {name} is {tuple(rl.specs[name][0])}, base has {tuple(shape)}")
        specs = [(n, shape, dtype) for n, (shape, dtype) in base.specs.items()]
        if not any(alpharl_target(n, tuple(shape)) for n, shape, _ in specs):
            raise StoreError(f"{base_checkpoint}: no attention or MLP weight inside transformer blocks")

        def tensors() -> Iterator[torch.Tensor]:
            for name, shape, _ in specs:
                row = {"tensor": name, "rows": shape[0] if len(shape) else None,
                       "cols": int(np.prod(shape[1:])) if len(shape) > 1 else None}
                w0 = base.get(name)
                if alpharl_target(name, tuple(shape)) and w0.is_floating_point():
                    w, stats = rank1_replacement(w0, rl.get(name))
                    report.append({**row, "action": "rank1", **stats})
                    yield w
                else:
                    report.append({**row, "action": rest})
                    yield w0 if rest == "base" else rl.get(name).to(w0.dtype)

        meta = {"dynascope": "alpharl_rank1", "rest": rest, "base": str(Path(base_checkpoint)),
                "rl": str(Path(rl_checkpoint))}
        write_safetensors(out_path, specs, tensors(), metadata=meta)
        if other_rest_path is not None:
            other = "rl" if rest == "base" else "base"
            with open_checkpoint(out_path) as done:
                rank1 = {r["tensor"] for r in report if r["action"] == "rank1"}
                src = {"base": base, "rl": rl}[other]
                write_safetensors(other_rest_path, specs,
                                  (done.get(n) if n in rank1 else src.get(n).to(dt) for n, _, dt in specs),
                                  metadata={**meta, "rest": other})
    return pl.DataFrame([{k: r.get(k) for k in _ALPHARL_SCHEMA} for r in report], schema=_ALPHARL_SCHEMA)


# ---- RELEX: rank-1 extrapolation of a run's trajectory, from saved deltas --------------------------------

_RELEX_SCHEMA = {"tensor": pl.String, "numel": pl.Int64, "records": pl.Int64, "explained_var": pl.Float64,
                 "r2": pl.Float64, "coef_last": pl.Float64, "coef_target": pl.Float64, "delta_fro": pl.Float64}


def _rows_per_chunk(shape: tuple[int, ...], records: int, chunk_bytes: int) -> int:
    row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    return max(1, chunk_bytes // (4 * row * max(records, 1)))


def relex_extrapolate(base_checkpoint: str | os.PathLike, deltas: list[tuple[int, str | os.PathLike]],
                      target_step: int, out_path: str | os.PathLike, *, chunk_bytes: int = 64 << 20) -> pl.DataFrame:
    """RELEX (Wei et al., arXiv 2605.21468): write θ₀ + ĉ(target_step)·v₁ per tensor to ``out_path``.

    ``deltas`` are (step, file) pairs of δ_t = θ_t − θ₀ (safetensors, the base's names; any float dtype)
    over the observation window. Per tensor, as the authors' ``scripts/svd_extrapolation.py`` (``--rank 1
    --fit_method linear --mode extrapolate``): the flattened deltas are the rows of M [T, d]; its rank-1
    SVD M ≈ σ₁u₁v₁ᵀ (from the T×T Gram matrix MMᵀ) gives the direction v₁ and the coefficients
    c_t = σ₁u₁[t] = δ_t·v₁; a least-squares line c(t) = a·t + b over the observed steps predicts
    ĉ = c(target_step), and the tensor becomes θ₀ + ĉ·v₁. Tensors whose deltas are all zero are copied.
    M is read in row chunks of about ``chunk_bytes`` (float32), twice: once for MMᵀ, once for v₁.

    Returns per tensor: tensor, numel, records, explained_var (σ₁²/Σσ², the share of the trajectory's
    energy on v₁), r2 (of the line against c_t), coef_last (c at the last observed step), coef_target (ĉ)
    and delta_fro (‖ĉ·v₁‖ = |ĉ|).
    """
    from safetensors import safe_open

    if len(deltas) < 2:
        raise ValueError("RELEX fits a line: give at least two observed steps")
    steps = np.array([float(s) for s, _ in deltas])
    report: list[dict] = []
    with ExitStack() as stack, open_checkpoint(base_checkpoint) as base:
        files = [stack.enter_context(safe_open(str(p), framework="pt", device="cpu")) for _, p in deltas]
        for (_, p), f in zip(deltas, files, strict=True):
            if set(f.keys()) != set(base.specs):
                odd = sorted(set(f.keys()) ^ set(base.specs))
                raise StoreError(f"{p}: tensor names differ from {base_checkpoint} (e.g. {odd[0]!r})")
        specs = [(n, shape, dtype) for n, (shape, dtype) in base.specs.items()]

        def rows(name: str, shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
            """M's columns for rows lo..hi of the tensor: [T, (hi − lo)·row] float32."""
            if len(shape) == 0:
                return torch.stack([f.get_tensor(name).reshape(1).float() for f in files])
            return torch.stack([f.get_slice(name)[lo:hi].reshape(-1).float() for f in files])

        def tensors() -> Iterator[torch.Tensor]:
            for name, shape, dtype in specs:
                w0 = base.get(name)
                n_rows = shape[0] if len(shape) else 1
                step_rows = _rows_per_chunk(shape, len(files), chunk_bytes)
                gram = torch.zeros(len(files), len(files), dtype=torch.float64)
                for lo in range(0, n_rows, step_rows):
                    m = rows(name, shape, lo, lo + step_rows)
                    gram += (m @ m.T).double()
                lam, vec = torch.linalg.eigh(gram)  # ascending
                total, top = float(lam.clamp(min=0).sum()), float(lam[-1].clamp(min=0))
                row = {"tensor": name, "numel": w0.numel(), "records": len(files)}
                if not w0.is_floating_point() or top <= 0.0:
                    report.append({**row, "delta_fro": 0.0})
                    yield w0
                    continue
                u1, s1 = vec[:, -1], top ** 0.5
                coef = (u1 * s1).numpy()
                slope, icpt = np.polyfit(steps, coef, 1)
                fit = slope * steps + icpt
                ss_tot = float(((coef - coef.mean()) ** 2).sum())
                c_hat = float(slope * target_step + icpt)
                out = w0.to(torch.float32).reshape(n_rows, -1).clone()
                u1f = u1.float()
                for lo in range(0, n_rows, step_rows):  # v₁ = Mᵀu₁/σ₁, chunk by chunk
                    m = rows(name, shape, lo, lo + step_rows)
                    out[lo:lo + step_rows] += (c_hat / s1) * (u1f @ m).reshape(-1, out.shape[1])
                report.append({**row, "explained_var": top / total if total > 0 else None,
                               "r2": 1.0 - float(((coef - fit) ** 2).sum()) / ss_tot if ss_tot > 0 else None,
                               "coef_last": float(coef[-1]), "coef_target": c_hat, "delta_fro": abs(c_hat)})
                yield out.reshape(shape).to(dtype)

        meta = {"dynascope": "relex_extrapolate", "target_step": str(target_step),
                "steps": ",".join(str(s) for s, _ in deltas), "base": str(Path(base_checkpoint))}
        write_safetensors(out_path, specs, tensors(), metadata=meta)
    return pl.DataFrame([{k: r.get(k) for k in _RELEX_SCHEMA} for r in report], schema=_RELEX_SCHEMA)
