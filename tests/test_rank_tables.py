"""The Cluster page's per-rank and per-node tables (``dashboard.queries.ranks``), held to hand-computed values
on a small frame: a node slow in every rank, a rank slow on a healthy node, a role far noisier than another."""

from __future__ import annotations

import statistics

import polars as pl
import pytest

from dynascope.dashboard.queries import ranks as R


def rel_frame() -> tuple[pl.DataFrame, pl.DataFrame]:
    """16 trainer ranks on nodes a-d and 4 rollout workers on node e, 10 steps. Trainers 4-7 (node b) run 6%
    above the others, trainer 1 (node a) 9%, the rest within ±0.1%; the workers 30% and 10% below and above
    (the lengths they drew)."""
    rows = []
    for step in range(10):
        for rank in range(16):
            pct = 6.0 if 4 <= rank < 8 else (9.0 if rank == 1 else 0.1 * ((rank + step) % 3 - 1))
            rows.append(("trainer", rank, step, 100.0 * (1 + pct / 100)))
        for rank, pct in enumerate((-30.0, -10.0, 10.0, 30.0)):
            rows.append(("rollout", rank, step, 100.0 * (1 + pct / 100)))
    busy = pl.DataFrame(rows, schema={"role": pl.String, "rank": pl.Int32, "step": pl.Int64, "busy_us": pl.Float64},
                        orient="row")
    hosts = pl.DataFrame([("trainer", r, "abcd"[r // 4]) for r in range(16)] + [("rollout", r, "e") for r in range(4)],
                         schema={"role": pl.String, "rank": pl.Int32, "host": pl.String}, orient="row")
    return R.relative_busy(busy), hosts


def test_relative_busy_is_against_the_roles_median_in_each_step():
    rel, _ = rel_frame()
    got = rel.filter((pl.col("step") == 3) & (pl.col("role") == "trainer")).sort("rank")
    busy = got["busy_us"].to_list()
    assert got["median_us"][0] == statistics.median(busy)
    assert got["rel_pct"].to_list() == pytest.approx([100 * (b / statistics.median(busy) - 1) for b in busy])


def test_nodes_rank_by_their_median_rank_in_sigmas_of_their_role():
    rel, hosts = rel_frame()
    ranks = R.rank_table(rel)
    nodes = R.node_table(ranks, hosts)
    assert nodes["host"].to_list()[0] == "b"  # slow in every rank
    b = nodes.row(0, named=True)
    scores = ranks.filter(pl.col("role") == "trainer")["score_pct"].to_list()
    med = statistics.median(scores)
    sigma = 1.4826 * statistics.median(abs(s - med) for s in scores)
    node_b = ranks.filter((pl.col("role") == "trainer") & pl.col("rank").is_between(4, 7))["score_pct"].to_list()
    assert b["score_pct"] == pytest.approx(statistics.median(node_b))
    assert b["sigmas"] == pytest.approx((statistics.median(node_b) - med) / sigma)
    assert (b["ranks"], b["lo_pct"], b["hi_pct"]) == (4, min(node_b), max(node_b))
    # one slow rank does not make its node slow: node a's figure is its median rank, not pulled up by rank 1
    node_a = ranks.filter((pl.col("role") == "trainer") & (pl.col("rank") < 4))["score_pct"].to_list()
    assert nodes.filter(pl.col("host") == "a")["score_pct"].item() == pytest.approx(statistics.median(node_a))
    assert statistics.mean(node_a) > statistics.median(node_a) + 2
    # the workers' ±30% is their role's ordinary spread: node e is not slow
    assert nodes.filter(pl.col("host") == "e")["sigmas"].item() == pytest.approx(0.0, abs=1e-9)


def test_a_slow_rank_is_named_apart_from_its_node():
    rel, hosts = rel_frame()
    ranks = R.rank_table(rel).join(hosts, on=["role", "rank"], how="left")
    apart = R.apart_from_node(ranks, R.node_table(ranks, hosts))
    first = apart.row(0, named=True)
    assert (first["role"], first["rank"]) == ("trainer", 1)  # slower than rank 4-7 are, but on a healthy node
    node_a = ranks.filter((pl.col("role") == "trainer") & (pl.col("rank") < 4))["score_pct"].to_list()
    assert first["vs_node_pct"] == pytest.approx(first["score_pct"] - statistics.median(node_a))
    # ranks 4-7 are as slow as their node: nothing left of their own
    assert apart.filter(pl.col("rank").is_in([4, 5, 6, 7]) & (pl.col("role") == "trainer"))["vs_node_pct"].abs().max() \
        == pytest.approx(0.0, abs=1e-9)


def test_heat_cells_take_the_median_of_a_nodes_ranks_over_step_buckets():
    rel, hosts = rel_frame()
    trainers = rel.filter(pl.col("role") == "trainer")
    cells = R.heat_cells(trainers, hosts, by_node=True, max_cols=5)  # 10 steps → buckets of 2
    assert sorted(cells["row"].unique()) == ["a", "b", "c", "d"] and sorted(cells["step"].unique()) == [0, 2, 4, 6, 8]
    want = trainers.filter((pl.col("rank") < 4) & pl.col("step").is_in([2, 3]))["rel_pct"].median()
    assert cells.filter((pl.col("row") == "a") & (pl.col("step") == 2))["value"].item() == pytest.approx(want)
    per_rank = R.heat_cells(trainers, hosts, by_node=False, max_cols=5)
    assert per_rank["row"].n_unique() == 16 and per_rank.filter(pl.col("row") == "rank 1")["value"].min() > 5
