"""Training-instability events: loss and grad-norm spikes, entropy collapse, NaN/Inf.

- *Spikes*: for each (rank, key) series of the scalars ``grad_norm`` and ``loss`` (also ``…/grad_norm``,
  ``….loss``), a value is a spike when its robust z-score against the trailing ``window`` values,
  ``(x − median) / (1.4826 · MAD)``, exceeds ``z_threshold``. Only upward moves count (a falling loss is
  not instability); at least ``min_history`` earlier values are needed. The scale is floored at 1% of
  |median| so a perfectly flat history does not turn a rounding wiggle into an infinite z.
  That floor vanishes when the series sits at or near 0 (a GRPO loss is exactly 0 at every step whose
  groups all had zero reward variance, small blips otherwise): the window's MAD is then 0 or tiny and
  any blip scores a huge z. So a spike must also stand out series-wide: its rise above the trailing
  median, less the series' median rise, must exceed ``min_rise`` × the series' typical deviation (the
  median absolute deviation of all rises from that median rise, exact ties left out so flat or
  zero-filled stretches cannot shrink it to nothing). A floor relative to the series' level (|x|) would
  not do: one high enough to hide blips around 0 would hide a 2.0 → 2.5 spike on an ordinary loss.
  With fewer than ``min_history`` untied deviations (a flat series with a jump or two) there is no floor.
  A loss that takes both signs (a GRPO or PPO surrogate: −advantage × ratio averaged over tokens, plus a
  KL term) has no floor to rise from, and its size follows the batch's advantages, not the training's
  health: a step's value 100× its trailing median is ordinary there. So on such a series, a spike must
  also exceed ``range_factor`` × the largest magnitude the role's zero-crossing series of that key reaches
  at any other step on any rank: bursts that recur are the surrogate's noise, a divergence leaves every
  other step far behind. (Over a live run, "other steps" are the steps recorded so far.)
  Without a grad_norm scalar, the global gradient norm is rebuilt from ``tensor_stats_global`` (√Σ
  grad_norm² over the whole tensors, one series per run and role: shards pooled, replicas once).
- *Entropy collapse*: the first step where the scalar ``entropy`` falls below ``collapse_frac`` × its
  initial level (median of the first ``min_history`` values); one event per series.
- *NaN/Inf*: any non-finite scalar, or tensor_stats rows with grad_nan_count/grad_inf_count/w_nan_count/w_inf_count > 0.

The result is a frame only; ``dynascope.store.events.write_detected_events`` appends it to a run's
``events`` table (``dynascope report --write-events``).
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.store.pooling import GLOBAL

__all__ = ["detect_instability"]

DETECTOR = "dynascope.instability"
_SCHEMA = {"run_id": pl.String, "role": pl.String, "rank": pl.Int32, "step": pl.Int64, "event": pl.String,
           "severity": pl.String, "source": pl.String, "value": pl.Float64, "baseline": pl.Float64,
           "robust_z": pl.Float64, "message": pl.String}
_SPIKE_RE = r"(^|[/.])(grad_norm|loss)$"
_ENTROPY_RE = r"(^|[/.])entropy$"


def _spikes(x: np.ndarray, window: int, z_threshold: float, min_history: int,
            min_rise: float = 6.0) -> list[tuple[int, float, float]]:
    """Indices of upward spikes with (index, baseline median, robust z); see the module docstring."""
    tested = []  # (index, trailing median, robust z) for every value with enough history
    for i in range(min_history, len(x)):
        if not math.isfinite(x[i]):
            continue
        hist = x[max(0, i - window):i]
        hist = hist[np.isfinite(hist)]
        if len(hist) < min_history:
            continue
        med = float(np.median(hist))
        scale = max(1.4826 * float(np.median(np.abs(hist - med))), 0.01 * abs(med), 1e-12)
        tested.append((i, med, float((x[i] - med) / scale)))
    if not any(z > z_threshold for _, _, z in tested):
        return []
    rise = np.array([x[i] - med for i, med, _ in tested])
    centre = float(np.median(rise))
    dev = np.abs(rise - centre)
    dev = dev[dev > 0]  # ties: flat or zero-filled stretches say nothing about the series' usual blips
    floor = min_rise * float(np.median(dev)) if len(dev) >= min_history else 0.0
    return [(i, med, z) for (i, med, z), r in zip(tested, rise, strict=True)
            if z > z_threshold and r - centre > floor]


def _crosses_zero(v: np.ndarray) -> bool:
    fin = v[np.isfinite(v)]
    return bool(len(fin)) and fin.min() < 0 < fin.max()


def _other_range(series: pl.DataFrame) -> dict[tuple, dict[int, float]]:
    """Per (run, role, key): step → the largest |value| at any other step, on any rank of the role whose
    series of that key takes both signs (a zero-crossing surrogate loss's range without that step)."""
    crossing = [g for _, g in series.group_by(["run_id", "role", "rank", "key"], maintain_order=True)
                if _crosses_zero(g["value"].to_numpy().astype(float))]
    out: dict[tuple, dict[int, float]] = {}
    if not crossing:
        return out
    for (run_id, role, key), g in pl.concat(crossing).group_by(["run_id", "role", "key"], maintain_order=True):
        per_step = g.filter(pl.col("value").is_finite()).group_by("step").agg(pl.col("value").abs().max())
        steps, peak = per_step["step"].to_list(), per_step["value"].to_numpy()
        order = np.argsort(peak)[::-1]
        top, second = float(peak[order[0]]), float(peak[order[1]]) if len(peak) > 1 else 0.0
        out[(run_id, role, key)] = {s: (second if i == order[0] else top) for i, s in enumerate(steps)}
    return out


def _series_events(con, run: str | None, window: int, z_threshold: float, min_history: int,
                   collapse_frac: float, min_rise: float, range_factor: float = 2.0) -> list[dict]:
    rc = run_clause(run)
    series = frame(con, f"""
        SELECT run_id, coalesce(role, '') AS role, rank, key, step, AVG(value) AS value FROM scalars
        WHERE step IS NOT NULL AND (regexp_matches(key, '{_SPIKE_RE}') OR regexp_matches(key, '{_ENTROPY_RE}')){rc}
        GROUP BY ALL
        UNION ALL
        SELECT run_id, coalesce(role, '') AS role, CAST(NULL AS INTEGER) AS rank, 'grad_norm(tensor_stats)', step,
               sqrt(SUM(grad_norm * grad_norm))
        FROM {GLOBAL}
        WHERE grad_norm IS NOT NULL{rc} AND run_id NOT IN (
            SELECT run_id FROM scalars WHERE regexp_matches(key, '(^|[/.])grad_norm$'))
        GROUP BY ALL
        ORDER BY run_id, role, rank, key, step""")
    events = []
    ranges = _other_range(series.filter(pl.col("key").str.contains(r"(^|[/.])loss$")))
    for (run_id, role, rank, key), g in series.group_by(["run_id", "role", "rank", "key"], maintain_order=True):
        steps, x = g["step"].to_numpy(), g["value"].to_numpy().astype(float)
        name = key.rsplit("/", 1)[-1].rsplit(".", 1)[-1]
        base = {"run_id": run_id, "role": role, "rank": rank, "source": f"scalars:{key}"}
        if name == "entropy":
            fin = x[np.isfinite(x)]
            if len(fin) <= min_history:
                continue
            level = float(np.median(fin[:min_history]))
            below = np.flatnonzero(np.isfinite(x) & (x < collapse_frac * level))
            below = below[below >= min_history]
            if level > 0 and len(below):
                i = int(below[0])
                events.append({**base, "step": int(steps[i]), "event": "entropy_collapse", "severity": "warning",
                               "value": float(x[i]), "baseline": level, "robust_z": None,
                               "message": f"{key} fell to {x[i]:.4g}, {100 * x[i] / level:.1f}% of its initial "
                                          f"{level:.4g}"})
            continue
        event = "grad_norm_spike" if "grad_norm" in key else "loss_spike"
        if key == "grad_norm(tensor_stats)":
            base["source"] = "tensor_stats:grad_norm"
        prior = ranges.get((run_id, role, key)) if _crosses_zero(x) else None
        for i, med, z in _spikes(x, window, z_threshold, min_history, min_rise):
            if prior is not None and not x[i] > range_factor * prior.get(int(steps[i]), 0.0):
                continue  # a zero-crossing surrogate loss within the range it shows at other steps
            events.append({**base, "step": int(steps[i]), "event": event, "severity": "warning", "value": float(x[i]),
                           "baseline": med, "robust_z": z,
                           "message": f"{key} = {x[i]:.4g} at step {int(steps[i])}, {x[i] / med:.1f}× the trailing "
                                      f"median {med:.4g} (robust z {z:.1f})" if med else f"{key} spiked to {x[i]:.4g}"})
    return events


def _nan_events(con, run: str | None) -> list[dict]:
    rc = run_clause(run)
    df = frame(con, f"""
        SELECT run_id, coalesce(role, '') AS role, rank, step,
               'scalars:' || string_agg(DISTINCT key, ',' ORDER BY key) AS source, COUNT(*)::DOUBLE AS n
        FROM scalars WHERE step IS NOT NULL AND value IS NOT NULL AND NOT isfinite(value){rc}
        GROUP BY ALL
        UNION ALL
        SELECT run_id, coalesce(role, '') AS role, rank, step,
               'tensor_stats:' || string_agg(tensor, ',' ORDER BY tensor) AS source,
               SUM(coalesce(grad_nan_count, 0) + coalesce(grad_inf_count, 0) + coalesce(w_nan_count, 0) + coalesce(w_inf_count, 0))::DOUBLE
        FROM tensor_stats
        WHERE step IS NOT NULL AND coalesce(grad_nan_count, 0) + coalesce(grad_inf_count, 0) + coalesce(w_nan_count, 0)
              + coalesce(w_inf_count, 0) > 0{rc}
        GROUP BY ALL ORDER BY run_id, step, rank""")
    out = []
    for r in df.iter_rows(named=True):
        src = r["source"] if len(r["source"]) <= 200 else r["source"][:197] + "..."
        what = "non-finite values" if src.startswith("scalars") else "NaN/Inf elements"
        n = r.pop("n")
        out.append({**r, "source": src, "event": "nan_inf", "severity": "error", "value": n, "baseline": None,
                    "robust_z": None, "message": f"{int(n)} {what} at step {r['step']} in {src}"})
    return out


def detect_instability(store: StoreLike, run: str | None = None, *, window: int = 20, z_threshold: float = 6.0,
                       min_history: int = 5, collapse_frac: float = 0.1, min_rise: float = 6.0,
                       range_factor: float = 2.0) -> pl.DataFrame:
    """Instability events, one row each (see the module docstring for the rules).

    ``min_rise`` sets the series-wide floor for spikes, in multiples of the series' typical deviation
    from its trailing median (0 turns it off and leaves only the windowed robust z); ``range_factor`` the
    multiple of a zero-crossing loss's range at its other steps that a spike on it must exceed (0: off).

    Columns: run_id, role, rank, step, event (grad_norm_spike | loss_spike | entropy_collapse | nan_inf),
    severity, source, value, baseline, robust_z, message.
    """
    if min_rise < 0:
        raise ValueError("min_rise must be >= 0")
    con = as_store(store)
    rows = _series_events(con, run, window, z_threshold, min_history, collapse_frac, min_rise, range_factor)
    rows += _nan_events(con, run)
    return pl.DataFrame(rows, schema=_SCHEMA).sort(["run_id", "step", "rank", "event"])
