"""The real-model run's reproduction figures, each with its 95% interval, as one JSON-ready dict.

Read back from the run: the probe's ``tensor_stats`` for PULSE's S₁ and Mukherjee et al.'s update
sparsity, ``delta_sync_bytes`` for the delta-sync share, the ``samples`` log-prob gaps, the per-layer
update shares, and the per-problem held-out results (``heldout_eval.json``) for accuracies, the forward
KL to the bases and the AlphaRL / RELEX recovery ratios. ``demo.reproduction`` prints them as a table,
``benchmarks/smollm2_long.py`` writes them to ``benchmarks/results/smollm2_long.json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from dynascope.demo.intervals import Interval, mean_interval, median_interval, paired_interval
from dynascope.demo.smollm2_eval import load_heldout
from dynascope.store import StoreConnection, open_store, quote_literal

__all__ = ["reproduction_figures"]


def _iv(x: Interval) -> dict[str, float | None]:
    return x.as_dict()


def _columns(con: StoreConnection) -> set[str]:
    return {r[0] for r in con.rows("SELECT column_name FROM (DESCRIBE tensor_stats)")}


def _per_step(con: StoreConnection, count: str, stage: str) -> list[tuple[int, float]]:
    """(step, Σ count / Σ numel) over the whole tensors, for the steps where every tensor has it."""
    df = con.frame(f"""
        SELECT step, sum({count}) / sum(numel) AS frac FROM tensor_stats_global
        WHERE stage = {quote_literal(stage)} GROUP BY step
        HAVING count({count}) = count(*) ORDER BY step""")
    return [(int(a), float(b)) for a, b in df.iter_rows()]


def _pulse(con: StoreConnection, cols: set[str]) -> dict[str, Any]:
    rl = _per_step(con, "bf16_unchanged_count", "rl") if "bf16_unchanged_count" in cols else []
    if not rl:
        return {"value": None, "note": "no RL step with S₁ on every tensor"}
    later = [f for _, f in rl[1:]] or [rl[0][1]]  # Adam's first step moves every weight by ≈η: not the steady state
    return {**_iv(median_interval(later)), "steps": len(later), "min": min(later), "max": max(later),
            "first_step": rl[0][1]}


def _mukherjee(con: StoreConnection, cols: set[str], stage: str) -> dict[str, Any]:
    rows = _per_step(con, "drift_unchanged_count", stage) if "drift_unchanged_count" in cols else []
    if not rows:
        return {"value": None, "note": f"no {stage} step with drift on every tensor"}
    zeros = dict(_per_step(con, "drift_zero_count", stage)) if "drift_zero_count" in cols else {}
    step, frac = rows[-1]
    # One count over every weight at one step: no sampling unit to resample, hence no interval.
    return {"value": frac, "ci_low": None, "ci_high": None, "steps": len(rows), "zero_share": zeros.get(step)}


def _delta_sync(con: StoreConnection) -> dict[str, Any]:
    from dynascope.analyses.delta_sync import delta_sync_bytes

    try:
        df = delta_sync_bytes(con, stage="rl")
    except Exception as exc:  # e.g. no S₁ columns: a row that says so, not a crash
        return {"value": None, "note": f"unavailable ({exc})"}
    df = df.filter(pl.col("step") > pl.col("step").min())  # as delta_sync_summary: the first RL step left out
    if df.is_empty():
        return {"value": None, "note": "no RL step after the first"}
    pct = df["delta_pct"].to_list()
    return {**_iv(median_interval([p / 100 for p in pct])), "steps": len(pct),
            "encoding": df["encoding"].mode().first(), "delta_sync_ms": df["delta_sync_ms"].median(),
            "full_bf16_sync_ms": df["full_bf16_sync_ms"].median()}


def _logprob_gap(con: StoreConnection) -> dict[str, Any]:
    from dynascope.analyses.rollouts import logprob_gap_by_step

    df = logprob_gap_by_step(con)
    if df.is_empty():
        return {"value": None, "note": "no samples with log-prob gaps"}
    return {"mean_nats": _iv(median_interval(df["logprob_gap_mean_nats"].to_list())),
            "max_nats": float(df["logprob_gap_max_nats"].max()),
            "over_share": _iv(median_interval((df["logprob_gap_over_pct"] / 100).to_list())),
            "threshold_nats": float(df["threshold_nats"][0]), "steps": df.height,
            "tokens": int(df["tokens_count"].sum())}


def _gap_floor(con: StoreConnection) -> dict[str, Any]:
    """The trainer-vs-trainer gap (the trainer's own floor) and the rollout gap's excess over it, per step:
    medians over the RL steps with intervals that resample steps, as the rollout gap's."""
    from dynascope.analyses.gap_floor import logprob_gap_floor_by_step

    df = logprob_gap_floor_by_step(con)
    if df.is_empty():
        return {"value": None, "note": "no trainer-vs-trainer recomputation recorded"}

    def med(col: str, scale: float = 1.0) -> dict[str, float | None]:
        return _iv(median_interval((df[col].drop_nulls() * scale).to_list()))

    # the share of each step's rollout gap (mean |Δ|) that lies above the trainer's own floor
    above = (df["excess_gap_mean_nats"] / df["rollout_gap_mean_nats"]).drop_nulls().drop_nans()
    return {"self_mean_nats": med("self_gap_mean_nats"), "self_max_nats": df["self_gap_max_nats"].max(),
            "self_over_share": med("self_gap_over_pct", 0.01), "self_ratio_outside_share": med("self_ratio_outside_pct", 0.01),
            "rollout_mean_nats": med("rollout_gap_mean_nats"), "rollout_over_share": med("rollout_gap_over_pct", 0.01),
            "rollout_ratio_outside_share": med("rollout_ratio_outside_pct", 0.01),
            "excess_mean_nats": med("excess_gap_mean_nats"), "excess_over_share": med("excess_over_pct", 0.01),
            "excess_ratio_outside_share": med("excess_ratio_outside_pct", 0.01),
            "rollout_gap_above_floor_share": _iv(median_interval(above.to_list())),
            "steps": df.height, "tokens": int(df["self_tokens_count"].sum())}


def _forgetting_points(con: StoreConnection, sft_steps: int | None) -> list[dict[str, Any]]:
    """Per RL evaluation point: forgetting (prose log-loss − the SFT point's), KL(π_SFT‖π) and the weight
    measures (``analyses.forgetting_by_point``), with the RL step it follows."""
    from dynascope.analyses.forgetting import forgetting_by_point

    rows = forgetting_by_point(con, stage="rl", base="sft").drop("run_id").to_dicts()
    for r in rows:  # a point is logged at the step of the last update it scores (RL step k: step sft_steps + k − 1)
        r["rl_step"] = r["step"] - sft_steps + 1 if sft_steps is not None else None
    return rows


def _weights_moved(con: StoreConnection) -> dict[str, Any]:
    """What the weights did over the RL stage, at its last step: ‖W_T − θ₀‖/‖W_T‖, the share of weights whose
    bf16 cast moved, and Mukherjee's changed share (1 − update sparsity)."""
    df = con.frame("""
        WITH last AS (SELECT max(step) AS step FROM tensor_stats_global WHERE stage = 'rl'
                      AND drift_norm IS NOT NULL AND w_norm IS NOT NULL)
        SELECT any_value(step) AS step, sqrt(sum(drift_norm * drift_norm)) / sqrt(sum(w_norm * w_norm)) AS drift_ratio,
               sum(numel - drift_zero_count) / sum(numel) AS drift_bf16_changed_share,
               1 - sum(drift_unchanged_count) / sum(numel) AS mukherjee_changed_share
        FROM tensor_stats_global WHERE stage = 'rl' AND step = (SELECT step FROM last)""")
    return df.row(0, named=True) if df.height and df["step"][0] is not None else {}


def _layers(con: StoreConnection) -> list[dict[str, Any]]:
    from dynascope.analyses.dynamics_layers import update_share_by_layer

    df = update_share_by_layer(con, stage="rl")
    return df.select("layer", "numel_pct", "drift_energy_pct", "drift_bf16_changed_pct", "update_energy_pct",
                     "update_bf16_changed_pct").to_dicts()


def _heldout(run_dir: Path) -> dict[str, Any]:
    """Accuracies, forward KLs and recovery ratios from the per-problem results, paired by problem."""
    doc = load_heldout(run_dir)
    if doc is None:
        return {}
    pts = {p["label"]: p for p in doc["points"]}
    acc = {label: _iv(mean_interval(p["correct"])) for label, p in pts.items()}
    kl = {label: {base: _iv(mean_interval(v)) for base, v in p["forward_kl_nats"].items()} for label, p in pts.items()}
    out: dict[str, Any] = {"held_out_n": len(doc["problems"]), "accuracy": acc, "forward_kl_nats": kl,
                           "rl_steps_evaluated": sorted(p["rl_step"] for p in pts.values() if p.get("rl_step"))}

    def recovery(label: str) -> dict[str, float | None] | None:
        if not {"sft", "rl", label} <= set(pts):
            return None
        return _iv(paired_interval(lambda base, rl, new: (new - base) / (rl - base) if rl != base else math.nan,
                                   pts["sft"]["correct"], pts["rl"]["correct"], pts[label]["correct"]))

    def gap(label: str) -> dict[str, float | None] | None:  # accuracy − the final policy's, paired
        if not {"rl", label} <= set(pts):
            return None
        return _iv(paired_interval(lambda rl, new: new - rl, pts["rl"]["correct"], pts[label]["correct"]))

    rewritten = [label for label in pts if label.startswith(("alpharl_", "relex"))]
    out["recovery"] = {label: recovery(label) for label in rewritten}
    out["minus_final"] = {label: gap(label) for label in rewritten}
    prose = {label: p["prose_nll_nats"] for label, p in pts.items() if p.get("prose_nll_nats")}
    out["prose_nll_nats"] = {label: _iv(mean_interval(v)) for label, v in prose.items()}
    # forgetting: the prose log-loss's rise from a base, paired window by window
    order = list(prose)  # evaluation order: a base's forgetting is of the points after it
    out["forgetting_nats"] = {base: {label: _iv(paired_interval(lambda b, x: x - b, prose[base], prose[label]))
                                     for label in order[order.index(base) + 1:]}
                              for base in ("pretrained", "sft") if base in prose}
    if {"sft", "rl"} <= set(pts):
        out["rl_gain"] = _iv(paired_interval(lambda a, b: b - a, pts["sft"]["correct"], pts["rl"]["correct"]))
    return out


def _scalars(con: StoreConnection, prefix: str) -> dict[str, float]:
    df = con.frame(f"SELECT key, arg_max(value, time_us) AS v FROM scalars WHERE key LIKE {quote_literal(prefix + '%')} "
                    "GROUP BY key")
    return {k.removeprefix(prefix): float(v) for k, v in df.iter_rows()}


def _settings(con: StoreConnection) -> dict[str, Any]:
    """The demo's settings, as ``watch(config=...)`` stored them in the ``runs`` table."""
    for (cfg,) in con.rows("SELECT config_json FROM runs WHERE config_json IS NOT NULL ORDER BY start_us"):
        settings = json.loads(cfg).get("settings")
        if settings:
            return json.loads(settings) if isinstance(settings, str) else settings
    return {}


def reproduction_figures(run_dir: str | Path) -> dict[str, Any]:
    """Every figure of the reproduction table for the finished run at ``run_dir``, with its interval."""
    run_dir = Path(run_dir)
    with open_store(run_dir) as con:
        settings = _settings(con)
        cols = _columns(con)
        rl_steps = con.frame("SELECT count(DISTINCT step) AS n FROM timings WHERE phase = 'rollout'")["n"][0]
        doc: dict[str, Any] = {
            "rl_steps": int(rl_steps),
            "regime": {k: settings.get(k) for k in ("sft_steps", "sft_batch", "sft_lr", "rl_steps", "prompts", "group",
                                                      "rl_lr", "temperature", "dtype", "rollout_dtype", "seed",
                                                      "device", "eval_n", "eval_every", "stats_every",
                                                      "spectral_every", "relex_fracs", "relex_every")},
            "pulse_s1": _pulse(con, cols),
            "mukherjee_rl": _mukherjee(con, cols, "rl"),
            "mukherjee_sft": _mukherjee(con, cols, "sft"),
            "delta_sync": _delta_sync(con),
            "logprob_gap": _logprob_gap(con),
            "gap_floor": _gap_floor(con),
            "forgetting_points": _forgetting_points(con, settings.get("sft_steps")),
            "weights_moved": _weights_moved(con),
            "layers": _layers(con),
            "relex_fit": _scalars(con, "relex/"),
        }
    doc.update(_heldout(run_dir))
    doc["held_out_n"] = doc.get("held_out_n", 0)
    return _plain(doc)


def _plain(x: Any) -> Any:
    """Plain JSON types only: numpy scalars as Python numbers, NaN and ±Inf as null."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
