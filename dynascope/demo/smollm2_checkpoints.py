"""The real-model run's rewritten checkpoints: AlphaRL's rank-1 replacement and RELEX's extrapolation.

Both are scored on the held-out problems like the trained policy (``HeldOut.evaluate``), so their
accuracies pair problem by problem with the final model's. RELEX needs the trajectory, not only its
ends: during RL the run saves δ_t = θ_t − θ₀ (θ₀ = the SFT result) after every ``relex_every`` step of the
widest observation window, in float16 as the authors' ``precompute_deltas.py`` stores them, and deletes
them once the extrapolations are written.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import polars as pl
import torch

from dynascope.demo.smollm2 import FINAL_FILE, THETA0_FILE, SmolSettings, load_weights

RANK1_FILE = "policy_rank1.safetensors"            # AlphaRL as the authors' upd_rank.py: the rest at base
RANK1_REST_RL_FILE = "policy_rank1_rest_rl.safetensors"  # the rest (embeddings, norms) with RL's full update
DELTA_DIR = "relex_deltas"
DELTA_DTYPE = torch.float16


def relex_file(frac: float) -> str:
    return f"policy_relex{round(100 * frac)}.safetensors"


def relex_label(frac: float) -> str:
    return f"relex{round(100 * frac)}"


@torch.no_grad()
def save_delta(model: torch.nn.Module, run_dir: Path, rl_step: int) -> Path:
    """Write θ_t − θ₀ of every parameter (float16) for RL step ``rl_step``; θ₀ is read from its file."""
    from safetensors import safe_open

    from dynascope.core.tensor_io import write_safetensors

    params = list(model.named_parameters())
    specs = [(n, tuple(p.shape), DELTA_DTYPE) for n, p in params]
    out = run_dir / DELTA_DIR / f"delta-rl{rl_step:05d}.safetensors"
    with safe_open(str(run_dir / THETA0_FILE), framework="pt", device="cpu") as theta0:
        deltas = ((p.detach().cpu().float() - theta0.get_tensor(n).float()).to(DELTA_DTYPE) for n, p in params)
        write_safetensors(out, specs, deltas, metadata={"dynascope": "relex_delta", "rl_step": str(rl_step)})
    return out


def _scalar_summary(report: pl.DataFrame) -> dict[str, float]:
    """Fit quality over the tensors that moved: the trajectory's rank-1 share and the line's R², as medians."""
    moved = report.filter(pl.col("explained_var").is_not_null())
    if moved.is_empty():
        return {}
    return {"explained_var_median": float(moved["explained_var"].median()),
            "r2_median": float(moved["r2"].median())}


def rewritten_checkpoints(s: SmolSettings, model: Any, held: Any, scope: Any, say=print) -> dict[str, float]:
    """AlphaRL's two variants and RELEX for each observation window, written and scored on ``model``.

    ``model`` is the trained policy, used here only as a vessel to score the rewritten weights (the final
    policy is already saved). Returns {label: held-out accuracy}; logs ``alpharl/*`` and ``relex/*``.
    """
    from dynascope.checkpoints import alpharl_rank1, relex_extrapolate

    run_dir = Path(s.run_dir)
    out: dict[str, float] = {}

    def score(label: str, path: Path) -> float:
        load_weights(model, path)
        point = held.evaluate(model, label, stage="rl", rl_step=None, log=False)
        return sum(point["correct"]) / len(point["correct"])

    with scope.phase("alpharl"):
        alpharl_rank1(run_dir / THETA0_FILE, run_dir / FINAL_FILE, run_dir / RANK1_FILE, rest="base",
                      other_rest_path=run_dir / RANK1_REST_RL_FILE)  # one SVD per weight for both variants
        for key, name in (("rank1", RANK1_FILE), ("rank1_rest_rl", RANK1_REST_RL_FILE)):
            out[key] = score(f"alpharl_{key}", run_dir / name)
    scope.log(**{f"alpharl/{k}_accuracy": v for k, v in out.items()})
    say(f"AlphaRL rank-1 replacement: held-out accuracy {out['rank1']:.1%} (rest at base), "
        f"{out['rank1_rest_rl']:.1%} (rest with RL's update)", flush=True)

    saved = sorted((int(p.stem.removeprefix("delta-rl")), p) for p in (run_dir / DELTA_DIR).glob("delta-rl*.safetensors"))
    for frac in s.relex_fits():
        window = [(t, p) for t, p in saved if t <= s.relex_window(frac)]
        label = relex_label(frac)
        with scope.phase("relex"):
            report = relex_extrapolate(run_dir / THETA0_FILE, window, s.rl_steps, run_dir / relex_file(frac))
            out[label] = score(label, run_dir / relex_file(frac))
        fit = _scalar_summary(report)
        scope.log(**{f"relex/{label}_accuracy": out[label], f"relex/{label}_fit_steps": window[-1][0],
                     f"relex/{label}_observed": len(window), **{f"relex/{label}_{k}": v for k, v in fit.items()}})
        say(f"RELEX from the first {window[-1][0]} of {s.rl_steps} RL steps ({len(window)} deltas): held-out "
            f"accuracy {out[label]:.1%}; trajectory rank-1 share {fit.get('explained_var_median', float('nan')):.1%}, "
            f"line R² {fit.get('r2_median', float('nan')):.2f} (medians over tensors)", flush=True)
    shutil.rmtree(run_dir / DELTA_DIR, ignore_errors=True)  # 0.5 bytes per parameter per saved step
    return out
