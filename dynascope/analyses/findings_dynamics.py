"""Findings on parameter dynamics: how rank-1 the update is, how much of the model one step changes, and
what a delta weight sync of the changed bf16 elements would send. ``findings`` ranks them with the rest."""

from __future__ import annotations

from typing import Any

import polars as pl

from dynascope.analyses import findings_sql as S
from dynascope.analyses._common import frame
from dynascope.analyses._findings import Finding, found, rnd
from dynascope.analyses.delta_sync import delta_sync_summary
from dynascope.analyses.dynamics import rank1_dominance, sparsity_comparison
from dynascope.store import StoreError, quote_literal

__all__ = ["delta_sync_numbers"]


def dynamics(con, run: str) -> list[Finding]:
    """The rank-1 energy of the cumulative update, and the update sparsity of the first two stages."""
    out = []
    df = rank1_dominance(con, run).filter(pl.col("level") == "overall")
    if not df.is_empty():
        last = df.sort("step").row(-1, named=True)
        out.append(found(run, "rank1_dominance", "info",
                          {"step": last["step"], "rank1_energy": rnd(last["rank1_energy"], 4), "tensors": last["tensors"]},
                          S.rank1_sql(run)))
    stages = frame(con, f"SELECT stage FROM tensor_stats WHERE run_id = {quote_literal(run)} AND stage IS NOT NULL "
                        f"GROUP BY stage ORDER BY MIN(step)")["stage"].to_list()
    if len(stages) >= 2:
        out.extend(_update_sparsity(con, run, stages[0], stages[1]))
    return out


def _bf16_changed(con, run: str) -> dict[str, dict[str, Any]]:
    """Per stage, ``delta_sync_summary``'s row (median 1 − S₁ over the stage's steps after its first);
    empty when the run records no S₁."""
    try:
        df = delta_sync_summary(con, run)
    except StoreError:  # no bf16_unchanged_count column: a run recorded without PULSE S₁
        return {}
    return {r["stage"]: r for r in df.iter_rows(named=True)}


def _update_sparsity(con, run: str, a: str, b: str) -> list[Finding]:
    """How much of the model one step changes, per stage, by the measure that matters for the run's regime.

    With weights stored in fp32 (master weights), Adam moves nearly every weight at every step, so the
    bit-exact share says little: what a bf16 forward pass or weight sync sees is whether the bf16 cast
    changed (1 − PULSE S₁), the headline whenever the run records S₁. Weights stored in bf16 make the two
    the same measure; without S₁ the bit-exact share is all there is.
    """
    df = sparsity_comparison(con, a, b).filter(pl.col("kind") == "all")
    if df.is_empty() or df["step_unchanged_frac_a"][0] is None:
        return []
    r = df.row(0, named=True)
    dtype = frame(con, f"SELECT mode(dtype) AS d FROM tensor_stats WHERE run_id = {quote_literal(run)}")["d"][0]
    bf16 = _bf16_changed(con, run)
    both = a in bf16 and b in bf16
    n = {"stage_a": a, "stage_b": b, "dtype": dtype,
         "measure": "bf16" if both and dtype != "bfloat16" else "bit_exact",
         **{k: v for k, v in r.items() if isinstance(v, float)}}  # unrounded: the sentence rounds once, as the demo
    for side, stage in (("a", a), ("b", b)):
        row = bf16.get(stage)
        n[f"bf16_changed_pct_{side}"] = row["changed_pct"] if row else None
        n[f"bf16_steps_{side}"] = row["steps"] if row else None
    return [found(run, "update_sparsity", "info", n, S.update_sparsity_sql(run, a, b, bool(bf16)))]


def delta_sync_numbers(row: dict[str, Any]) -> dict[str, Any]:
    """The numbers of a delta-sync sentence from a ``delta_sync_summary`` row (the report's finding and the
    dashboard's caption say the same thing from it). Not rounded here: the sentence rounds once, as the
    demo's table does from the same row (rounding twice, to 6 decimals and then to 3 significant digits,
    turned 0.003875038 ms into "0.00387 ms" where the analysis' value reads "0.00388 ms")."""
    return {"stage": row["stage"], "steps": row["steps"], "changed_pct": row["changed_pct"],
            "delta_pct": row["delta_pct"], "encoding": row["encoding"], "full_bf16_bytes": row["full_bf16_bytes"],
            "delta_sync_ms": row["delta_sync_ms"], "full_bf16_sync_ms": row["full_bf16_sync_ms"]}


def delta_sync(con, run: str) -> list[Finding]:
    """What shipping only the bf16 elements that changed would send, per RL step (``delta_sync_summary``)."""
    df = delta_sync_summary(con, run)
    if df.is_empty():
        return []
    r = df.sort(pl.col("stage") == "rl", descending=True).row(0, named=True)
    saved = (r["full_bf16_sync_ms"] or 0.0) - (r["delta_sync_ms"] or 0.0)
    return [found(run, "delta_sync", "info", delta_sync_numbers(r), S.delta_sync_sql(run, r["stage"]),
                   saved * r["steps"])]
