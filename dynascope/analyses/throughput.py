"""Throughput and model FLOPs utilization (MFU) per phase and rank.

FLOPs follow verl's estimator (verl/utils/flops_counter.py, ``_estimate_qwen2_flops``): a training step
over sequences of lengths s_i costs

    6 · N · Σ s_i   +   6 · L · h · Σ s_i²

where N is the dense parameter count, L the number of layers and h the attention width (heads × head_dim,
the hidden size for standard attention); the second term is causal self-attention (QKᵀ and AV, forward and
backward). A phase gets the share of that it performs: forward-only phases (forward, rollout generation,
ref/old log-probs) 2/6, backward 4/6, a whole train phase or step 6/6; ``phase_factors`` overrides them.

Tokens per step come from ``samples`` (prompt_len + response_len per sample, which also gives Σ s²) or
else from the ``scalars`` key ``tokens`` (each rank's own count, summed over ranks; no attention term
then). A step's tokens are split evenly over the ranks that ran the phase (data parallelism).
N, L and h come from the arguments, else from the run's config (``n_params``/``num_parameters``,
``num_hidden_layers``, ``hidden_size`` anywhere in it), else N from ``tensor_stats`` numel.
"""

from __future__ import annotations

import json
import re
from typing import Any

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.store import quote_literal
from dynascope.store.pooling import GLOBAL

__all__ = ["PEAK_TFLOPS", "peak_tflops_for", "throughput_mfu"]

# Dense (no sparsity) BF16 tensor-core peak in TFLOP/s, from the vendors' datasheets. V100 has no BF16:
# its FP16 tensor-core peak is given. Override with ``peak_tflops=`` for other parts or clocks.
PEAK_TFLOPS: dict[str, float] = {
    "B200": 2250.0, "H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0,
    "A10": 125.0, "V100": 125.0, "MI300X": 1307.4,
}
PHASE_FACTORS: dict[str, float] = {
    "step": 6, "train": 6, "forward": 2, "backward": 4, "rollout": 2, "generate": 2, "generation": 2,
    "ref_logprob": 2, "old_logprob": 2,
}
_KEYS = {"n_params": ("n_params", "num_parameters", "n_parameters", "num_params"),
         "n_layers": ("num_hidden_layers", "n_layers", "n_layer", "num_layers"),
         "hidden": ("hidden_size", "n_embd", "d_model")}

_SCHEMA = {"run_id": pl.String, "role": pl.String, "rank": pl.Int32, "phase": pl.String, "steps": pl.UInt32,
           "tokens": pl.Float64, "time_s": pl.Float64, "tokens_per_s": pl.Float64, "achieved_tflops": pl.Float64,
           "peak_tflops": pl.Float64, "mfu_pct": pl.Float64, "attention_included": pl.Boolean}


def peak_tflops_for(device: str) -> float | None:
    """Dense BF16 peak TFLOP/s for a device name such as ``"NVIDIA H100 80GB HBM3"`` (None if unknown)."""
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "A100" before "A10", "H100 PCIe" before "H100"
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![0-9])", device, re.IGNORECASE):
            return PEAK_TFLOPS[key]
    return None


def _find(obj: Any, names: tuple[str, ...]) -> Any:
    if isinstance(obj, dict):
        for n in names:
            if isinstance(obj.get(n), (int, float)):
                return obj[n]
        for v in obj.values():
            hit = _find(v, names)
            if hit is not None:
                return hit
    return None


def _model(con, run: str | None) -> dict[str, dict[str, Any]]:
    """Per run: n_params, n_layers, hidden and device strings from the config, tensor_stats and devices."""
    out: dict[str, dict[str, Any]] = {}
    for run_id, cfg in frame(con, f"SELECT run_id, config_json FROM runs WHERE config_json IS NOT NULL"
                                  f"{run_clause(run)}").iter_rows():
        try:
            c = json.loads(cfg)
        except ValueError:
            continue
        d = out.setdefault(run_id, {})
        for k, names in _KEYS.items():
            d.setdefault(k, _find(c, names))
        dev = _find(c, ("device_name", "gpu_name", "gpu"))
        d.setdefault("devices", []).extend([dev] if isinstance(dev, str) else [])
    numel = frame(con, f"""
        WITH f AS (SELECT run_id, MIN(step) AS s FROM {GLOBAL} WHERE true{run_clause(run)} GROUP BY run_id)
        SELECT g.run_id, SUM(g.numel)::DOUBLE AS n FROM {GLOBAL} g JOIN f ON g.run_id = f.run_id AND g.step = f.s
        GROUP BY g.run_id""")
    for run_id, n in numel.iter_rows():
        d = out.setdefault(run_id, {})
        if d.get("n_params") is None:
            d["n_params"] = n
    devs = frame(con, f"""
        SELECT DISTINCT run_id, device FROM (
            SELECT run_id, device FROM system WHERE device IS NOT NULL{run_clause(run)}
            UNION ALL SELECT run_id, device FROM timings WHERE device IS NOT NULL{run_clause(run)}) LIMIT 1000""")
    for run_id, dev in devs.iter_rows():
        out.setdefault(run_id, {}).setdefault("devices", []).append(dev)
    return out


