"""Cluster page, ranks and nodes: where a run's ranks differ, drawn so that 8 ranks and 1,024 read alike.

Nothing here draws a line or a legend entry per rank: a rank (or node) × step heat map of busy time against
the step's cross-rank median, the distribution of per-rank busy time with the slowest named, and tables of
the slowest ranks and nodes. The page's timeline then drills down to the ranks picked here.
"""

from __future__ import annotations

import polars as pl
import streamlit as st

from dynascope.core.fmt import fmt_ms, fmt_pct
from dynascope.dashboard import charts, data
from dynascope.dashboard.queries import ranks as R
from dynascope.store import StoreConnection

TOP_RANKS, TOP_NODES = 10, 5
# Up to this many ranks the heat map has a row per rank by default; beyond, a row per node.
RANK_ROWS_MAX = 64
Pick = tuple[str, int]  # (role, rank)


def frames(path: str, run: str) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """(per-step relative busy time, per-rank table, hosts) of ``run``, each cached until the store changes."""
    rel, ranks = data.query(rank_frames, path, run)
    return rel, ranks, data.query(R.rank_hosts, path, run, run_dir(path, run))


def run_dir(path: str, run: str) -> str | None:
    """The directory of ``run`` (its heartbeats name each rank's host)."""
    dirs = dict(data.catalog(path).select("run_id", "path").iter_rows())
    return dirs.get(run)


def rank_frames(store: StoreConnection, run: str) -> tuple[pl.DataFrame, pl.DataFrame]:
    """One scan of the run's timings, and the per-rank table from it, cached together (data.query): the
    table is polars over the per-step frame, which at 1,024 ranks costs more than a lookup on every rerun."""
    rel = R.relative_busy(R.rank_steps(store, run))
    return rel, R.rank_table(rel)


def label(role: str, rank: int, roles: int) -> str:
    return f"{role} {rank}" if roles > 1 else f"rank {rank}"


def section(path: str, run: str) -> pl.DataFrame:
    """Heat map, distribution and the slowest ranks and nodes; returns the per-rank table (slowest first,
    with ``host`` where known) for the timeline's rank picker."""
    rel, ranks, hosts = frames(path, run)
    ranks = ranks.join(hosts, on=["role", "rank"], how="left")
    if ranks.is_empty():
        st.info("No step timed on two or more ranks of one role: nothing to compare ranks against.")
        return ranks
    nodes = R.node_table(ranks, hosts)
    roles = ranks["role"].n_unique()
    per_role = ", ".join(_count(n, f"{role} rank" if role else "rank")
                         for role, n in ranks.group_by("role", maintain_order=True).len().sort("role").iter_rows())
    hosts_n = nodes["host"].n_unique() if nodes.height else 0
    st.subheader("Ranks and nodes")
    st.caption(f"{per_role}" + (f" on {_count(hosts_n, 'node')}" if hosts_n else "")
               + ". Busy time: the top-level phases without waits and collectives. In a synchronous step every "
               "rank's step lasts as long as the slowest rank's, so ranks differ by busy time, here against the "
               "median of their role in each step.")
    with data.guard("Busy time heat map"):
        _heatmap(rel, hosts)
    # The distribution, then the tables, each the page's width: beside the chart the tables' columns ran
    # off the right edge.
    with data.guard("Per-rank distribution"):
        shown = ranks.with_columns(pl.format("{} ({})", pl.struct("role", "rank").map_elements(
            lambda r: label(r["role"], r["rank"], roles), return_dtype=pl.String),
            pl.col("host").fill_null("?")).alias("name"))
        # Only ranks that stand out as slower are named on the chart (rank_table's ``slow``): labelling the
        # top few of four ranks named ranks faster than the median.
        charts.show(charts.deviation_strip(shown, "score_pct", "role", "name",
                                           "per-rank busy time per step, against the step's median",
                                           "busy time over the run, % above (+) or below (−) the step medians'",
                                           named=shown.filter(pl.col("slow")).head(3)["name"].to_list()),
                    "cl_rank_strip")
    with data.guard("Slowest ranks and nodes"), st.container(key="cl_rank_tables"):  # the key names it in the page
        _tables(ranks, nodes, roles)
    return ranks


