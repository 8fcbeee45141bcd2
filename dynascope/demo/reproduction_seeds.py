"""The long run at several seeds: each measure per seed and across seeds, each paper's verdict at every seed,
and which recorded measure tracks forgetting (rank correlations over evaluation points and seeds).

Input: one ``benchmarks/smollm2_long.py`` results file per seed (``reproduction_figures``' dict). A seed's
cell is its figure with its within-seed 95% bootstrap interval (problems, windows or steps resampled, as
``demo.intervals`` says); the across-seeds cell is the mean of the seeds' figures with a 95% t interval over
seeds (mean ± t₀.₉₇₅,ₙ₋₁·s/√n), which is how far a further seed's run may land, not how sure one run is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dynascope.demo.intervals import bootstrap
from dynascope.demo.reproduction import fmt

__all__ = ["VERDICTS", "correlation_table", "forgetting_correlations", "load_seed_files", "points_table", "render", "rho_text",
           "seeds_table", "spearman", "verdicts"]

# t₀.₉₇₅ with n − 1 degrees of freedom, n = 2..10 seeds
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def _get(doc: dict[str, Any], *path: str) -> Any:
    for key in path:
        doc = doc.get(key) if isinstance(doc, dict) else None
        if doc is None:
            return None
    return doc


# (measure, path to its interval dict in a seed's file, format keywords of ``reproduction.fmt``)
MEASURES: list[tuple[str, tuple[str, ...], dict[str, Any]]] = [
    ("PULSE S₁ (median per RL step)", ("pulse_s1",), {"digits": 2}),
    ("Mukherjee update sparsity, RL vs its base", ("mukherjee_rl",), {}),
    ("AlphaRL rank-1: share of RL's gain recovered", ("recovery", "alpharl_rank1"), {"digits": 0}),
    ("RELEX from 15% of RL steps − final accuracy", ("minus_final", "relex15"), {"pts": True}),
    ("RELEX from 25% of RL steps − final accuracy", ("minus_final", "relex25"), {"pts": True}),
    ("bf16 delta sync, share of bf16 bytes", ("delta_sync",), {"digits": 2}),
    ("Held-out accuracy after SFT", ("accuracy", "sft"), {}),
    ("Held-out accuracy, final", ("accuracy", "rl"), {}),
    ("RL's gain in held-out accuracy", ("rl_gain",), {"pts": True}),
    ("KL(π_SFT‖π_RL), nats", ("forward_kl_nats", "rl", "sft"), {"digits": 3, "pct": False}),
    ("KL(π_pretrained‖π_RL), nats", ("forward_kl_nats", "rl", "pretrained"), {"digits": 3, "pct": False}),
    ("Forgetting over RL: prose log-loss rise from SFT, 10⁻³ nats/token", ("forgetting_nats", "sft", "rl"),
     {"digits": 3, "pct": False, "scale": 1e3}),
    ("Forgetting since pretrained: prose log-loss rise, 10⁻³ nats/token", ("forgetting_nats", "pretrained", "rl"),
     {"digits": 3, "pct": False, "scale": 1e3}),
    ("Trainer↔rollout gap: mean |Δ| per token, nats", ("gap_floor", "rollout_mean_nats"), {"digits": 4, "pct": False}),
    ("Trainer↔trainer floor: mean |Δ| per token, 10⁻⁶ nats", ("gap_floor", "self_mean_nats"),
     {"digits": 2, "pct": False, "scale": 1e6}),
    ("Trainer↔rollout: tokens over 0.1 nats", ("gap_floor", "rollout_over_share"), {"digits": 2}),
    ("Trainer↔trainer: tokens over 0.1 nats", ("gap_floor", "self_over_share"), {"digits": 2}),
    ("Trainer↔rollout: ratio exp(Δ) outside [0.9, 1.1]", ("gap_floor", "rollout_ratio_outside_share"), {"digits": 2}),
    ("Trainer↔trainer: ratio exp(Δ) outside [0.9, 1.1]", ("gap_floor", "self_ratio_outside_share"), {"digits": 2}),
    ("Share of the rollout gap above the trainer's floor", ("gap_floor", "rollout_gap_above_floor_share"), {"digits": 1}),
]


def _kl_rises(doc: dict[str, Any]) -> bool | None:
    kl = doc.get("forward_kl_nats", {})
    labels = ["sft", *(f"rl@{s}" for s in doc.get("rl_steps_evaluated", []) if f"rl@{s}" in kl), "rl"]
    vals = [_get(kl, label, "pretrained", "value") for label in labels]
    return None if None in vals else all(b > a for a, b in zip(vals, vals[1:], strict=False))


def _below(x: float | None, bound: float) -> bool | None:
    return None if x is None else x < bound


def _all(xs: list[bool | None]) -> bool | None:
    return None if None in xs else all(xs)


# (paper claim as read against the run, test of one seed's file: None where the file lacks the figure)
VERDICTS: dict[str, tuple[str, Callable[[dict[str, Any]], bool | None]]] = {
    "pulse": ("PULSE: ≥99% of bf16 weights unchanged per step",
              lambda d: None if (v := _get(d, "pulse_s1", "value")) is None else v >= 0.99),
    "mukherjee": ("Mukherjee et al.: RL update sparsity 70–95%",
                  lambda d: None if (v := _get(d, "mukherjee_rl", "value")) is None else 0.70 <= v <= 0.95),
    "alpharl_short": ("AlphaRL's >99% recovery not reached (interval below 99%)",
                      lambda d: _below(_get(d, "recovery", "alpharl_rank1", "ci_high"), 0.99)),
    "relex_short": ("RELEX falls short of the final model (both intervals below 0)",
                    lambda d: _all([_below(_get(d, "minus_final", k, "ci_high"), 0) for k in ("relex15", "relex25")])),
    "kl_rises": ("KL to the pretrained model rose at every evaluation point", _kl_rises),
    "gap_above_floor": ("The rollout gap exceeds the trainer's own floor (interval above 0)",
                        lambda d: None if (v := _get(d, "gap_floor", "excess_mean_nats", "ci_low")) is None else v > 0),
}


def verdicts(docs: Sequence[dict[str, Any]]) -> dict[str, list[bool | None]]:
    """Per verdict of ``VERDICTS``, whether it holds at each seed (in ``docs``' order; None: not measured)."""
    return {k: [test(d) for d in docs] for k, (_, test) in VERDICTS.items()}


def _across(values: list[float]) -> dict[str, float | None]:
    n = len(values)
    if n == 0:
        return {"value": None}
    mean = float(np.mean(values))
    if n < 2:
        return {"value": mean, "ci_low": None, "ci_high": None}
    half = _T975.get(n - 1, 1.96) * float(np.std(values, ddof=1)) / math.sqrt(n)
    return {"value": mean, "ci_low": mean - half, "ci_high": mean + half}


def _scaled(cell: dict[str, Any] | None, scale: float) -> dict[str, Any] | None:
    if not cell or scale == 1.0:
        return cell
    return {k: (v * scale if k in ("value", "ci_low", "ci_high") and v is not None else v) for k, v in cell.items()}


def _seed(doc: dict[str, Any]) -> Any:
    return _get(doc, "regime", "seed")


def seeds_table(docs: Sequence[dict[str, Any]]) -> str:
    """Markdown: a row per measure, a column per seed (figure [within-seed bootstrap 95%]) and the mean
    across seeds [t interval over seeds]; then each paper verdict at each seed."""
    n = len(docs)
    head = ["measure", *(f"seed {_seed(d)}" for d in docs), f"mean of {n} seed{'s' * (n != 1)} [95% t interval over seeds]"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, path, kw in MEASURES:
        kw = dict(kw)
        scale = kw.pop("scale", 1.0)
        cells = [_scaled(_get(d, *path), scale) for d in docs]
        values = [c["value"] for c in cells if c and c.get("value") is not None]
        across = _across(values) if len(values) == n else {"value": None}
        lines.append("| " + " | ".join([name.replace("|", "\\|"), *(fmt(c, **kw) for c in cells), fmt(across, **kw)]) + " |")
    held = verdicts(docs)
    lines += ["", "| verdict | " + " | ".join(f"seed {_seed(d)}" for d in docs) + " | holds at |",
              "|" + "---|" * (n + 2)]
    for key, (claim, _) in VERDICTS.items():
        marks = ["—" if h is None else "yes" if h else "no" for h in held[key]]
        measured = sum(h is not None for h in held[key])
        lines.append(f"| {claim} | " + " | ".join(marks) + f" | {sum(bool(h) for h in held[key])} of {measured} "
                     f"seed{'s' * (measured != 1)}" + (f" ({n - measured} without the figure)" if measured < n else "") + " |")
    return "\n".join(lines) + "\n"


def _rank(a: np.ndarray) -> np.ndarray:
    """Ranks 0..n−1, ties given their average rank."""
    order = np.argsort(a, kind="mergesort")
    r = np.empty(len(a))
    r[order] = np.arange(len(a))
    _, inv, counts = np.unique(a, return_inverse=True, return_counts=True)
    return np.bincount(inv, weights=r)[inv] / counts[inv]


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's ρ (Pearson's r of the ranks, ties averaged); NaN when either side is constant."""
    rx, ry = _rank(np.asarray(x, dtype=np.float64)), _rank(np.asarray(y, dtype=np.float64))
    if len(rx) < 2 or rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


# the candidates RL's Razor weighs, and the training step: every cumulative measure rises with it
CANDIDATES = [("forward_kl_nats", "KL(π_SFT‖π) on the training task"), ("drift_norm", "‖W − θ₀‖_F"),
              ("drift_ratio", "‖W − θ₀‖/‖W‖"), ("mukherjee_changed_share", "Mukherjee changed share (1 − sparsity)"),
              ("rank1_energy", "rank-1 energy of W − θ₀"), ("rl_step", "RL steps taken (the clock)")]


def _points(docs: Sequence[dict[str, Any]]) -> list[tuple[Any, dict[str, Any]]]:
    return [(_seed(d), p) for d in docs for p in d.get("forgetting_points", [])
            if p.get("forgetting_nats") is not None]


def _across_seeds(x: np.ndarray, y: np.ndarray, seeds: list[Any], steps: list[Any]) -> tuple[float, Any]:
    """Mean over RL steps of ρ across the seeds evaluated at that step (each step with 3 or more seeds), and
    its bootstrap interval resampling seeds: does a seed that moved further by this measure forget more than
    another seed at the same step? The clock is held fixed, so a measure that only counts steps scores nothing."""
    names = list(dict.fromkeys(seeds))
    by = {(s, t): i for i, (s, t) in enumerate(zip(seeds, steps, strict=True))}
    common = [t for t in dict.fromkeys(steps) if sum((s, t) in by for s in names) >= 3]

    def stat(pick: np.ndarray) -> float:
        rhos = []
        for t in common:
            idx = [by[(names[k], t)] for k in pick if (names[k], t) in by]
            rhos.append(spearman(x[idx], y[idx]) if len(idx) >= 3 else math.nan)
        rhos = [r for r in rhos if math.isfinite(r)]
        return float(np.mean(rhos)) if rhos else math.nan

    return stat(np.arange(len(names))), bootstrap(len(names), stat) if common else None


def forgetting_correlations(docs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per candidate: Spearman's ρ with forgetting over every (seed, evaluation point) pair, its 95% bootstrap
    interval (pairs resampled), ρ within each seed's points alone, and ρ across seeds at the same RL step
    (``within_step``, the mean over steps, with its interval over seeds: ``_across_seeds``)."""
    pts = _points(docs)
    y = np.array([p["forgetting_nats"] for _, p in pts], dtype=np.float64)
    out = []
    for col, label in CANDIDATES:
        x = np.array([np.nan if p.get(col) is None else p[col] for _, p in pts], dtype=np.float64)
        ok = np.isfinite(x)
        xs, ys = x[ok], y[ok]
        iv = bootstrap(len(xs), lambda i, xs=xs, ys=ys: spearman(xs[i], ys[i]))
        seeds = {}
        for seed in dict.fromkeys(s for s, _ in pts):
            mine = [i for i, (s, _) in enumerate(pts) if s == seed and ok[i]]
            seeds[seed] = spearman(x[mine], y[mine]) if len(mine) >= 3 else None
        kept = [pt for pt, good in zip(pts, ok, strict=True) if good]
        value, within = _across_seeds(xs, ys, [s for s, _ in kept], [p.get("rl_step") for _, p in kept])
        out.append({"candidate": col, "label": label, "points": int(ok.sum()), **iv.as_dict(), "per_seed": seeds,
                    "within_step": value if math.isfinite(value) else None,
                    "within_step_ci": (within.low, within.high) if within is not None else (None, None)})
    return out


def rho_text(v: float | None) -> str:
    """ρ as the tables show it: signed, two decimals; '—' when there is none."""
    return "—" if v is None or not math.isfinite(v) else f"{v:+.2f}"


def correlation_table(docs: Sequence[dict[str, Any]]) -> str:
    """Markdown: Spearman's ρ of each candidate with forgetting, pooled [bootstrap 95%], per seed, and across
    seeds at the same RL step."""
    rows = forgetting_correlations(docs)
    seeds = [_seed(d) for d in docs]
    lines = ["| candidate | points | ρ with forgetting, pooled [95% bootstrap] | "
             + " | ".join(f"ρ, seed {s}" for s in seeds)
             + " | ρ across seeds at the same RL step, mean over steps [95% bootstrap over seeds] |",
             "|" + "---|" * (4 + len(seeds))]

    def shown(v: float | None, lo: float | None, hi: float | None) -> str:
        return rho_text(v) + (f" [{rho_text(lo)}, {rho_text(hi)}]" if lo is not None else "")

    for r in rows:
        lines.append(f"| {r['label']} | {r['points']} | {shown(r['value'], r.get('ci_low'), r.get('ci_high'))} | "
                     + " | ".join(rho_text(r["per_seed"].get(s)) for s in seeds)
                     + f" | {shown(r['within_step'], *r['within_step_ci'])} |")
    return "\n".join(lines) + "\n"


def points_table(docs: Sequence[dict[str, Any]]) -> str:
    """Markdown: every RL evaluation point of every seed with forgetting and its candidate predictors."""
    lines = ["| seed | RL step | forgetting, 10⁻³ nats/token | KL(π_SFT‖π), nats | ‖W − θ₀‖_F | ‖W − θ₀‖/‖W‖ | "
             "Mukherjee changed | rank-1 energy |", "|" + "---|" * 8]
    num = lambda v, f: "—" if v is None else format(v, f)  # noqa: E731
    for seed, p in _points(docs):
        lines.append(f"| {seed} | {p.get('rl_step')} | {num(p['forgetting_nats'] * 1e3, '+.3f')} | "
                     f"{num(p.get('forward_kl_nats'), '.3f')} | {num(p.get('drift_norm'), '.4f')} | "
                     f"{num(p.get('drift_ratio'), '.2e')} | {num(p.get('mukherjee_changed_share'), '.2%')} | "
                     f"{num(p.get('rank1_energy'), '.3f')} |")
    return "\n".join(lines) + "\n"


def load_seed_files(folder: str | Path) -> list[dict[str, Any]]:
    """Every ``seed*.json`` results file of ``folder``, ordered by seed."""
    docs = [json.loads(f.read_text()) for f in Path(folder).glob("seed*.json")]
    if not docs:
        raise FileNotFoundError(f"{folder}: no seed*.json results file")
    return sorted(docs, key=_seed)


def render(docs: Sequence[dict[str, Any]]) -> str:
    """The whole multi-seed Markdown: what ran (commands and wall times), the measures and verdicts per seed,
    every RL evaluation point with forgetting and its candidates, and their rank correlations."""
    steps = sorted({d["rl_steps"] for d in docs})
    n = len(docs)
    head = (f"{n} seed{'s' * (n != 1)} ({', '.join(str(_seed(d)) for d in docs)}), {'/'.join(map(str, steps))} RL "
            f"steps, {docs[0]['held_out_n']} held-out problems each. Commands: "
            + "; ".join(f"`{d['command']}` ({d['wall_s'] / 60:.0f} min)" for d in docs) + ".\n\n")
    return (head + seeds_table(docs) + "\nForgetting against its candidate predictors, at every RL evaluation point:\n\n"
            + points_table(docs) + "\nSpearman's ρ with forgetting over those points:\n\n" + correlation_table(docs))

