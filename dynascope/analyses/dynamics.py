"""Parameter-update dynamics: how sparse the updates are, and how rank-1 the cumulative update is.

Definitions:

- *Sparsity* is the share of parameters a step left bit-identical (``changed_frac`` counts those that
  moved) or, against θ₀, the share that differ from the reference weights (``drift_changed_frac``).
  Fractions are numel-weighted sums (Σcount / Σnumel) over ``tensor_stats_global``'s whole tensors, so
  a large matrix weighs more than a bias, and a replicated tensor counts once.
  The ``rel`` variants (``changed_rel_frac``, ``drift_changed_rel_frac``: "changed by > 0.1% of |W|
  (relative)") count a change only when |ŵ − w| > η·max(|w|, |ŵ|), η = 1e-3. Neither is the bf16-cast
  comparison: that is PULSE's ``bf16_unchanged_frac`` (changed in bf16 = 1 − it), see ``delta_sync``.
- *Rank-1 dominance* is σ₁² / ‖ΔW‖²_F of the cumulative update ΔW = W_t − W_0 (``spectra`` rows).
  Per layer and overall it is energy-weighted: Σσ₁² / Σ‖ΔW‖²_F, so it is the rank-1 energy of the
  layer's updates taken together (blockwise); the unweighted mean is given beside it.
"""

from __future__ import annotations

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.store import StoreError, quote_literal
from dynascope.store.pooling import GLOBAL

__all__ = ["rank1_dominance", "sparsity_comparison", "sparsity_over_training"]  # + dynamics_rank1.rank1_linear_fit

_GROUPS = {"kind": "kind", "layer": "layer", "tensor": "tensor", "all": "'all'"}


def sparsity_over_training(store: StoreLike, run: str | None = None, by: str = "kind",
                           against: str = "step") -> pl.DataFrame:
    """Changed fraction of parameters per step and group (``by``: kind, layer, tensor or all).

    ``against="step"`` compares each step with the previous one (``changed_frac``,
    ``changed_rel_frac``, ``sign_flip_frac``); ``against="reference"`` compares with θ₀
    (``drift_changed_frac``, ``drift_changed_rel_frac``). Columns: run_id, step, stage, <by>, tensors,
    numel and the fractions (0–1); ``unchanged_frac`` is 1 − the bit-exact changed fraction.
    """
    if by not in _GROUPS:
        raise ValueError(f"by must be one of {', '.join(_GROUPS)}, not {by!r}")
    if against == "step":
        counts = {"changed_frac": "changed_count", "changed_rel_frac": "changed_rel_count",
                  "sign_flip_frac": "sign_flip_count"}
    elif against == "reference":
        counts = {"drift_changed_frac": "drift_changed_count", "drift_changed_rel_frac": "drift_changed_rel_count"}
    else:
        raise ValueError(f"against must be 'step' or 'reference', not {against!r}")
    first = next(iter(counts.values()))
    fracs = ", ".join(f"SUM({c})::DOUBLE / SUM(numel) AS {name}" for name, c in counts.items())
    con = as_store(store)
    return frame(con, f"""
        SELECT run_id, step, any_value(stage) AS stage, {_GROUPS[by]} AS "{by}",
               COUNT(DISTINCT tensor) AS tensors, SUM(numel) AS numel, {fracs},
               1 - SUM({first})::DOUBLE / SUM(numel) AS unchanged_frac
        FROM {GLOBAL}
        WHERE {first} IS NOT NULL AND numel > 0{run_clause(run)}
        GROUP BY run_id, step, {_GROUPS[by]}
        ORDER BY 1, 2, 4 NULLS LAST""")


def _side_clause(con, side: str) -> str:
    """SQL filter for one side of a comparison: a run id, else a stage name."""
    runs = {r for (r,) in con.rows("SELECT DISTINCT run_id FROM tensor_stats")}
    if side in runs:
        return f"run_id = {quote_literal(side)}"
    stages = {s for (s,) in con.rows("SELECT DISTINCT stage FROM tensor_stats WHERE stage IS NOT NULL")}
    if side in stages:
        return f"stage = {quote_literal(side)}"
    raise StoreError(f"{side!r} is neither a run id nor a stage in this store "
                     f"(runs: {', '.join(sorted(runs)) or 'none'}; stages: {', '.join(sorted(stages)) or 'none'})")