def _heatmap(rel: pl.DataFrame, hosts: pl.DataFrame) -> None:
    """One role at a time: rollout workers differ by the lengths they drew (tens of percent), trainers by a
    few, and on one colour scale the workers' noise would wash out a trainer node a few percent slow."""
    roles = sorted(rel["role"].unique().to_list(), key=lambda r: (r != "trainer", r))
    left, right = st.columns(2)
    role = left.radio("Role", roles, horizontal=True, key="cl_heat_role") if len(roles) > 1 else roles[0]
    rel, hosts = rel.filter(pl.col("role") == role), hosts.filter(pl.col("role") == role)
    n_ranks, n_nodes = rel["rank"].n_unique(), hosts["host"].n_unique()
    options = ["rank", "node"] if n_nodes else ["rank"]
    default = "node" if n_nodes and n_ranks > RANK_ROWS_MAX else "rank"
    by = right.radio("Rows", options, index=options.index(default), horizontal=True, key="cl_heat_rows",
                     format_func=lambda o: f"one per {o}") if len(options) > 1 else "rank"
    cells = R.heat_cells(rel, hosts, by == "node")
    n = cells["row"].n_unique()
    what = "the median of its ranks'" if by == "node" else "the rank's median"
    fig = charts.deviation_heatmap(cells, f"busy time against the step's cross-rank median, {by} × step"
                                   + (f" · {role}" if len(roles) > 1 else ""),
                                   "vs median", height=min(720, max(260, 140 + 6 * n)))
    charts.show(fig, "cl_rank_heat")
    st.caption(f"{_count(n, by)}; each cell is {what} busy time over the steps of its column, in % above (red) or "
               "below (blue) the median rank of the same role in each step. A slow node is a red band of a "
               "node's rows, a slow rank one row, a rank slow every k-th step a dotted row. The colours end at "
               "the larger of the cells' 90th percentile of |value| and the largest row median, so a row slow "
               "throughout reaches full red and a few extreme cells do not set the scale.")


