"""Per-rank views of a run's step timings that stay readable at 1,024 ranks: a rank (or node) × step heat
map, the distribution of per-rank busy time, the slowest ranks and nodes, and the step-level what-if.

One scan of ``timings`` gives each (role, rank, step) its busy time (``rank_steps``, the definitions of
``dynascope.analyses.steps``); everything else is polars over that frame, so the page pays
for the table once however many views it draws. In a synchronous step every rank's step lasts as long as
the slowest rank's (the others wait in the collectives), so ranks are told apart by their *busy* time,
each against the cross-rank median of its role in that step.
"""

from __future__ import annotations

import polars as pl

from dynascope.store import StoreConnection, quote_literal

_STEP_KEYS = ["role", "step"]


def rank_steps(store: StoreConnection, run: str) -> pl.DataFrame:
    """Per (role, rank, step) with busy time: ``busy_us``, the top-level phases without waits and
    collectives (the definitions of ``dynascope.analyses.steps``), filtered before they are summed."""
    from dynascope.analyses.steps import SYNC, TOP_LEVEL

    return store.frame(f"""
        SELECT coalesce(role, '') AS role, rank, step, sum(dur_us) AS busy_us
        FROM timings WHERE run_id = {quote_literal(run)} AND {TOP_LEVEL} AND NOT ({SYNC})
        GROUP BY ALL ORDER BY role, rank, step""")


def rank_hosts(store: StoreConnection, run: str, run_dir: str | None) -> pl.DataFrame:
    """(role, rank, host) of every rank: the ``runs`` rows a rank wrote, else its writer's heartbeat (the
    process that creates a run writes the only ``runs`` row of most multi-node runs)."""
    from dynascope.store.catalog import writer_hosts

    listed = store.frame(f"""SELECT coalesce(role, '') AS role, rank, any_value(host) AS host FROM runs
                             WHERE run_id = {quote_literal(run)} AND rank IS NOT NULL AND host IS NOT NULL
                             GROUP BY ALL""")
    beats = pl.DataFrame(writer_hosts(run_dir) if run_dir else [], schema={"role": pl.String, "rank": pl.Int32,
                                                                          "host": pl.String}, orient="row")
    listed = listed.cast({"rank": pl.Int32})
    return pl.concat([listed, beats.join(listed, on=["role", "rank"], how="anti")]).sort("role", "rank")


def relative_busy(rs: pl.DataFrame) -> pl.DataFrame:
    """Each (role, rank, step) with busy time and the step's cross-rank median busy time of its role:
    ``rel_pct`` = 100 · (busy / median − 1). Steps timed on a single rank of the role are left out."""
    busy = rs.filter(pl.col("busy_us").is_not_null())
    return (busy.with_columns(pl.col("busy_us").median().over(_STEP_KEYS).alias("median_us"),
                              pl.len().over(_STEP_KEYS).alias("ranks"))
            .filter((pl.col("ranks") > 1) & (pl.col("median_us") > 0))
            .with_columns((100.0 * (pl.col("busy_us") / pl.col("median_us") - 1)).alias("rel_pct")))


def rank_table(rel: pl.DataFrame) -> pl.DataFrame:
    """Per rank, from ``relative_busy``: mean busy ms per step, ``score_pct`` (mean of the per-step
    ``rel_pct``), how often it was its role's slowest, and what capping it at each step's median saves.

    What-if: the rank's busy time is capped at that step's median; the step then waits for the slowest of
    the other ranks (or the median). The saving is the summed reduction of the slowest busy time, over the
    role's summed slowest busy time.
    """
    order = pl.col("busy_us").rank("ordinal", descending=True).over(_STEP_KEYS)
    top1 = pl.col("busy_us").max().over(_STEP_KEYS)
    top2 = pl.col("busy_us").filter(order == 2).first().over(_STEP_KEYS).fill_null(0)
    df = rel.with_columns(order.alias("pos"), top1.alias("top1"), top2.alias("top2"))
    new_top = pl.max_horizontal(pl.when(pl.col("pos") == 1).then(pl.col("top2")).otherwise(pl.col("top1")),
                                pl.min_horizontal("busy_us", "median_us"))
    df = df.with_columns((pl.col("top1") - new_top).alias("saved_us"))
    steps_top = df.filter(pl.col("pos") == 1).group_by("role").agg(pl.col("top1").sum().alias("role_top_us"))
    return (df.group_by("role", "rank").agg(
        (pl.col("busy_us").mean() / 1000).alias("mean_busy_ms"), pl.col("rel_pct").mean().alias("score_pct"),
        (100.0 * (pl.col("pos") == 1).mean()).alias("slowest_share_pct"),
        (pl.col("saved_us").sum() / 1e6).alias("whatif_saved_s"), pl.len().alias("steps"))
        .join(steps_top, on="role", how="left")
        .with_columns((100.0 * 1e6 * pl.col("whatif_saved_s") / pl.col("role_top_us")).alias("whatif_saved_pct"))
        .drop("role_top_us").sort(["score_pct", "role", "rank"], descending=[True, False, False]))


