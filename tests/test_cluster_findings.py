"""The cluster analyses and the report on the 64-rank synthetic run (``helpers.cluster_truth``): what happens
once per step on every rank (a sharded checkpoint, a weight sync) counts once, and the planted faults are
named as what they are."""

from __future__ import annotations

import json

import polars as pl
import pytest

from dynascope.analyses import (
    cluster_outliers,
    goodput_summary,
    ranked_findings,
    rollout_train_overlap,
    what_if,
    what_if_node,
    what_if_steps,
)
from dynascope.demo.synthetic import CHECKPOINT, WEIGHT_SYNC

from helpers.cluster_truth import SPEC, planted_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    return planted_cluster(tmp_path_factory.mktemp("cluster"))


def test_a_sharded_checkpoint_counts_once_at_its_wall_clock_time(cluster):
    run, _ = cluster
    g = goodput_summary(run).row(0, named=True)
    # every trainer rank saves its shard at each checkpoint: 64 events, one checkpoint of ~25 s
    assert g["checkpoint_saves"] == SPEC.steps // SPEC.checkpoint_every == 2
    assert 0.95 * CHECKPOINT < g["checkpoint_save_ms"] / g["checkpoint_saves"] < 1.2 * CHECKPOINT
    assert 90 < g["goodput_pct"] < 97  # two 25 s saves in a ~17 min run


def test_a_weight_sync_counts_once_per_step(cluster):
    run, _ = cluster
    o = rollout_train_overlap(run).row(0, named=True)
    # trainers and workers all record the step's sync: one sync a step, its wall-clock span
    assert o["weight_syncs"] == SPEC.steps
    assert 0.95 * WEIGHT_SYNC < o["weight_sync_ms"] / SPEC.steps < 2 * WEIGHT_SYNC


def test_the_planted_faults_are_named_as_ranks_and_a_node_and_nothing_else(cluster):
    run, truth = cluster
    p = truth["planted"]
    got = cluster_outliers(run)
    named = {(r["kind"], r["host"] if r["kind"] == "node" else r["rank"], r["phase"], r["status"])
             for r in got.iter_rows(named=True)}
    node = p["slow_node"]
    want = {("rank", p["slow_rank"]["rank"], p["slow_rank"]["phase"], "persistent"),
            ("rank", p["intermittent_rank"]["rank"], p["intermittent_rank"]["phase"], "intermittent"),
            ("rank", p["tail_worker"]["rank"], p["tail_worker"]["phase"], "persistent")}
    want |= {("node", node["host"], phase, "persistent") for phase in node["phases"]}
    assert named == want
    for r in got.filter(pl.col("kind") == "node").iter_rows(named=True):  # "its 8 ranks are 6-9% slower"
        assert r["ranks_count"] == len(node["ranks"])
        assert node["factor_range"][0] - 0.03 < r["min_slowdown_x"] <= r["max_slowdown_x"] < node["factor_range"][1] + 0.03
    slow = got.filter(pl.col("rank") == p["slow_rank"]["rank"]).row(0, named=True)
    assert abs(slow["slowdown_x"] / p["slow_rank"]["factor"] - 1) < truth["healthy_spread"]
    assert got.filter(pl.col("rank") == p["intermittent_rank"]["rank"])["slow_steps_count"][0] == \
        SPEC.steps // p["intermittent_rank"]["every"]


def test_the_report_names_each_planted_fault_and_the_rank_waited_for(cluster):
    run, truth = cluster
    p = truth["planted"]
    found = ranked_findings(run)
    by = {k: [json.loads(x) for x in found.filter(pl.col("finding") == k)["numbers_json"]]
          for k in ("straggler", "slow_node", "idle")}
    assert [(n["host"], n["ranks_count"], sorted(n["phases"].split(", "))) for n in by["slow_node"]] == \
        [(p["slow_node"]["host"], 8, sorted(p["slow_node"]["phases"]))]
    assert {(n["rank"], n["phase"], n["status"]) for n in by["straggler"]} == {
        (p["slow_rank"]["rank"], p["slow_rank"]["phase"], "persistent"),
        (p["intermittent_rank"]["rank"], p["intermittent_rank"]["phase"], "intermittent"),
        (p["tail_worker"]["rank"], p["tail_worker"]["phase"], "persistent")}
    assert not found.filter(pl.col("finding").is_in(["rank_cost", "imbalance"])).height
    # the wait is charged to the rank that arrived last (the rollout worker with the long tail), not to
    # the rank that waited most
    idle = by["idle"][0]
    assert idle["waited_for_rank"] == p["tail_worker"]["rank"] and idle["waited_for_host"] == p["tail_worker"]["host"]
    assert "waiting for it" in found.filter(pl.col("finding") == "idle")["sentence"][0]


def test_what_if_node_replaces_the_hosts_ranks_together(cluster):
    run, truth = cluster
    node = truth["planted"]["slow_node"]
    got = what_if_node(run, hosts=[node["host"]], phases=node["phases"]).row(0, named=True)
    ref = what_if_steps(run, ranks=node["ranks"], phases=node["phases"]).filter(pl.col("role") == "trainer")
    assert got["ranks_count"] == 8 and got["steps"] == ref.height == SPEC.steps
    assert got["saved_ms"] == pytest.approx(ref["saved_ms"].sum(), rel=1e-12)
    # one of its ranks at the median saves less: the node's other ranks still arrive last
    one = what_if(run, ranks=[node["ranks"][0]]).filter(pl.col("scenario") == f"rank {node['ranks'][0]}")
    assert got["saved_ms"] > 0 and got["saved_ms"] > one["saved_ms"][0]
    every = what_if_node(run, phases=node["phases"])  # every host: the slow one saves most among trainers
    assert every.filter(pl.col("role") == "trainer")["host"][0] == node["host"]
    assert every["host"].n_unique() == len(truth["hosts"])