def _signed(pct: float | None) -> str:
    return ("+" if pct is not None and pct > 0 else "") + fmt_pct(pct)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _tables(ranks: pl.DataFrame, nodes: pl.DataFrame, roles: int) -> None:
    """The ranks slower than their role's median, slowest apart from their node first; the rank named under
    them is one that stands out (``rank_table``'s ``slow``), never one within the role's spread or faster."""
    apart = R.apart_from_node(ranks, nodes).with_columns(
        pl.struct("role", "rank").map_elements(lambda r: label(r["role"], r["rank"], roles),
                                               return_dtype=pl.String).alias("rank_name"))
    top = apart.filter(pl.col("score_pct") > 0).head(TOP_RANKS)
    st.caption(f"The {top.height} slowest of the ranks above their role's median, apart from their node: by how "
               "far their busy time is above their node's median rank, in robust standard deviations of their "
               "role's ranks (σ). vs median: busy time over the run against the step medians'; above median: "
               "share of steps above the step's median rank; slowest: share of steps it was its role's "
               "slowest; stands out: above the median in more steps than chance allows, or beyond its role's ranks' "
               "spread (one-sided tests at 1% shared among the role's ranks). What a rank costs the step: "
               "Stragglers, below")
    pct = {"format": "%+.1f%%"}
    st.dataframe(top.select("rank_name", "host", "slow", "sigmas", "vs_node_pct", "score_pct", "mean_busy_ms",
                            "above_median_pct", "slowest_share_pct"),
                 hide_index=True, width="stretch", key="cl_top_ranks", column_config={
                     "rank_name": "rank", "slow": st.column_config.CheckboxColumn("stands out"),
                     "sigmas": st.column_config.NumberColumn("σ", format="%.1f"),
                     "vs_node_pct": st.column_config.NumberColumn("vs node", **pct),
                     "score_pct": st.column_config.NumberColumn("vs median", **pct),
                     "mean_busy_ms": st.column_config.NumberColumn("busy / step", format="%.0f ms"),
                     "above_median_pct": st.column_config.NumberColumn("above median", format="%.0f%%"),
                     "slowest_share_pct": st.column_config.NumberColumn("slowest", format="%.0f%%")})
    said = slowest_said(apart)
    if nodes.height:
        top_nodes = nodes.head(TOP_NODES)
        st.caption(("Nodes" if top_nodes.height == nodes.height else f"Slowest {top_nodes.height} nodes")
                   + ", by the median of their ranks (a node with one slow rank is "
                   "not a slow node) in robust standard deviations of their role's ranks (σ)")
        st.dataframe(top_nodes.select("host", "role", "ranks", "sigmas", "score_pct", "lo_pct", "hi_pct"),
                     hide_index=True, width="stretch", key="cl_top_nodes", column_config={
                         "sigmas": st.column_config.NumberColumn("σ", format="%.1f"),
                         "score_pct": st.column_config.NumberColumn("median rank", **pct),
                         "lo_pct": st.column_config.NumberColumn("fastest rank", **pct),
                         "hi_pct": st.column_config.NumberColumn("slowest rank", **pct)})
        node = nodes.row(0, named=True)
        if nodes.height > 1 and (node["sigmas"] or 0) > 0:
            said += (f" Slowest node: {node['host']}, its {_count(node['ranks'], (node['role'] or '') + ' rank')} "
                     f"{_signed(node['lo_pct'])} to {_signed(node['hi_pct'])} against the median.")
    st.caption(said)


def slowest_said(apart: pl.DataFrame) -> str:
    """The sentence naming the slowest rank that stands out, or saying that none does."""
    slow = apart.filter(pl.col("slow"))
    if slow.is_empty():
        return "No rank stands out as slower than its role: every rank is within the steps' spread or faster."
    worst = slow.row(0, named=True)
    return (f"Slowest rank: {worst['rank_name']} ({worst['host'] or 'host unknown'}), busy "
            f"{fmt_pct(worst['score_pct'])} above the median, {fmt_ms(worst['mean_busy_ms'])} a step"
            + (f"; {slow.height - 1} more stand out." if slow.height > 1 else "."))


def timeline_picks(ranks: pl.DataFrame, small: int = 16, most: int = 12) -> list[Pick]:
    """The ranks the timeline picker offers, slowest first; the default is every rank of a small run, else
    each role's slowest and its median rank."""
    opts: list[Pick] = [(r, int(k)) for r, k in ranks.select("role", "rank").iter_rows()]
    if len(opts) <= small:
        default = sorted(opts, key=lambda p: (p[0] != "trainer", p[0], p[1]))
    else:
        default = []
        for role in sorted(ranks["role"].unique().to_list(), key=lambda r: (r != "trainer", r)):
            slowest = ranks.filter(pl.col("role") == role)["rank"][0]
            typical = R.typical_rank(ranks, role)
            default += [(role, int(slowest))] + ([(role, typical)] if typical is not None and typical != slowest else [])
    roles = ranks["role"].n_unique()
    info = {(r, int(k)): (h, s) for r, k, h, s in ranks.select("role", "rank", "host", "score_pct").iter_rows()}

    def fmt(p: Pick) -> str:
        host, score = info.get(p, (None, None))
        return " · ".join(x for x in (label(p[0], p[1], roles), host, None if score is None else f"{score:+.1f}%") if x)

    picked = st.multiselect("Ranks on the timeline and in the breakdown (slowest first)", opts, key="cl_ranks",
                            default=data.remembered("cl_ranks", opts, default[:most]), format_func=fmt,
                            max_selections=most)
    return [tuple(p) for p in picked]  # type: ignore[misc]
