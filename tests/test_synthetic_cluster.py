"""The synthetic cluster run (64 ranks, written through RunWriter) holds what its planted truth says it holds."""

from __future__ import annotations

import math

import pytest

from dynascope.demo.synthetic import TAIL_FACTOR, ClusterSpec
from dynascope.demo.synthetic_tensors import ShardedModel
from dynascope.store import open_store

from helpers.cluster_truth import SPEC, planted_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    run, truth = planted_cluster(tmp_path_factory.mktemp("cluster"))
    with open_store(run) as store:
        yield store, truth


def relative(store, phase: str, steps: str = "TRUE") -> dict[int, float]:
    """Per trainer rank: median over steps of its ``phase`` time over that step's cross-rank median."""
    rows = store.rows(f"""
        WITH d AS (SELECT rank, step, dur_us FROM timings WHERE role = 'trainer' AND phase = '{phase}' AND {steps}),
        m AS (SELECT step, median(dur_us) AS med FROM d GROUP BY step)
        SELECT rank, median(dur_us / med) FROM d JOIN m USING (step) GROUP BY rank""")
    return dict(rows)


def test_every_rank_has_its_row_and_host(cluster):
    store, truth = cluster
    spec = truth["spec"]
    hosts = {r: h for h, ranks in truth["hosts"].items() for r in ranks}
    got = store.rows("SELECT rank, role, host FROM runs ORDER BY rank")
    assert len(got) == spec["ranks"] + spec["rollout_workers"] == len(hosts)
    assert all(host == hosts[rank] and role == ("trainer" if rank < spec["ranks"] else "rollout")
               for rank, role, host in got)
    assert len(truth["hosts"]) == 10  # 8 trainer nodes, 2 rollout nodes
    rows = {t: store.rows(f"SELECT count(*) FROM {t}")[0][0] for t in truth["rows"]}
    assert rows == truth["rows"]


def test_step_rows_are_their_phases_plus_a_short_gap(cluster):
    store, _ = cluster
    (bad, n) = store.rows("""
        WITH p AS (SELECT rank, step, sum(dur_us) AS us FROM timings WHERE category <> 'step' GROUP BY ALL),
        s AS (SELECT rank, step, dur_us AS us FROM timings WHERE category = 'step')
        SELECT count(*) FILTER (WHERE s.us - p.us < 0 OR s.us - p.us > 100000), count(*) FROM s JOIN p USING (rank, step)""")[0]
    assert bad == 0 and n == (SPEC.ranks + SPEC.workers) * SPEC.steps


def test_the_slow_rank_is_slow_in_backward_and_nowhere_else(cluster):
    store, truth = cluster
    slow = truth["planted"]["slow_rank"]
    node = set(truth["planted"]["slow_node"]["ranks"])
    odd = {slow["rank"], truth["planted"]["intermittent_rank"]["rank"]} | node
    bwd, fwd = relative(store, "backward"), relative(store, "forward")
    spread = truth["healthy_spread"] + 0.01  # persistent spread plus what 24 steps of jitter leave in a median
    assert bwd[slow["rank"]] > slow["factor"] * (1 - spread)
    assert abs(fwd[slow["rank"]] - 1) < spread
    assert all(abs(v - 1) < spread for r, v in bwd.items() if r not in odd)


def test_the_slow_node_is_a_little_slow_on_every_rank_and_last_into_the_reduce_scatter(cluster):
    store, truth = cluster
    node = truth["planted"]["slow_node"]
    ranks, spread = node["ranks"], truth["healthy_spread"] + 0.01
    assert len(ranks) == 8 and {truth["hosts"][node["host"]][i] for i in range(8)} == set(ranks)
    for phase in node["phases"]:
        rel = relative(store, phase)
        # each rank: its planted factor times a healthy rank's speed
        assert all(abs(rel[r] / node["factors"][str(r)] - 1) < spread for r in ranks), phase
        node_mean = sum(rel[r] for r in ranks) / 8
        others = [sum(rel[r] for r in rs) / len(rs) for h, rs in truth["hosts"].items()
                  if h != node["host"] and rs[0] < SPEC.ranks]
        assert node_mean > node["factor_range"][0] - 0.01 > max(others), phase
    # Last to arrive, they wait least: their reduce-scatter is the shortest on most steps.
    hits = store.rows(f"""
        SELECT count(*) FILTER (WHERE shortest IN ({','.join(map(str, ranks))})), count(*) FROM (
            SELECT step, arg_min(rank, dur_us) AS shortest FROM timings WHERE phase = '{node["comm_phase"]}'
            GROUP BY step)""")[0]
    assert hits[0] >= 0.75 * hits[1]


