"""Findings at cluster scale: a slow node named as a node.

- ``slow_node``: a host whose ranks of a role are slow together in one or more phases
  (``outliers.cluster_outliers``' node rows, which ``findings._stragglers`` computes once for both), priced
  by ``what_if_node``: its ranks' slow phases at the cross-rank median ("remove node X").

Numbers and query as in ``findings`` (``findings_sql`` holds the queries).
"""

from __future__ import annotations

from typing import Any

import polars as pl

from dynascope.analyses import findings_sql as S
from dynascope.analyses._findings import Finding, found, rnd
from dynascope.analyses.what_if_hosts import what_if_node

__all__: list[str] = []  # generators for ``findings.GENERATORS``, not public analyses

MIN_CLUSTER_RANKS = 8  # below a node's worth of ranks the healthy spread is not measured well enough


def slow_nodes(con: Any, run: str, outliers: pl.DataFrame) -> list[Finding]:
    """One finding per (role, host) among ``outliers``' (``cluster_outliers``) node rows."""
    nodes = outliers.filter(pl.col("kind") == "node")
    out = []
    for (role, host), g in nodes.group_by(["role", "host"], maintain_order=True):
        wi = what_if_node(con, run, hosts=[str(host)], phases=g["phase"].to_list()).filter(pl.col("role") == role)
        if wi.is_empty():
            continue
        w = wi.row(0, named=True)
        n = {"host": host, "role": role, "ranks_count": w["ranks_count"], "phases": ", ".join(g["phase"].to_list()),
             "min_slowdown_pct": rnd(100 * (g["min_slowdown_x"].min() - 1), 1),
             "max_slowdown_pct": rnd(100 * (g["max_slowdown_x"].max() - 1), 1), "steps": w["steps"],
             "saved_ms": rnd(w["saved_ms"]), "saved_pct": rnd(w["saved_pct"], 2)}
        out.append(found(run, "slow_node", "warning", n, S.node_ranks_sql(run, str(role), str(host)),
                         w["saved_ms"], n["saved_pct"]))
    return out
