"""The cluster analyses and the report on the 64-rank synthetic run (``helpers.cluster_truth``): what happens
once per step on every rank (a sharded checkpoint, a weight sync) counts once, and the planted faults are
named as what they are."""

from __future__ import annotations

import pytest

from dynascope.analyses import goodput_summary, rollout_train_overlap
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