def test_the_intermittent_rank_is_slow_on_its_steps_only(cluster):
    store, truth = cluster
    plant = truth["planted"]["intermittent_rank"]
    on = relative(store, plant["phase"], plant["steps"])[plant["rank"]]
    off = relative(store, plant["phase"], f"NOT ({plant['steps']})")[plant["rank"]]
    spread = truth["healthy_spread"] + 0.01
    assert on > plant["factor"] * (1 - spread) and abs(off - 1) < spread


def test_the_tail_worker_decodes_long_responses_slower(cluster):
    store, truth = cluster
    plant = truth["planted"]["tail_worker"]
    per_token = dict(store.rows(f"""
        SELECT rank, median(gen_ms / response_len) FROM samples WHERE response_len > {plant['above_tokens']}
        GROUP BY rank"""))
    healthy = [v for r, v in per_token.items() if r != plant["rank"]]
    assert len(per_token) == SPEC.workers
    # Tokens past the threshold cost TAIL_FACTOR times more: a response 1/7 past it costs 1.25x per token
    # (most long ones are just past it); healthy workers differ by the healthy spread.
    assert per_token[plant["rank"]] > (1 + (TAIL_FACTOR - 1) / 8) * max(healthy)
    (gen_ok,) = store.rows("SELECT bool_and(abs(gen_end_us - gen_start_us - gen_ms * 1000) < 1) FROM samples")[0]
    assert gen_ok
    per_step = store.rows("SELECT count(*) FROM samples GROUP BY step")
    assert {n for (n,) in per_step} == {SPEC.workers * SPEC.samples_per_worker}


def test_tensor_shards_add_up_to_each_whole_tensor(cluster):
    store, _ = cluster
    model = ShardedModel(SPEC)
    whole = dict(zip(model.names, model.numel.tolist(), strict=True))
    got = store.rows("""
        SELECT step, tensor, sum(numel), bool_and(sharded), count(*), sum(w_norm ^ 2) FROM tensor_stats
        GROUP BY ALL ORDER BY ALL""")
    assert {s for s, *_ in got} == set(range(0, SPEC.steps, SPEC.tensor_every))
    assert all(n == whole[t] and sharded for _, t, n, sharded, _, _ in got)
    assert {t for _, t, *_ in got} == set(whole)
    # Norms combine as the root of summed squares: every step's shards give the whole tensor's norm.
    for _, t, _, _, _, sq in got:
        i = model.names.index(t)
        step_w = math.sqrt(sq)
        assert step_w == pytest.approx(math.sqrt(model.numel[i]) * (1.0 if model.is_norm[i] else 0.02), rel=0.02)
    (checkpoints,) = store.rows("SELECT count(*) FROM events WHERE event = 'checkpoint_save'")[0]
    assert checkpoints == SPEC.ranks * (SPEC.steps // SPEC.checkpoint_every)


def test_a_spec_places_no_fault_where_the_cluster_is_too_small():
    tiny = ClusterSpec(ranks=8, steps=2).as_dict()
    from dynascope.demo.synthetic import ClusterPlan

    planted = ClusterPlan(ClusterSpec(ranks=8, steps=2)).planted()["planted"]
    assert tiny["rollout_workers"] == 2 and "slow_node" not in planted
    assert {"slow_rank", "intermittent_rank", "tail_worker"} <= set(planted)
    assert ClusterPlan(ClusterSpec(ranks=8, steps=2, faults=False)).planted()["planted"] == {}