def straggler_table(store: StoreConnection, run: str) -> pl.DataFrame:
    """``rank_table`` of ``run`` straight from the store: per rank, busy time against the step's median."""
    return rank_table(relative_busy(rank_steps(store, run)))


def node_table(ranks: pl.DataFrame, hosts: pl.DataFrame) -> pl.DataFrame:
    """Per (role, host), from ``rank_table``: its ranks, the median of their ``score_pct`` (a node with one
    slow rank is not a slow node: that rank is named as a rank), its spread (``lo_pct``–``hi_pct``) and
    ``sigmas``: that median's distance from its role's median rank in robust standard deviations of the
    role's ranks (1.4826 · MAD). Slowest first by ``sigmas``: rollout workers differ by the lengths they
    drew, trainers by a percent, so a trainer node 7% slow outranks a rollout node 10% slow by chance.
    Empty without hosts."""
    if hosts.is_empty():
        return pl.DataFrame(schema={"role": pl.String, "host": pl.String, "ranks": pl.UInt32, "score_pct": pl.Float64,
                                    "lo_pct": pl.Float64, "hi_pct": pl.Float64, "first_rank": pl.Int32,
                                    "sigmas": pl.Float64})
    score = pl.col("score_pct")
    mad = (score - score.median().over("role")).abs().median().over("role")
    ranks = ranks.drop("host", strict=False).join(hosts, on=["role", "rank"], how="inner").with_columns(
        score.median().over("role").alias("role_median"), (1.4826 * mad).alias("role_sigma"))
    return (ranks.group_by("role", "host")
            .agg(pl.len().alias("ranks"), score.median(), score.min().alias("lo_pct"), score.max().alias("hi_pct"),
                 pl.col("rank").min().alias("first_rank"), pl.col("role_median").first(), pl.col("role_sigma").first())
            .with_columns(((score - pl.col("role_median")) / pl.col("role_sigma")).alias("sigmas"))
            .drop("role_median", "role_sigma").sort(["sigmas", "host"], descending=[True, False], nulls_last=True))


def apart_from_node(ranks: pl.DataFrame, nodes: pl.DataFrame) -> pl.DataFrame:
    """``ranks`` (with ``host``) plus ``vs_node_pct``: its ``score_pct`` less its node's median rank (its
    role's median where the host is unknown), and ``sigmas``: that in robust standard deviations of its
    role's ranks; slowest first by ``sigmas``. A rank on a slow node is slow because its node is (the node
    table names it); what is left is the rank's own slowness."""
    score = pl.col("score_pct")
    sigma = 1.4826 * (score - score.median().over("role")).abs().median().over("role")
    node = nodes.select("role", "host", pl.col("score_pct").alias("node_pct"))
    return (ranks.join(node, on=["role", "host"], how="left")
            .with_columns((score - pl.col("node_pct").fill_null(score.median().over("role"))).alias("vs_node_pct"),
                          sigma.alias("_sigma"))
            .with_columns((pl.col("vs_node_pct") / pl.col("_sigma")).alias("sigmas")).drop("node_pct", "_sigma")
            .sort(["sigmas", "score_pct"], descending=True, nulls_last=True))


def heat_cells(rel: pl.DataFrame, hosts: pl.DataFrame, by_node: bool, max_cols: int = 200) -> pl.DataFrame:
    """Long (row, step, value) cells: ``rel_pct`` averaged over each step bucket (at most ``max_cols``
    buckets) and over the row's ranks; a row is a rank, or a host when ``by_node``. ``order`` sorts rows
    (role, then the first rank)."""
    if rel.is_empty():
        return pl.DataFrame(schema={"row": pl.String, "order": pl.Int64, "step": pl.Int64, "value": pl.Float64})
    s0, s1 = int(rel["step"].min()), int(rel["step"].max())  # type: ignore[arg-type]
    width = max(1, -(-(s1 - s0 + 1) // max_cols))
    df = rel.with_columns((s0 + (pl.col("step") - s0) // width * width).alias("step"))
    roles = {r: i for i, r in enumerate(sorted(df["role"].unique().to_list(), key=lambda r: (r != "trainer", r)))}
    role_order = pl.col("role").replace_strict(roles, return_dtype=pl.Int64) * 2**32
    if by_node:
        df = df.join(hosts, on=["role", "rank"], how="inner").with_columns(
            pl.col("host").alias("row"), (role_order + pl.col("rank").min().over("role", "host")).alias("order"))
    else:
        label = pl.format("{} {}", pl.col("role"), pl.col("rank")) if len(roles) > 1 else pl.format("rank {}", pl.col("rank"))
        df = df.with_columns(label.alias("row"), (role_order + pl.col("rank")).alias("order"))
    return (df.group_by("row", "order", "step").agg(pl.col("rel_pct").mean().alias("value"))
            .sort("order", "step"))


def typical_rank(ranks: pl.DataFrame, role: str) -> int | None:
    """The rank of ``role`` whose ``score_pct`` is its role's median (a typical rank to compare against)."""
    r = ranks.filter(pl.col("role") == role).sort("score_pct")
    return int(r["rank"][r.height // 2]) if r.height else None