def _side_sql(where: str, group: str) -> str:
    # Per group: drift at each tensor's last record of the side (the parameters the whole side left
    # untouched, relative to its θ₀) and the mean per-step unchanged share over the side's steps.
    return f"""
        WITH rows AS (SELECT *, {group} AS grp FROM {GLOBAL} WHERE {where} AND numel > 0),
        last AS (SELECT run_id, tensor, max(step) AS step FROM rows
                 WHERE drift_changed_count IS NOT NULL GROUP BY run_id, tensor),
        drift AS (SELECT r.grp, SUM(r.numel)::BIGINT AS numel,
                         1 - SUM(r.drift_changed_count)::DOUBLE / SUM(r.numel) AS unchanged_frac,
                         1 - SUM(r.drift_changed_rel_count)::DOUBLE / SUM(r.numel) AS unchanged_rel_frac
                  FROM rows r JOIN last l USING (run_id, tensor, step) GROUP BY r.grp),
        steps AS (SELECT grp, COUNT(DISTINCT step) AS steps,
                         1 - SUM(changed_count)::DOUBLE / SUM(numel) AS step_unchanged_frac
                  FROM rows WHERE changed_count IS NOT NULL GROUP BY grp)
        SELECT coalesce(d.grp, s.grp) AS kind, d.numel, d.unchanged_frac, d.unchanged_rel_frac,
               s.step_unchanged_frac, s.steps
        FROM drift d FULL OUTER JOIN steps s ON d.grp = s.grp"""


def sparsity_comparison(store: StoreLike, a: str, b: str) -> pl.DataFrame:
    """Unchanged share of parameters per module kind in ``a`` versus ``b`` (run ids or stage names).

    ``unchanged_frac_*`` is 1 − drift_changed_frac at each tensor's last record of the side (against
    the side's θ₀: compare runs diffed against their own starting checkpoint, or a run whose probe
    reference was reset at the stage start), ``unchanged_rel_frac_*`` the same for the relative measure
    (1 − drift_changed_rel_frac); ``numel_*`` is an integer; ``step_unchanged_frac_*`` is the numel-weighted share of
    parameters a single step left unchanged, over the side's steps. A name that is both a run id and
    a stage means the run. The last row, kind ``all``, covers every kind.
    """
    con = as_store(store)
    sides = []
    for side in (a, b):
        where = _side_clause(con, side)
        sides.append(pl.concat([frame(con, _side_sql(where, "kind")), frame(con, _side_sql(where, "'all'"))],
                               how="vertical_relaxed"))
    value_cols = [c for c in sides[0].columns if c != "kind"]
    left = sides[0].rename({c: f"{c}_a" for c in value_cols})
    right = sides[1].rename({c: f"{c}_b" for c in value_cols})
    joined = left.join(right, on="kind", how="full", coalesce=True)
    return (joined.with_columns(pl.lit(a).alias("a"), pl.lit(b).alias("b"), (pl.col("kind") == "all").alias("_all"))
            .sort(["_all", "kind"]).drop("_all"))


def rank1_dominance(store: StoreLike, run: str | None = None) -> pl.DataFrame:
    """Rank-1 energy of the cumulative update per step, per layer (``level='layer'``) and overall.

    Columns: run_id, step, stage, level, layer, tensors, rank1_energy (Σσ₁²/Σ‖ΔW‖²_F),
    topk_energy, mean_rank1_energy, mean_stable_rank, mean_effective_rank. Only records where ΔW ≠ 0;
    with a time budget a step covers the tensors reached (``tensors`` says how many).
    """
    con = as_store(store)
    base = f"""
        SELECT * FROM spectra WHERE drift_norm > 0 AND rank1_energy IS NOT NULL AND step IS NOT NULL{run_clause(run)}
        QUALIFY row_number() OVER (PARTITION BY run_id, step, tensor ORDER BY rank) = 1"""
    agg = """COUNT(*) AS tensors,
             SUM(sigma[1] * sigma[1]) / SUM(drift_norm * drift_norm) AS rank1_energy,
             SUM(list_sum(list_transform(sigma, lambda x: x * x))) / SUM(drift_norm * drift_norm) AS topk_energy,
             AVG(rank1_energy) AS mean_rank1_energy, AVG(stable_rank) AS mean_stable_rank,
             AVG(effective_rank) AS mean_effective_rank"""
    return frame(con, f"""
        WITH s AS ({base})
        SELECT run_id, step, any_value(stage) AS stage, 'layer' AS level, layer, {agg}
        FROM s GROUP BY run_id, step, layer
        UNION ALL
        SELECT run_id, step, any_value(stage) AS stage, 'overall' AS level, NULL::INTEGER AS layer, {agg}
        FROM s GROUP BY run_id, step
        ORDER BY run_id, step, level DESC, layer NULLS LAST""")
