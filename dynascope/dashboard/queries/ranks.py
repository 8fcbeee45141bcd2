"""Per-rank views of a run's step timings that stay readable at 1,024 ranks: a rank (or node) × step heat
map, the distribution of per-rank busy time, the slowest ranks and nodes (what a rank costs the step is
``analyses.what_if``'s, joined on by ``with_rank_costs``).

One scan of ``timings`` gives each (role, rank, step) its busy time (``rank_steps``, the definitions of
``dynascope.analyses.steps``); everything else is polars over that frame, so the page pays
for the table once however many views it draws. In a synchronous step every rank's step lasts as long as
the slowest rank's (the others wait in the collectives), so ranks are told apart by their *busy* time,
each against the cross-rank median of its role in that step.
"""

from __future__ import annotations

from statistics import NormalDist

import polars as pl

from dynascope.store import StoreConnection, quote_literal

_STEP_KEYS = ["role", "step"]


def rank_steps(store: StoreConnection, run: str) -> pl.DataFrame:
    """Per (role, rank, step) with busy time: ``busy_us``, the top-level phases without waits and
    collectives (the definitions of ``dynascope.analyses.steps``), filtered before they are summed. Only
    steps with the rank's step row count, as in the report, ``dynascope runs`` and the what-if: phases after
    the last optimizer step (a final evaluation) are no step."""
    from dynascope.analyses.steps import STEP_ROW, SYNC, TOP_LEVEL

    r = quote_literal(run)
    return store.frame(f"""
        WITH busy AS (SELECT coalesce(role, '') AS role, rank, step, sum(dur_us) AS busy_us
                      FROM timings WHERE run_id = {r} AND {TOP_LEVEL} AND NOT ({SYNC}) GROUP BY ALL),
             st AS (SELECT DISTINCT coalesce(role, '') AS role, rank, step FROM timings WHERE run_id = {r} AND {STEP_ROW})
        SELECT busy.* FROM busy SEMI JOIN st USING (role, rank, step) ORDER BY role, rank, step""")


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


def rank_table(rel: pl.DataFrame, alpha: float = 0.01) -> pl.DataFrame:
    """Per rank, from ``relative_busy``: mean busy ms per step, ``score_pct`` (its busy time over the run
    against the step medians', 100 · (Σ busy / Σ median − 1): negative for a rank faster than the median),
    how often it was its role's slowest and above the median (``above_median_pct``), and ``slow``: whether
    it stands out as slower than its role.

    A rank stands out when it is above the step's median in more steps than chance allows: a rank no slower
    than the others is above it in about half of them, so its count is tested against Binomial(n, ½), one
    sided, at ``alpha`` shared among its role's ranks (normal approximation). A rank slower by less than its
    role's step-to-step jitter, or faster, does not stand out, however far its mean is pulled by a few steps.

    What a rank costs the step ("what if rank R ran at the median") is ``analyses.what_if``'s scenario
    ``rank R``, the report's figure too: ``with_rank_costs`` joins it on.
    """
    order = pl.col("busy_us").rank("ordinal", descending=True).over(_STEP_KEYS)
    df = (rel.with_columns(order.alias("pos")).group_by("role", "rank").agg(
        (pl.col("busy_us").mean() / 1000).alias("mean_busy_ms"),
        (100.0 * (pl.col("busy_us").sum() / pl.col("median_us").sum() - 1)).alias("score_pct"),
        (100.0 * (pl.col("pos") == 1).mean()).alias("slowest_share_pct"),
        (100.0 * (pl.col("rel_pct") > 0).mean()).alias("above_median_pct"), pl.len().alias("steps")))
    n, k = pl.col("steps"), pl.col("above_median_pct") * pl.col("steps") / 100
    z = (k - n / 2 - 0.5) / (n.sqrt() / 2)  # continuity-corrected
    need = pl.col("rank").count().over("role").map_elements(
        lambda ranks: NormalDist().inv_cdf(1 - alpha / ranks), return_dtype=pl.Float64)
    return (df.with_columns(((pl.col("score_pct") > 0) & (z >= need)).alias("slow"))
            .sort(["score_pct", "role", "rank"], descending=[True, False, False]))


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
