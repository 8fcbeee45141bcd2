"""Per-rank views of a run's step timings that stay readable at 1,024 ranks: a rank (or node) × step heat
map, the distribution of per-rank busy time, the slowest ranks and nodes (what a rank costs the step is
``analyses.what_if``'s, joined on by ``with_rank_costs``).

One scan of ``timings`` gives each (role, rank, step) its busy time, and the per-rank table and which ranks
stand out come from it (``rank_steps``, ``relative_busy`` and ``rank_table`` of ``analyses.slower_ranks``, the
report's rule too); everything else is polars over that frame, so the page pays
for the table once however many views it draws. In a synchronous step every rank's step lasts as long as
the slowest rank's (the others wait in the collectives), so ranks are told apart by their *busy* time,
each against the cross-rank median of its role in that step.
"""

from __future__ import annotations

import polars as pl

from dynascope.analyses.slower_ranks import rank_steps, rank_table, relative_busy
from dynascope.store import StoreConnection, quote_literal

__all__ = ["apart_from_node", "heat_cells", "node_table", "rank_hosts", "rank_steps", "rank_table", "relative_busy",
           "straggler_table", "typical_rank", "with_rank_costs"]

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


def with_rank_costs(ranks: pl.DataFrame, what_if: pl.DataFrame) -> pl.DataFrame:
    """``ranks`` (``rank_table``) with ``whatif_saved_ms`` and ``whatif_saved_pct``: the step time saved if
    the rank ran at the cross-rank median in every phase, ``what_if``'s whole-rank scenarios (NULL where it
    priced none)."""
    whole = what_if.filter(pl.col("rank").is_not_null() & pl.col("phase").is_null()).select(
        pl.col("role").fill_null(""), pl.col("rank").cast(ranks.schema["rank"]),
        pl.col("saved_ms").alias("whatif_saved_ms"), pl.col("saved_pct").alias("whatif_saved_pct"))
    return ranks.join(whole, on=["role", "rank"], how="left")


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


def heat_cells(rel: pl.DataFrame, hosts: pl.DataFrame, by_node: bool, max_cols: int = 40) -> pl.DataFrame:
    """Long (row, step, value) cells: the median ``rel_pct`` over each step bucket (at most ``max_cols``
    buckets) and the row's ranks; a row is a rank, or a host when ``by_node``. ``order`` sorts rows (role,
    then the first rank). A median of a few steps, not one step's value: one rank's busy time jitters by
    tens of percent from step to step on shared devices, and a cell per step drew that jitter louder than a
    rank slow at every step; a median also keeps one wild step (a checkpoint) to its own cell's share."""
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
    return (df.group_by("row", "order", "step").agg(pl.col("rel_pct").median().alias("value"))
            .sort("order", "step"))


def typical_rank(ranks: pl.DataFrame, role: str) -> int | None:
    """The rank of ``role`` whose ``score_pct`` is its role's median (a typical rank to compare against)."""
    r = ranks.filter(pl.col("role") == role).sort("score_pct")
    return int(r["rank"][r.height // 2]) if r.height else None
