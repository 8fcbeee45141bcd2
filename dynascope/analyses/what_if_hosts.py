"""What if node X (all ranks on one host) ran as fast as the others: the rank what-if, one host at a time.

A slow node is the case a one-rank what-if cannot price: with one of its ranks at the cross-rank median the
node's other ranks still arrive last. Replacing every rank of the host together (``what_if_rank``'s
replay, ``ranks`` = the host's ranks of each role) prices the node. Hosts come from the ``runs`` rows.
"""

from __future__ import annotations

from collections.abc import Iterable

import polars as pl

from dynascope.analyses._common import StoreLike, as_store, frame, run_clause
from dynascope.analyses._what_if_load import load_rank_steps
from dynascope.analyses.what_if_rank import replay_steps
from dynascope.store import quote_literal

__all__ = ["what_if_node"]

_SCHEMA = {"run_id": pl.String, "role": pl.String, "host": pl.String, "ranks_count": pl.Int64, "steps": pl.Int64,
           "measured_ms": pl.Float64, "simulated_base_ms": pl.Float64, "simulated_ms": pl.Float64,
           "saved_ms": pl.Float64, "saved_pct": pl.Float64}


def what_if_node(store: StoreLike, run: str | None = None, *, hosts: Iterable[str] | None = None,
                 phases: Iterable[str] | None = None) -> pl.DataFrame:
    """Step time saved if every rank of a host ran at the cross-rank median (``phases``: which; None: all
    busy phases and the remainder), per (run, role, host). ``hosts``: which (None: every host; one replay
    each, so name the ones you ask about on a large cluster). Columns: run_id, role, host, ranks_count,
    steps, measured_ms, simulated_base_ms, simulated_ms, saved_ms, saved_pct (of simulated_base_ms).
    """
    con = as_store(store)
    only = "" if hosts is None else " AND host IN (" + ", ".join(quote_literal(h) for h in hosts) + ")"
    placed = frame(con, f"""SELECT DISTINCT run_id, coalesce(role, '') AS role, host, rank FROM runs
        WHERE rank IS NOT NULL AND host IS NOT NULL{only}{run_clause(run)}""")
    if placed.is_empty():
        return pl.DataFrame(schema=_SCHEMA)
    rs = load_rank_steps(con, run)
    phases = None if phases is None else list(phases)
    out = []
    for (run_id, role, host), g in placed.group_by(["run_id", "role", "host"], maintain_order=True):
        steps = replay_steps(rs, g["rank"].to_list(), phases).filter(
            (pl.col("run_id") == run_id) & (pl.col("role") == role))
        if steps.is_empty():
            continue
        out.append(steps.group_by("run_id", "role").agg(
            pl.lit(host).alias("host"), pl.lit(g.height).alias("ranks_count"), pl.len().alias("steps"),
            pl.col("measured_ms").sum(), pl.col("simulated_base_ms").sum(), pl.col("simulated_ms").sum(),
            pl.col("saved_ms").sum()))
    if not out:
        return pl.DataFrame(schema=_SCHEMA)
    df = pl.concat(out).with_columns(saved_pct=100 * pl.col("saved_ms") / pl.col("simulated_base_ms"))
    return df.select(list(_SCHEMA)).cast(_SCHEMA).sort(  # type: ignore[arg-type]
        ["run_id", "role", "saved_ms"], descending=[False, False, True])