def _peak_for(devices: list[str]) -> float:
    """The first known peak TFLOP/s among the run's device names; ValueError naming them when none is."""
    peak = next((p for p in map(peak_tflops_for, devices) if p), None)
    if peak is None:
        seen = ", ".join(sorted(set(devices))) or "none recorded"
        raise ValueError(f"peak FLOP/s unknown for device ({seen}); pass peak_tflops= "
                         f"(dynascope report --peak-tflops)")
    return peak


def throughput_mfu(store: StoreLike, run: str | None = None, *, n_params: float | None = None,
                   n_layers: int | None = None, hidden: int | None = None, peak_tflops: float | None = None,
                   device: str | None = None, phase_factors: dict[str, float] | None = None) -> pl.DataFrame:
    """Tokens/s, achieved TFLOP/s and MFU per (run, role, rank, phase), over all steps.

    ``peak_tflops`` (per device) overrides the peak looked up from ``device`` or the devices the run
    recorded; a run on CPU or an unknown device needs it (ValueError otherwise). Columns: run_id, role,
    rank, phase, steps, tokens, time_s, tokens_per_s, achieved_tflops, peak_tflops, mfu_pct,
    attention_included. Raises ValueError when the model size cannot be found.
    """
    if peak_tflops is not None and not peak_tflops > 0:
        raise ValueError(f"peak_tflops must be > 0, not {peak_tflops}")
    con = as_store(store)
    model = _model(con, run)
    if peak_tflops is None and run is not None:
        # Fail before the heavy aggregate when no peak can be found: the dashboard asks at every first render.
        _peak_for([device] if device else model.get(run, {}).get("devices", []))
    factors = dict(PHASE_FACTORS if phase_factors is None else phase_factors)
    names = ", ".join(quote_literal(p) for p in factors) or "''"
    rc = run_clause(run)
    agg = frame(con, f"""
        WITH tok AS (
            SELECT run_id, step, SUM(coalesce(prompt_len, 0) + coalesce(response_len, 0))::DOUBLE AS tokens,
                   SUM(pow(coalesce(prompt_len, 0) + coalesce(response_len, 0), 2)) AS sq
            FROM samples WHERE step IS NOT NULL{rc} GROUP BY run_id, step),
        stok AS (
            SELECT run_id, step, SUM(value) AS tokens FROM scalars
            WHERE key = 'tokens' AND step IS NOT NULL AND isfinite(value){rc} GROUP BY run_id, step),
        t AS (SELECT run_id, step, coalesce(tok.tokens, stok.tokens) AS tokens, tok.sq
              FROM tok FULL JOIN stok USING (run_id, step)),
        ph AS (
            SELECT run_id, coalesce(role, '') AS role, rank, step,
                   CASE WHEN category = 'step' THEN 'step' ELSE phase END AS phase, SUM(dur_us) AS dur_us
            FROM timings
            WHERE step IS NOT NULL AND stream IS NULL AND phase IN ({names})
              AND coalesce(category, 'phase') IN ('phase', 'step'){rc}
            GROUP BY ALL),
        n AS (SELECT *, COUNT(*) OVER (PARTITION BY run_id, role, step, phase) AS nr FROM ph)
        SELECT n.run_id, n.role, n.rank, n.phase, COUNT(*) AS steps, SUM(t.tokens / n.nr) AS tokens,
               SUM(t.sq / n.nr) AS sq, bool_and(t.sq IS NOT NULL) AS has_sq, SUM(n.dur_us) / 1e6 AS time_s
        FROM n JOIN t USING (run_id, step) WHERE t.tokens > 0
        GROUP BY n.run_id, n.role, n.rank, n.phase ORDER BY n.run_id, n.role, n.rank, n.phase""")
    if agg.is_empty():
        return pl.DataFrame(schema=_SCHEMA)
    rows = []
    for r in agg.iter_rows(named=True):
        m = model.get(r["run_id"], {})
        n = n_params if n_params is not None else m.get("n_params")
        if not n:
            raise ValueError(f"run {r['run_id']}: model size unknown; pass n_params=")
        layers = n_layers if n_layers is not None else m.get("n_layers")
        width = hidden if hidden is not None else m.get("hidden")
        peak = peak_tflops if peak_tflops is not None else \
            _peak_for([device] if device else m.get("devices", []))
        attn = bool(layers and width and r["has_sq"])
        flops = factors[r["phase"]] / 6 * (6 * n * r["tokens"] + (6 * layers * width * r["sq"] if attn else 0))
        achieved = flops / r["time_s"] / 1e12 if r["time_s"] else None
        rows.append({**{k: r[k] for k in ("run_id", "role", "rank", "phase", "steps", "tokens", "time_s")},
                     "tokens_per_s": r["tokens"] / r["time_s"] if r["time_s"] else None,
                     "achieved_tflops": achieved, "peak_tflops": float(peak),
                     "mfu_pct": None if achieved is None else 100 * achieved / peak, "attention_included": attn})
    return pl.DataFrame(rows, schema=_SCHEMA)
